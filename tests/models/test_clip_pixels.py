"""LLaVA's images prepared by ``clip_pixels``: the image processor's own pixel values, bit for bit,
the same prompt as the processor run whole, and a start-up contract that refuses a fast path gone
wrong."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import fovea.models.clip_pixels as clip
from fovea.loading.contract import ContractError, check_contract
from fovea.loading.loader import load_model
from fovea.media import MediaConfig, decode_image_bytes
from fovea.models.llava import LlavaCodec
from fovea.testing.random_llava import write_model_dir


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return load_model(write_model_dir(tmp_path_factory.mktemp("llava") / "m", "tiny", seed=3), "cpu", "float32")


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A JPEG-decoded RGB image (as requests arrive) whose three channels take every uint8 value."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels.reshape(-1, 3)[:256] = np.arange(256, dtype=np.uint8)[:, None]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=95)
    return decode_image_bytes(out.getvalue(), MediaConfig())


SIZES = [(336, 336), (640, 480), (480, 640), (200, 120), (337, 500), (1280, 720), (30, 900)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_the_pixels_are_the_image_processors_bit_for_bit(llava, size):
    processor = llava.codec.image_processor
    assert clip.fast_path_supported(processor)  # the PIL backend, as fovea loads it without torchvision
    image = photo(*size, seed=sum(size))
    ours = clip.clip_pixels(image, processor)
    theirs = processor(images=[image], return_tensors="pt")["pixel_values"][0]
    assert ours.dtype == theirs.dtype == torch.float32
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)


def test_the_prompt_is_the_one_the_processor_makes_whole(llava, monkeypatch):
    codec: LlavaCodec = llava.codec
    images = [photo(640, 480, 1), photo(200, 300, 2)]
    text = f"USER: {codec.image_token}\nand {codec.image_token}\nwhat differs? ASSISTANT:"
    assert codec.prepares_pixels()
    fast = codec.encode(text, images)
    monkeypatch.setattr(LlavaCodec, "prepares_pixels", lambda self: False)
    whole = codec.encode(text, images)
    assert fast.input_ids == whole.input_ids
    assert sum(t == codec.image_token_id for t in fast.input_ids) == 2 * fast.images[0].num_tokens
    assert [torch.equal(a.pixels, b.pixels) for a, b in zip(fast.images, whole.images, strict=True)] == [True, True]
    assert [a.hash for a in fast.images] == [b.hash for b in whole.images]


def test_the_contract_refuses_a_fast_path_that_normalises_otherwise(llava, monkeypatch):
    assert check_contract(llava).recipe_fingerprint
    real = clip.normalisation

    def imagenet_std(image_processor):
        return real(image_processor).__class__(**{**real(image_processor).__dict__, "std": (0.229, 0.224, 0.225)})

    monkeypatch.setattr(clip, "normalisation", imagenet_std)
    with pytest.raises(ContractError) as info:
        check_contract(llava)
    assert [v.part for v in info.value.violations] == ["preprocessing path"]
    assert "differing by up to" in info.value.violations[0].actual


def test_other_processors_keep_their_own_path(llava):
    processor = llava.codec.image_processor

    class Torchvision:  # transformers' torchvision backend resizes with torch: not reproduced here
        backend = "torchvision"

    assert not clip.fast_path_supported(Torchvision())
    size = processor.size
    try:
        processor.size = type(size)(longest_edge=336, shortest_edge=336)  # another resize rule
        assert not clip.fast_path_supported(processor)
    finally:
        processor.size = size
    assert clip.fast_path_supported(processor)
    with pytest.raises(ValueError, match="RGB"):
        clip.clip_pixels(Image.new("L", (336, 336)), processor)
