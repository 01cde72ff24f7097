"""fovea.models.pil_resize: Pillow's bicubic resize of uint8 images, bit for bit, in torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fovea.models.pil_resize import _vertical_first, matches_pillow, pil_resize, pillow_rule


def _image(rng: np.random.Generator, height: int, width: int, channels: int = 3) -> np.ndarray:
    """Noise over the lower half, flat bands with hard edges over the upper half: the bicubic
    overshoot there reaches past 0 and 255, so the clipping is exercised too."""
    img = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    img[: height // 2] = img[: height // 2] // 64 * 85
    return img


def _pillow(img: np.ndarray, height: int, width: int) -> np.ndarray:
    mode_image = Image.fromarray(img[..., 0] if img.shape[2] == 1 else img)
    out = np.asarray(mode_image.resize((width, height), Image.Resampling.BICUBIC))
    return out[..., None] if out.ndim == 2 else out


def _check(img: np.ndarray, height: int, width: int) -> None:
    want = _pillow(img, height, width)
    got = pil_resize(torch.from_numpy(img), (height, width))
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
    diff = got.numpy() != want
    assert not diff.any(), f"{img.shape[1]}x{img.shape[0]} -> {width}x{height}: {diff.sum()} values differ"


def _corpus() -> list[tuple[int, int, int, int]]:
    """(W, H, w, h): random pairs up and down on each axis, sizes near the pass-order boundary."""
    rng = np.random.default_rng(11)
    pairs = []
    for _ in range(120):
        w0, h0, w1, h1 = (int(v) for v in rng.integers(1, 90, 4))
        pairs.append((w0, h0, w1, h1))
    for _ in range(40):  # both sides of H - h == 2 (W - w)
        w0, h0 = (int(v) for v in rng.integers(10, 90, 2))
        w1 = int(rng.integers(1, w0 + 20))
        h1 = h0 - 2 * (w0 - w1) + int(rng.integers(-1, 2))
        if h1 >= 1:
            pairs.append((w0, h0, w1, h1))
    return pairs


@pytest.mark.parametrize("pairs", [_corpus()])
def test_random_sizes_equal_pillow(pairs):
    rng = np.random.default_rng(12)
    for w0, h0, w1, h1 in pairs:
        _check(_image(rng, h0, w0), h1, w1)


@pytest.mark.parametrize(("source", "target"), [
    ((1280, 720), (1288, 728)),  # Qwen's 720p: both up, horizontal first
    ((720, 1280), (728, 1288)),
    ((1000, 700), (1008, 672)),  # width up, height down: vertical first
    ((1920, 1080), (1288, 728)),  # over max_pixels
    ((333, 517), (336, 504)),  # odd, portrait: vertical first
    ((30, 20), (56, 56)),  # tiny, upsized
])
def test_qwen_sizes_equal_pillow(source, target):
    rng = np.random.default_rng(13)
    _check(_image(rng, source[1], source[0]), target[1], target[0])


@pytest.mark.skipif(pillow_rule() != "pillow13", reason="Pillow 13's rule")
def test_both_pass_orders_are_taken_and_each_is_needed():
    """The rule picks each order somewhere, and where it picks one the other differs from Pillow:
    the order is not a detail."""
    rng = np.random.default_rng(14)
    for (w0, h0), (w1, h1), vertical in [((60, 100), (40, 59), True), ((60, 100), (40, 60), False),
                                         ((61, 47), (28, 84), False), ((40, 90), (14, 84), False),
                                         ((80, 33), (100, 30), True), ((97, 130), (56, 28), True)]:
        assert _vertical_first((h0, w0), (h1, w1)) is vertical
        img = _image(rng, h0, w0)
        want = _pillow(img, h1, w1)
        assert np.array_equal(pil_resize(torch.from_numpy(img), (h1, w1)).numpy(), want)
        other = pil_resize(torch.from_numpy(img), (h1, w1), vertical_first=not vertical).numpy()
        assert not np.array_equal(other, want), f"{(w0, h0)} -> {(w1, h1)}: both orders give Pillow's result"


@pytest.mark.parametrize(("source", "target"), [
    ((50, 40), (50, 23)), ((50, 40), (50, 77)),  # width unchanged
    ((50, 40), (13, 40)), ((50, 40), (91, 40)),  # height unchanged
    ((1, 1), (5, 7)), ((1, 50), (1, 20)), ((50, 1), (20, 1)), ((7, 7), (1, 1)), ((1, 9), (3, 5)),
    ((3, 301), (5, 56)), ((301, 3), (56, 5)), ((3, 301), (2, 150)), ((2, 500), (1, 100)),
])
def test_unchanged_axis_one_pixel_and_strips(source, target):
    rng = np.random.default_rng(15)
    _check(_image(rng, source[1], source[0]), target[1], target[0])


def test_same_size_is_a_copy():
    img = torch.from_numpy(_image(np.random.default_rng(16), 9, 7))
    out = pil_resize(img, (9, 7))
    assert torch.equal(out, img) and out.data_ptr() != img.data_ptr()


def test_one_channel_equals_pillow_l():
    rng = np.random.default_rng(17)
    for w0, h0, w1, h1 in [(40, 30, 28, 56), (90, 40, 84, 14), (33, 80, 30, 20)]:
        _check(_image(rng, h0, w0, 1), h1, w1)


@pytest.mark.parametrize("bad", [torch.zeros(4, 4, 3, dtype=torch.float32), torch.zeros(4, 4, dtype=torch.uint8),
                                 torch.zeros(1, 4, 4, 3, dtype=torch.uint8), torch.zeros(4, 4, 3, dtype=torch.int16)])
def test_refuses_other_than_hwc_uint8(bad):
    with pytest.raises(ValueError, match="uint8"):
        pil_resize(bad, (2, 2))


def test_refuses_empty_sizes():
    with pytest.raises(ValueError):
        pil_resize(torch.zeros(4, 4, 3, dtype=torch.uint8), (0, 3))


def test_self_check_passes_on_the_installed_pillow():
    assert matches_pillow()


def test_self_check_fails_under_another_order(monkeypatch):
    """A Pillow that ordered the passes otherwise (here: the opposite of the installed one's
    rule, wherever the order matters) would make the self-check refuse the device path."""
    import fovea.models.pil_resize as module

    rule = module.RULES[module.pillow_rule()]
    monkeypatch.setattr(module, "RULES", {"opposite": lambda source, target: not rule(source, target)})
    module.pillow_rule.cache_clear()
    try:
        assert not module.matches_pillow()
    finally:
        module.pillow_rule.cache_clear()


def test_the_rule_found_is_the_installed_releases():
    """Pillow's releases checked: up to 12.1 horizontal first, 12.2-12.3 tall strips vertical
    first, 13 by the reductions' sizes."""
    import PIL

    major, minor = (int(v) for v in PIL.__version__.split(".")[:2])
    expected = "pillow13" if major >= 13 else "tall-strips" if (major, minor) >= (12, 2) else "horizontal-first"
    assert pillow_rule() == expected


def test_a_pass_in_slices_is_the_same(monkeypatch):
    """Large images are resampled in slices across the other axis (bounded temporaries): slices of
    a few rows or columns, and a last short one, give Pillow's result too."""
    import fovea.models.pil_resize as module

    rng = np.random.default_rng(18)
    for chunk in (1, 7 * 3 * 5, 1000):
        monkeypatch.setattr(module, "CHUNK_ELEMENTS", chunk)
        for w0, h0, w1, h1 in [(37, 23, 29, 41), (40, 90, 14, 84), (64, 48, 56, 56)]:
            _check(_image(rng, h0, w0), h1, w1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the resize on a CUDA GPU")
@pytest.mark.parametrize("source,target", [((720, 1280), (728, 1288)), ((2160, 3840), (728, 1288)),
                                           ((1080, 1920), (1092, 1932)), ((1280, 720), (1288, 728)),
                                           ((301, 3), (224, 224)), ((517, 333), (504, 336))])
def test_cuda_equals_pillow(source, target):
    """The same integers on the GPU: Qwen's 720p, 4K-down and portrait sizes, both pass orders."""
    rng = np.random.default_rng(sum(source) + sum(target))
    img = _image(rng, *source)
    got = pil_resize(torch.from_numpy(img).cuda(), target)
    assert got.is_cuda
    np.testing.assert_array_equal(got.cpu().numpy(), _pillow(img, *target))
