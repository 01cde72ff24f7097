"""Qwen-VL images resized in the API process and patched on the device (``fovea.models.qwen_pixels``):
the two halves together are transformers' ``Qwen2VLImageProcessor``, bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from test_qwen2_5_vl import noise, qwen  # noqa: F401 - the module's fixture
from transformers import Qwen2VLImageProcessorPil

import fovea.models.qwen2_5_vl as family
from fovea.engine.vision.encoder_cache import EncoderCache
from fovea.engine.vision.image_encoder import ImageEncoder
from fovea.loading.contract import ContractError, check_contract
from fovea.models.base import EncodeOptions, ImageInput
from fovea.models.qwen2_5_vl import QwenCodec, QwenProcessor
from fovea.models.qwen_pixels import PatchRecipe, is_resized_image, vision_pixels

# Qwen2.5-VL-7B's preprocessor_config.json: 4 to 16,384 tokens of 28 x 28 px.
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
SIZES = {"720p": (1280, 720), "portrait": (720, 1280), "odd": (333, 517), "near min_pixels": (40, 50),
         "over max_pixels": (4100, 3300)}


@pytest.fixture(scope="module")
def codec_7b(qwen):  # noqa: F811
    """A codec with Qwen2.5-VL-7B's image processor settings (the tiny model's tokenizer)."""
    ip = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2,
                               merge_size=2)
    return QwenCodec(QwenProcessor(qwen.tokenizer, ip), "<|image_pad|>", qwen.image_token_id, torch.float32)


@pytest.mark.parametrize("name", list(SIZES))
def test_the_patches_made_on_the_device_are_the_processors(codec_7b, name):
    width, height = SIZES[name]
    image = noise(width, height, seed=len(name))
    (item,) = codec_7b._image_inputs([image])
    theirs = codec_7b.image_processor(images=[image], return_tensors="pt")
    # What crosses to the engine core: the resized uint8 image, a multiple of 28 px on each side.
    _, h, w = item.grid
    assert is_resized_image(item.pixels) and item.pixels.shape == (h * 14, w * 14, 3)
    assert [item.grid] == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
    assert item.num_tokens == h * w // 4
    ours = PatchRecipe.of(codec_7b.image_processor).patches(item.pixels)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs["pixel_values"])
    if name == "720p":  # the image: 4,784 patches, 2.8 MB of uint8 instead of 22.5 MB of float32
        assert ours.shape == (4784, 1176) and item.pixels.numel() == 728 * 1288 * 3
    if name == "over max_pixels":
        assert h * w * 196 <= MAX_PIXELS < 4100 * 3300
    if name == "near min_pixels":
        assert h * w * 196 >= MIN_PIXELS > round(50 / 28) * 28 * round(40 / 28) * 28


def test_low_detail_images_are_resized_within_their_cap(codec_7b):
    image = noise(1280, 720, 5)
    (item,) = codec_7b._image_inputs([image], EncodeOptions(low_detail=(True,)))
    theirs = codec_7b.image_processor(images=[image], return_tensors="pt",
                                      size={"shortest_edge": MIN_PIXELS, "longest_edge": 512 * 512})
    assert [item.grid] == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
    assert torch.equal(PatchRecipe.of(codec_7b.image_processor).patches(item.pixels), theirs["pixel_values"])


def test_the_recipe_is_read_from_the_processor(codec_7b):
    """Another mean, std or rescale factor on the processor changes the patches as it changes the
    processor's own: nothing is written down in fovea."""
    ip = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, image_mean=[0.5, 0.4, 0.3],
                               image_std=[0.2, 0.25, 0.3], rescale_factor=1 / 127.5)
    image = noise(333, 517, 9)
    item = QwenCodec(QwenProcessor(codec_7b.tokenizer, ip), "<|image_pad|>", 1, torch.float32)._image_inputs([image])[0]
    ours = PatchRecipe.of(ip).patches(item.pixels)
    assert torch.equal(ours, ip(images=[image], return_tensors="pt")["pixel_values"])
    assert not torch.equal(ours, PatchRecipe.of(codec_7b.image_processor).patches(item.pixels))


def test_a_processor_that_does_not_resize_with_pil_keeps_the_whole_processor(codec_7b, monkeypatch):
    monkeypatch.setattr(family, "host_resize_supported", lambda ip: False)
    image = noise(333, 517, 4)
    (item,) = codec_7b._image_inputs([image])
    theirs = codec_7b.image_processor(images=[image], return_tensors="pt")
    assert not is_resized_image(item.pixels) and torch.equal(item.pixels, theirs["pixel_values"])
    # The vision stage takes patches as they are.
    assert torch.equal(vision_pixels([item], lambda: pytest.fail("no recipe needed"), torch.device("cpu"),
                                     torch.float32), item.pixels)


def test_non_rgb_images_are_converted_as_the_processor_converts_them(codec_7b):
    rgba = noise(120, 90, 3).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((120, 90)))
    for image in (rgba, noise(100, 70, 2).convert("L")):
        (item,) = codec_7b._image_inputs([image])
        theirs = codec_7b.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        assert torch.equal(PatchRecipe.of(codec_7b.image_processor).patches(item.pixels), theirs)


def test_images_and_video_patches_reach_the_device_with_their_own_dtypes(qwen):  # noqa: F811
    """The engine's copy to the device keeps a resized image uint8 beside a video's float patches
    (a copy per dtype: one cat would promote the image to float and lose what it is)."""
    image = qwen.codec._image_inputs([noise(90, 60, 1)])[0]
    video = ImageInput(torch.randn(16, 1176), 4, "video", (2, 4, 2), 1.0, 5)
    stub = type("Loaded", (), {"device": torch.device("meta")})()
    moved = ImageEncoder(stub, EncoderCache(0), encode=lambda images: []).to_device([image, video])
    assert [m.pixels.device.type for m in moved] == ["meta", "meta"]
    assert [m.pixels.dtype for m in moved] == [torch.uint8, torch.float32]
    assert [m.pixels.shape for m in moved] == [image.pixels.shape, video.pixels.shape]


def test_the_contract_catches_a_wrong_normalisation(tmp_path):
    """On the new path the mean and std are applied in the vision stage: a processor whose mean
    differs from the model's files is still refused (the recipe), and a vision stage that
    normalises otherwise than the processor is refused too (the preprocessing path)."""
    from fovea.loading.loader import load_model
    from fovea.testing.random_qwen2_5_vl import write_model_dir

    loaded = load_model(write_model_dir(tmp_path / "q", arch="tiny", seed=3), "cpu", "float32")
    assert check_contract(loaded).recipe_fingerprint

    real = PatchRecipe.of
    with pytest.MonkeyPatch.context() as patch:  # the vision stage with ImageNet's std, the processor as it was
        patch.setattr(PatchRecipe, "of", classmethod(lambda cls, ip: dataclasses.replace(
            real(ip), std=(0.229, 0.224, 0.225))))
        with pytest.raises(ContractError) as info:
            check_contract(loaded)
    assert [v.part for v in info.value.violations] == ["preprocessing path"]
    assert "differing by up to" in info.value.violations[0].actual

    loaded.codec.image_processor.image_mean = [0.485, 0.456, 0.406]  # changed behind the contract's back
    with pytest.raises(ContractError) as info:
        check_contract(loaded)
    assert [v.part for v in info.value.violations] == ["preprocessing recipe"]
    # ... and the vision stage does follow it: the patches are the changed processor's.
    image = noise(200, 120, 1)
    (item,) = loaded.codec._image_inputs([image])
    assert torch.equal(loaded.adapter.patch_recipe(loaded).patches(item.pixels),
                       loaded.codec.image_processor(images=[image], return_tensors="pt")["pixel_values"])


def test_the_model_directory_is_read_with_the_pil_backend_whatever_is_installed(qwen):  # noqa: F811
    # With torchvision installed transformers picks its torchvision twin unless told; fovea asks
    # for PIL, so the resize and the device patching are the same on every host.
    from fovea.models.qwen_pixels import host_resize_supported

    assert getattr(qwen.codec.image_processor, "backend", None) == "pil"
    assert host_resize_supported(qwen.codec.image_processor)


# ---- the resize deferred to the vision stage (QwenCodec.resize_on_device: the engine on CUDA) -------------------

# Qwen's often-used 1,280-token cap: a 1080p photo is over it, and within DEFER_MAX_RATIO of its target.
CAPPED_MAX_PIXELS = 1280 * 28 * 28
DEFERRED = {"720p": ((1280, 720), MAX_PIXELS), "portrait": ((720, 1280), MAX_PIXELS),
            "odd": ((333, 517), MAX_PIXELS), "near min_pixels": ((40, 50), MAX_PIXELS),
            "tiny, upscaled": ((9, 13), MAX_PIXELS), "1 px wide": ((1, 60), MAX_PIXELS),
            "over max_pixels": ((1920, 1080), CAPPED_MAX_PIXELS), "over max_pixels, tall": ((700, 2900), CAPPED_MAX_PIXELS)}


def deferring_codec(tokenizer, max_pixels: int = MAX_PIXELS, **kwargs) -> QwenCodec:
    ip = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2,
                                  merge_size=2, **kwargs)
    codec = QwenCodec(QwenProcessor(tokenizer, ip), "<|image_pad|>", 1, torch.float32)
    codec.resize_on_device = True  # as the loader sets it where the model runs on CUDA
    return codec


@pytest.mark.parametrize("name", list(DEFERRED))
def test_deferred_images_cross_at_their_own_size_and_patch_to_the_processors_values(codec_7b, name):
    (width, height), max_pixels = DEFERRED[name]
    codec = deferring_codec(codec_7b.tokenizer, max_pixels)
    image = noise(width, height, seed=len(name))
    (item,) = codec._image_inputs([image])
    theirs = codec.image_processor(images=[image], return_tensors="pt")
    assert [item.grid] == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
    _, h, w = item.grid
    # What crosses to the engine core: the decoded image, not resized, whose size differs from the grid's.
    assert is_resized_image(item.pixels) and item.pixels.shape[:2] != (h * 14, w * 14)
    assert item.pixels.shape == (height, width, 3)
    # ... and what the vision stage makes of it is the processor's pixel_values, bit for bit.
    ours = vision_pixels([item], lambda: PatchRecipe.of(codec.image_processor), torch.device("cpu"), torch.float32)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs["pixel_values"])
    # The key is the decoded pixels' and the grid's: the host-resized image has its own.
    codec.resize_on_device = False
    (host,) = codec._image_inputs([image])
    assert host.grid == item.grid and host.pixels.shape == (h * 14, w * 14, 3) and host.hash != item.hash
    assert torch.equal(PatchRecipe.of(codec.image_processor).resized(item.pixels, item.grid), host.pixels)


def test_a_batch_of_deferred_images_and_host_resized_ones_patches_each_to_its_grid(codec_7b):
    codec = deferring_codec(codec_7b.tokenizer, CAPPED_MAX_PIXELS)
    images = [noise(1280, 720, 1), noise(64, 64, 2), noise(333, 517, 3)]
    items = codec._image_inputs(images)
    codec.resize_on_device = False
    items[1] = codec._image_inputs([images[1]])[0]  # resized on the host: at its grid's size already
    theirs = codec.image_processor(images=images, return_tensors="pt")["pixel_values"]
    ours = vision_pixels(items, lambda: PatchRecipe.of(codec.image_processor), torch.device("cpu"), torch.float32)
    assert torch.equal(ours, theirs)


def test_large_originals_are_still_resized_on_the_host(codec_7b):
    """Over DEFER_MAX_RATIO times the target's pixels, or over DEFER_MAX_PIXELS, the decoded bytes
    would cross the shared memory for little: the API process resizes those."""
    from fovea.models import qwen_pixels

    codec = deferring_codec(codec_7b.tokenizer, CAPPED_MAX_PIXELS)
    for width, height in [(2600, 1600), (4100, 3300)]:  # 4.1x its target; 13.5 Mpx
        (item,) = codec._image_inputs([noise(width, height, 7)])
        _, h, w = item.grid
        assert item.pixels.shape == (h * 14, w * 14, 3)
        assert width * height > min(qwen_pixels.DEFER_MAX_RATIO * h * w * 196, qwen_pixels.DEFER_MAX_PIXELS)
    (item,) = deferring_codec(codec_7b.tokenizer, MAX_PIXELS)._image_inputs([noise(4100, 3300, 7)])
    assert 4100 * 3300 > qwen_pixels.DEFER_MAX_PIXELS and item.pixels.shape == (item.grid[1] * 14, item.grid[2] * 14, 3)
    (item,) = codec._image_inputs([noise(2400, 1600, 7)])  # 3.8x its target: deferred
    assert item.pixels.shape == (1600, 2400, 3)


def test_only_a_bicubic_processor_and_a_matching_pillow_defer_the_resize(codec_7b, monkeypatch):
    from fovea.models import pil_resize

    image = noise(333, 517, 6)
    bilinear = deferring_codec(codec_7b.tokenizer, resample=Image.Resampling.BILINEAR)
    (item,) = bilinear._image_inputs([image])
    assert item.pixels.shape == (item.grid[1] * 14, item.grid[2] * 14, 3)
    theirs = bilinear.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert torch.equal(PatchRecipe.of(bilinear.image_processor).patches(item.pixels, grid=item.grid), theirs)
    # The recipe refuses to resize what it cannot resize as the processor does.
    original = torch.from_numpy(np.array(image))
    with pytest.raises(ValueError, match="BICUBIC"):
        PatchRecipe.of(bilinear.image_processor).patches(original, grid=item.grid)
    # A Pillow whose resize pil_resize does not match (its self-check fails): resized on the host.
    monkeypatch.setattr(pil_resize, "matches_pillow", lambda: False)
    (item,) = deferring_codec(codec_7b.tokenizer)._image_inputs([image])
    assert item.pixels.shape == (item.grid[1] * 14, item.grid[2] * 14, 3)


def test_the_codec_resizes_on_the_host_unless_the_model_runs_on_cuda(qwen):  # noqa: F811
    assert qwen.device.type == "cpu" and qwen.codec.resize_on_device is False
    (item,) = qwen.codec._image_inputs([noise(333, 517, 1)])
    assert item.pixels.shape == (item.grid[1] * 14, item.grid[2] * 14, 3)


def test_the_contract_and_the_vision_stages_take_deferred_images(tmp_path, monkeypatch):
    """Served as on a GPU (the resize deferred), the start-up check finds the vision stage's
    pixel_values equal to the processor's; the model's own vision forward and the fused stage
    (an encode worker's too) give the rows of the host-resized images."""
    from fovea.disagg.encode_worker import vision_stage
    from fovea.engine.vision import vision_fused
    from fovea.loading.loader import load_model
    from fovea.loading.vision_part import load_vision_part
    from fovea.testing.random_qwen2_5_vl import write_model_dir

    path = write_model_dir(tmp_path / "q", arch="tiny", seed=3)
    loaded = load_model(path, "cpu", "float32")
    loaded.codec.resize_on_device = True
    assert check_contract(loaded).recipe_fingerprint
    images = [noise(333, 517, 1), noise(200, 120, 2)]
    deferred = loaded.codec._image_inputs(images)
    assert all(item.pixels.shape[:2] != (item.grid[1] * 14, item.grid[2] * 14) for item in deferred)
    loaded.codec.resize_on_device = False
    host = loaded.codec._image_inputs(images)
    forward = loaded.adapter.vision_forward(loaded)
    for ours, want in zip(forward(deferred), forward(host), strict=True):
        assert torch.equal(ours, want)
    monkeypatch.setattr(vision_fused, "platform_problem", lambda loaded: None)  # as on a GPU with triton
    part = load_vision_part(path, "cpu", "float32")
    encode, label = vision_stage(part, fused=True)
    assert label.startswith("fused")
    for ours, want in zip(encode(deferred), encode(host), strict=True):
        assert torch.equal(ours, want)


def test_the_choice_reaches_preprocess_worker_processes(codec_7b):
    """--preprocess-workers processes get a pickled copy of the codec: the start-up choice goes with it."""
    import pickle

    copy = pickle.loads(pickle.dumps(deferring_codec(codec_7b.tokenizer)))
    assert copy.resize_on_device is True
    (item,) = copy._image_inputs([noise(333, 517, 2)])
    assert item.pixels.shape == (517, 333, 3)
