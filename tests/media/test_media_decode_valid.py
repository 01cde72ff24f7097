"""Unusual but valid images decode to the same pixels as their plain, upright RGB equivalent.

Expected pixels are computed with numpy from the source arrays, not by asking PIL to convert, so a
decoder that clips 16-bit data, drops alpha or ignores EXIF orientation cannot agree by accident.
"""

from __future__ import annotations

import numpy as np
import pytest
from media_helpers import composite, encode, max_diff, mean_diff, pattern, png, png_chunk, rgb, smooth
from PIL import Image, ImageOps

from fovea.media import ImageStore, MediaConfig, decode_image_bytes

CONFIG = MediaConfig()
LOSSLESS_RGB = [("PNG", {}), ("BMP", {}), ("TIFF", {}), ("TIFF", {"compression": "tiff_lzw"}),
                ("TIFF", {"compression": "tiff_adobe_deflate"}), ("WEBP", {"lossless": True})]


def decode(data: bytes, config: MediaConfig = CONFIG) -> Image.Image:
    im = decode_image_bytes(data, config)
    assert im.mode == "RGB"
    return im


def grey(width: int = 37, height: int = 23) -> np.ndarray:
    return pattern(width, height)[..., 0]


def as_rgb(grey_arr: np.ndarray) -> np.ndarray:
    return np.repeat(grey_arr[..., None], 3, axis=-1)


@pytest.mark.parametrize(("fmt", "kwargs"), LOSSLESS_RGB, ids=lambda v: str(v))
def test_rgb_lossless_formats_are_exact(fmt: str, kwargs: dict) -> None:
    assert max_diff(decode(encode(rgb(), fmt, **kwargs)), pattern()) == 0


@pytest.mark.parametrize(("fmt", "kwargs", "tolerance"), [
    ("JPEG", {"quality": 95}, 2.0), ("JPEG", {"quality": 95, "progressive": True}, 2.0),
    ("JPEG", {"quality": 95, "subsampling": 0}, 2.0), ("WEBP", {"quality": 95}, 3.0),
])
def test_rgb_lossy_formats_are_close(fmt: str, kwargs: dict, tolerance: float) -> None:
    assert mean_diff(decode(encode(Image.fromarray(smooth()), fmt, **kwargs)), smooth()) < tolerance


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "GIF"])
def test_mode_1(fmt: str) -> None:
    bits = grey() > 128
    im = Image.fromarray(bits)
    assert im.mode == "1"
    assert max_diff(decode(encode(im, fmt)), as_rgb(bits.astype(np.uint8) * 255)) == 0


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "GIF", "WEBP"])
def test_mode_l(fmt: str) -> None:
    kwargs = {"lossless": True} if fmt == "WEBP" else {}
    assert max_diff(decode(encode(Image.fromarray(grey(), "L"), fmt, **kwargs)), as_rgb(grey())) == 0


def test_mode_l_jpeg() -> None:
    values = smooth()[..., 0]
    assert mean_diff(decode(encode(Image.fromarray(values, "L"), "JPEG", quality=95)), as_rgb(values)) < 2


@pytest.mark.parametrize("background", [(255, 255, 255), (0, 128, 255)])
@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_mode_la_is_composited(fmt: str, background: tuple[int, int, int]) -> None:
    alpha = pattern(seed=7)[..., 1]
    im = Image.fromarray(np.stack([grey(), alpha], axis=-1), "LA")
    expected = composite(np.concatenate([as_rgb(grey()), alpha[..., None]], axis=-1), background)
    assert max_diff(decode(encode(im, fmt), MediaConfig(background=background)), expected) <= 1


@pytest.mark.parametrize("background", [(255, 255, 255), (10, 200, 30)])
@pytest.mark.parametrize(("fmt", "kwargs"), [("PNG", {}), ("TIFF", {}), ("WEBP", {"lossless": True})])
def test_mode_rgba_is_composited(fmt: str, kwargs: dict, background: tuple[int, int, int]) -> None:
    rgba = np.concatenate([pattern(), pattern(seed=3)[..., :1]], axis=-1)
    rgba[0, :, 3] = 0  # fully transparent row: must show the background, not the hidden colour
    rgba[1, :, 3] = 255
    out = decode(encode(Image.fromarray(rgba, "RGBA"), fmt, **kwargs), MediaConfig(background=background))
    assert max_diff(out, composite(rgba, background)) <= 1
    assert (np.asarray(out)[0] == background).all()


def _palette_image() -> tuple[Image.Image, np.ndarray, np.ndarray]:
    indices = (grey() // 16).astype(np.uint8)  # 16 colours
    palette = np.array([[i * 16, 255 - i * 16, (i * 97) % 256] for i in range(16)], np.uint8)
    im = Image.fromarray(indices, "P")
    im.putpalette(palette.flatten().tolist())
    return im, indices, palette


@pytest.mark.parametrize("fmt", ["PNG", "GIF", "BMP", "TIFF"])
def test_mode_p(fmt: str) -> None:
    im, indices, palette = _palette_image()
    assert max_diff(decode(encode(im, fmt)), palette[indices]) == 0


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_mode_p_with_transparent_index(fmt: str) -> None:
    im, indices, palette = _palette_image()
    background = (1, 2, 3)
    expected = palette[indices].copy()
    expected[indices == 5] = background
    out = decode(encode(im, fmt, transparency=5), MediaConfig(background=background))
    assert max_diff(out, expected) == 0


def test_mode_p_with_partial_alpha_palette_png() -> None:
    im, indices, palette = _palette_image()
    alphas = bytes((i * 17) % 256 for i in range(16))
    rgba = np.concatenate([palette[indices], np.frombuffer(alphas, np.uint8)[indices][..., None]], axis=-1)
    assert max_diff(decode(encode(im, "PNG", transparency=alphas)), composite(rgba, (255, 255, 255))) <= 1


def test_mode_pa_is_composited() -> None:
    im, indices, palette = _palette_image()
    alpha = pattern(seed=9)[..., 2]
    pa = im.convert("PA")
    pa.putalpha(Image.fromarray(alpha, "L"))
    rgba = np.concatenate([palette[indices], alpha[..., None]], axis=-1)
    # PNG stores PA as RGBA; the pixels must still be the composite of palette colour and alpha.
    assert max_diff(decode(encode(pa.convert("RGBA"), "PNG")), composite(rgba, (255, 255, 255))) <= 1


@pytest.mark.parametrize(("fmt", "exact"), [("TIFF", True), ("JPEG", False)])
def test_mode_cmyk(fmt: str, exact: bool) -> None:
    arr = smooth()
    cmyk = np.concatenate([255 - arr, np.zeros(arr.shape[:2] + (1,), np.uint8)], axis=-1)
    data = encode(Image.fromarray(cmyk, "CMYK"), fmt, **({} if exact else {"quality": 95}))
    out = decode(data)
    if exact:
        assert max_diff(out, arr) == 0
    else:
        assert mean_diff(out, arr) < 2


def _sixteen_bit() -> tuple[np.ndarray, np.ndarray]:
    """16-bit samples whose high byte is the expected 8-bit value and whose low byte is noise."""
    high = grey().astype(np.uint16)
    low = pattern(seed=5)[..., 2].astype(np.uint16)
    return (high << 8) | low, high.astype(np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_mode_i16_is_scaled_not_clipped(fmt: str) -> None:
    samples, expected = _sixteen_bit()
    im = Image.fromarray(samples)
    assert im.mode == "I;16"
    assert max_diff(decode(encode(im, fmt)), as_rgb(expected)) == 0


def test_mode_i16_big_endian_tiff() -> None:
    samples, expected = _sixteen_bit()
    im = Image.fromarray(samples.astype(">u2"))
    assert im.mode == "I;16B"
    assert max_diff(decode(encode(im, "TIFF")), as_rgb(expected)) == 0


def test_mode_i32_holding_16_bit_data() -> None:
    samples, expected = _sixteen_bit()
    im = Image.fromarray(samples.astype(np.int32))
    assert im.mode == "I"
    assert max_diff(decode(encode(im, "TIFF")), as_rgb(expected)) == 0


def test_mode_i32_full_range() -> None:
    samples = grey().astype(np.uint32) << 24 | 0x00ABCDEF
    decoded = decode(encode(Image.fromarray(samples.view(np.int32), "I"), "TIFF"))
    assert max_diff(decoded, as_rgb(grey())) == 0


def test_mode_f_unit_range() -> None:
    values = grey().astype(np.float32) / 255.0
    assert max_diff(decode(encode(Image.fromarray(values, "F"), "TIFF")), as_rgb(grey())) == 0


def test_16_bit_rgb_png_uses_high_byte() -> None:
    samples = (pattern().astype(np.uint16) << 8) | 0x7F
    data = png(37, 23, bit_depth=16, colour_type=2, rows=samples.astype(">u2").tobytes())
    assert max_diff(decode(data), pattern()) == 0


def test_16_bit_rgba_png_is_composited() -> None:
    rgba8 = np.concatenate([pattern(), pattern(seed=4)[..., :1]], axis=-1)
    samples = (rgba8.astype(np.uint16) << 8) | 0x80
    data = png(37, 23, bit_depth=16, colour_type=6, rows=samples.astype(">u2").tobytes())
    assert max_diff(decode(data), composite(rgba8, (255, 255, 255))) <= 1


def test_16_bit_grey_png_with_transparent_value() -> None:
    samples, expected = _sixteen_bit()
    key = int(samples[3, 4])
    data = png(37, 23, bit_depth=16, colour_type=0, rows=samples.astype(">u2").tobytes(),
               extra=(png_chunk(b"tRNS", key.to_bytes(2, "big")),))
    want = as_rgb(expected).copy()
    want[samples == key] = (9, 9, 9)
    assert max_diff(decode(data, MediaConfig(background=(9, 9, 9))), want) == 0


# --- EXIF orientation: the stored pixels are the upright image transformed per the EXIF spec ---

def _stored_for(upright: np.ndarray, orientation: int) -> np.ndarray:
    """Inverse of what a viewer does for each EXIF orientation (TIFF 6.0 / EXIF 2.3 tag 274)."""
    return {
        1: lambda a: a,
        9: lambda a: a,  # not a valid orientation: viewers ignore it
        2: np.fliplr,
        3: lambda a: np.rot90(a, 2),
        4: np.flipud,
        5: lambda a: a.swapaxes(0, 1),
        6: lambda a: np.rot90(a, 1),   # viewer rotates 90 degrees clockwise
        7: lambda a: np.rot90(a.swapaxes(0, 1), 2),
        8: lambda a: np.rot90(a, -1),  # viewer rotates 90 degrees counter-clockwise
    }[orientation](upright)


def _with_orientation(orientation: int, fmt: str, upright: np.ndarray | None = None, **kwargs) -> bytes:
    upright = pattern() if upright is None else upright
    stored = Image.fromarray(np.ascontiguousarray(_stored_for(upright, orientation)), "RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(stored, fmt, exif=exif.tobytes(), **kwargs)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_png_exact(orientation: int) -> None:
    assert max_diff(decode(_with_orientation(orientation, "PNG")), pattern()) == 0


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_jpeg(orientation: int) -> None:
    decoded = decode(_with_orientation(orientation, "JPEG", smooth(), quality=95))
    assert mean_diff(decoded, smooth()) < 2


@pytest.mark.parametrize("orientation", [3, 6])
def test_exif_orientation_webp_and_tiff(orientation: int) -> None:
    assert max_diff(decode(_with_orientation(orientation, "WEBP", lossless=True)), pattern()) == 0
    assert max_diff(decode(_with_orientation(orientation, "TIFF")), pattern()) == 0


def test_exif_rotated_dimensions_are_upright_in_the_store() -> None:
    stored = ImageStore(CONFIG).put(_with_orientation(6, "PNG"))
    assert (stored.width, stored.height) == (37, 23)


def test_exif_transpose_failure_is_ignored_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Camera EXIF is often junk; an image whose orientation cannot be read is shown as stored.
    def explode(image: Image.Image) -> Image.Image:
        raise SyntaxError("bad EXIF")

    monkeypatch.setattr(ImageOps, "exif_transpose", explode)
    assert max_diff(decode(_with_orientation(6, "PNG")), _stored_for(pattern(), 6)) == 0


@pytest.mark.parametrize("orientation", [None, 1, 9])
def test_an_upright_image_is_not_copied(orientation: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing to turn: the decoded pixels are returned as they are, not copied (a 720p copy is 2.8 MB
    # and half a millisecond of the API process's time to first token).
    data = encode(Image.fromarray(smooth()), "JPEG", quality=95) if orientation is None else \
        _with_orientation(orientation, "JPEG", smooth(), quality=95)
    copies = []
    real_copy = Image.Image.copy
    monkeypatch.setattr(Image.Image, "copy", lambda self: copies.append(self.size) or real_copy(self))
    assert mean_diff(decode(data), smooth()) < 2
    assert copies == []


def test_out_of_range_orientation_is_ignored() -> None:
    assert max_diff(decode(_with_orientation(9, "PNG", _stored_for(pattern(), 1))), pattern()) == 0


def test_corrupt_exif_block_is_ignored_not_refused() -> None:
    data = encode(Image.fromarray(smooth()), "JPEG", quality=95, exif=b"Exif\x00\x00II*\x00\xff\xff\xff\x7f")
    assert mean_diff(decode(data), smooth()) < 2


# --- animations and multi-page files: the first frame, exactly ---

def _frames() -> list[Image.Image]:
    im, _, _ = _palette_image()
    return [im, Image.fromarray(255 - np.asarray(im)).convert("P"), im.transpose(Image.Transpose.ROTATE_180)]


def test_animated_gif_first_frame() -> None:
    first, *rest = _frames()
    data = encode(first, "GIF", save_all=True, append_images=rest, duration=50, loop=0)
    assert Image.open(__import__("io").BytesIO(data)).n_frames == 3
    assert max_diff(decode(data), first.convert("RGB")) == 0


def test_animated_png_first_frame() -> None:
    first, second = rgb(), rgb(seed=1)
    data = encode(first, "PNG", save_all=True, append_images=[second], duration=50)
    assert max_diff(decode(data), pattern()) == 0


def test_animated_webp_first_frame() -> None:
    first, second = rgb(), Image.fromarray(255 - pattern())
    data = encode(first, "WEBP", save_all=True, append_images=[second], lossless=True, duration=50)
    assert data[12:16] == b"VP8X"
    assert max_diff(decode(data), pattern()) == 0


def test_multipage_tiff_first_page() -> None:
    data = encode(rgb(), "TIFF", save_all=True, append_images=[rgb(seed=2), rgb(seed=3)])
    assert max_diff(decode(data), pattern()) == 0


def test_result_is_fully_loaded_and_detached() -> None:
    im = decode(encode(rgb(), "PNG"))
    assert im.size == (37, 23) and np.asarray(im).shape == (23, 37, 3)


def test_pixel_cap_boundary_is_inclusive() -> None:
    exact = MediaConfig(max_image_pixels=37 * 23)
    assert decode(encode(rgb(), "PNG"), exact).size == (37, 23)
    with pytest.raises(Exception) as info:
        decode(encode(rgb(), "PNG"), MediaConfig(max_image_pixels=37 * 23 - 1))
    assert getattr(info.value, "code", None) == "image_too_large"
