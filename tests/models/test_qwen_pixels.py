"""Qwen-VL images resized in the API process and patched on the device (``fovea.models.qwen_pixels``):
the two halves together are transformers' ``Qwen2VLImageProcessor``, bit for bit."""

from __future__ import annotations

import dataclasses

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
