"""A generated corpus of malformed, hostile and unsupported inputs, each with its exact refusal.

Every case names the error class, code and HTTP status it must produce, so a change that turns a
"truncated PNG" into a generic error (or, worse, a 500) fails here.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import pytest
from media_helpers import (
    bmp_header,
    encode,
    gif_header,
    jpeg_header,
    png,
    png_chunk,
    refusal,
    rgb,
    tiff_header,
    webp_header,
)
from PIL import Image, ImageFile

from fovea.media import ImageStore, MediaConfig, MediaResolver, decode_image_bytes
from fovea.media.errors import (
    ImageTooLarge,
    ImageTooManyPixels,
    MalformedImage,
    MediaSourceForbidden,
    UnsupportedImageFormat,
)

INVALID = (MalformedImage, "invalid_image", 400)
UNSUPPORTED = (UnsupportedImageFormat, "unsupported_image_format", 400)
PIXELS = (ImageTooManyPixels, "image_too_large", 400)
BYTES = (ImageTooLarge, "image_too_large", 413)
FORBIDDEN = (MediaSourceForbidden, "media_source_forbidden", 403)


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes | str  # bytes go to decode_image_bytes, str to MediaResolver.load
    expect: tuple[type, str, int]


def _cuts(data: bytes, n: int, keep_tail: int) -> list[int]:
    """``n`` cut points spread over the file, never inside the last ``keep_tail`` bytes.

    The tail is spared because losing only a trailer (PNG's IEND, IDAT CRC and zlib checksum, GIF's
    ';') leaves every pixel intact, and PIL rightly decodes such files.
    """
    return sorted({int(x) for x in np.linspace(1, len(data) - keep_tail - 1, n)})


def _truncations() -> list[Case]:
    base = rgb(64, 48)
    sources = {
        "jpeg": (encode(base, "JPEG", quality=90), 30, 1),
        "jpeg-progressive": (encode(base, "JPEG", progressive=True), 8, 1),
        "png": (encode(base, "PNG"), 30, 32),
        "gif": (encode(base.convert("P"), "GIF"), 8, 3),
        "webp": (encode(base, "WEBP", quality=80), 8, 1),
        "bmp": (encode(base, "BMP"), 8, 1),
        "tiff": (encode(base, "TIFF"), 8, 1),
    }
    return [Case(f"truncated-{name}-{cut}of{len(data)}", data[:cut], INVALID)
            for name, (data, n, keep_tail) in sources.items() for cut in _cuts(data, n, keep_tail)]


def _garbage() -> list[Case]:
    rng = np.random.default_rng(1234)
    cases = [Case(f"random-{i}-{size}", rng.integers(0, 256, size, dtype=np.uint8).tobytes(), INVALID)
             for i, size in enumerate([1, 2, 3, 7, 16, 100, 1000, 4096, 65536, 12345])]
    texts = {
        "empty": b"", "space": b" ", "nul": b"\x00", "newlines": b"\n\n\n",
        "text": b"hello, this is not an image", "json": b'{"image": "cat.png"}',
        "path": b"/home/user/cat.png", "url": b"https://example.com/cat.png",
        "html": b"<!DOCTYPE html><html><body>403 Forbidden</body></html>",
        "html-lower": b"  <html><head><title>x</title></head></html>",
        "xml-not-svg": b"<?xml version='1.0'?><note>hi</note>",
        "utf8-text": "ceci n'est pas une pipe \u00e9\u00e8".encode(),
        "base64-text": base64.b64encode(encode(rgb(4, 4), "PNG")),  # base64 where bytes were expected
        "riff-wave": b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 32,
        "zip": b"PK\x03\x04" + b"\x00" * 40,
        "gzip": b"\x1f\x8b\x08\x00" + b"\x00" * 30,
        "elf": b"\x7fELF" + b"\x00" * 60,
    }
    return cases + [Case(f"garbage-{k}", v, INVALID) for k, v in texts.items()]


def _corrupt_structures() -> list[Case]:
    good_png = encode(rgb(16, 16), "PNG")
    bad_ihdr_crc = bytearray(good_png)
    bad_ihdr_crc[29] ^= 0xFF  # IHDR's CRC
    jpeg = encode(rgb(16, 16), "JPEG")
    return [
        Case("png-bad-ihdr-crc", bytes(bad_ihdr_crc), INVALID),
        Case("png-signature-only", good_png[:8], INVALID),
        Case("png-no-idat", png(4, 4), INVALID),
        Case("png-bad-zlib",
             png(4, 4)[:-12] + png_chunk(b"IDAT", b"not zlib at all") + png_chunk(b"IEND", b""), INVALID),
        Case("png-short-rows", png(4, 4, rows=b"\x01\x02\x03" * 5), INVALID),
        Case("png-bad-colour-type", png(4, 4, colour_type=5, rows=b"\x00" * 48), INVALID),
        Case("png-bad-bit-depth", png(4, 4, bit_depth=7, rows=b"\x00" * 48), INVALID),
        Case("jpeg-soi-only", b"\xff\xd8", INVALID),
        Case("jpeg-soi-eoi", b"\xff\xd8\xff\xd9", INVALID),
        Case("jpeg-header-no-scan", jpeg_header(8, 8), INVALID),
        Case("jpeg-magic-then-garbage", jpeg[:3] + b"\x00" * 200, INVALID),
        Case("gif-magic-only", b"GIF89a", INVALID),
        Case("gif-header-no-frame", gif_header(4, 4)[:13], INVALID),
        Case("bmp-magic-only", b"BM", INVALID),
        Case("bmp-header-no-pixels", bmp_header(64, 64), INVALID),
        Case("tiff-magic-only", b"II*\x00", INVALID),
        Case("tiff-ifd-past-end", b"II*\x00\xff\xff\xff\x00", INVALID),
        Case("tiff-header-no-strip", tiff_header(64, 64), INVALID),
        Case("webp-riff-only", b"RIFF\x00\x00\x00\x00WEBP", INVALID),
        Case("webp-header-bad-payload", webp_header(4, 4), INVALID),
        # Zero-size images: a declared width or height of 0 has no pixels to show a model.
        Case("png-zero-width", png(0, 4), INVALID),
        Case("png-zero-height", png(4, 0), INVALID),
        Case("gif-zero-size", gif_header(0, 0), INVALID),
        Case("bmp-zero-width", bmp_header(0, 4), INVALID),
        Case("jpeg-zero-width", jpeg_header(0, 4), INVALID),
        Case("tiff-zero-width", tiff_header(0, 4), INVALID),
    ]


def _bombs() -> list[Case]:
    # Headers declaring enormous canvases with (almost) no data: must be refused from the header.
    return [
        Case("png-100000x100000", png(100_000, 100_000), PIXELS),
        Case("png-7000x7000-over-our-cap-under-pils", png(7000, 7000), PIXELS),
        Case("png-10000x10000-pil-warning-range", png(10_000, 10_000), PIXELS),
        Case("png-1x2147483647", png(1, 2**31 - 1), PIXELS),
        Case("gif-65535x65535", gif_header(65535, 65535), PIXELS),
        Case("bmp-100000x100000", bmp_header(100_000, 100_000), PIXELS),
        Case("jpeg-65000x65000", jpeg_header(65000, 65000), PIXELS),
        Case("tiff-100000x100000", tiff_header(100_000, 100_000), PIXELS),
        Case("webp-16384x16384", webp_header(16384, 16384), PIXELS),
        Case("webp-7000x7000", webp_header(7000, 7000), PIXELS),
    ]


def _unsupported_formats() -> list[Case]:
    small = rgb(16, 16)
    cases = {
        "ico": encode(small, "ICO"),
        "psd": b"8BPS\x00\x01" + b"\x00" * 6 + b"\x00\x03\x00\x00\x00\x10\x00\x00\x00\x10\x00\x08\x00\x03",
        "jpeg2000": encode(small, "JPEG2000"),
        "qoi": encode(small, "QOI"),
        "dds": encode(small, "DDS"),
        "pdf": encode(small, "PDF"),
        "eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n",
        "ppm": encode(small, "PPM"),
        "pgm": encode(small.convert("L"), "PPM"),
        "pbm": encode(small.convert("1"), "PPM"),
        "sgi": encode(small, "SGI"),
        "pcx": encode(small, "PCX"),
        "tga": encode(small, "TGA") + b"\x00" * 8 + b"TRUEVISION-XFILE.\x00",
        "icns": encode(small, "ICNS"),
        "im": b"Image type: RGB image\r\nName: x\r\nImage size (x*y): 16*16\r\n\x1a",
        "heic": b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic",
        "avif": b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf",
        "jpeg-xl": b"\xff\x0a\xfa\x7f\x01\x90\x08",
        "xcf": b"gimp xcf v011\x00" + b"\x00" * 16,
        "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
        "svg-xml-decl": b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"></svg>',
        "svg-bom-whitespace": b'\xef\xbb\xbf  \n<svg viewBox="0 0 1 1"></svg>',
        "svg-doctype": b'<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN" ""><svg/>',
        "xbm": b"#define im_width 8\n#define im_height 8\nstatic char im_bits[] = {0};\n",
    }
    return [Case(f"unsupported-{k}", v, UNSUPPORTED) for k, v in cases.items()]


def _references() -> list[Case]:
    """Strings for MediaResolver.load: bad base64, bad data URLs, forbidden schemes."""
    png_b64 = base64.b64encode(encode(rgb(8, 8), "PNG")).decode()
    svg_b64 = base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode()
    return [
        Case("ref-empty", "", INVALID),
        Case("ref-whitespace", "  \n ", INVALID),
        Case("ref-not-base64", "!!!not base64!!!", INVALID),
        Case("ref-base64-impossible-length", "QUJDR", INVALID),
        Case("ref-base64-only-padding", "====", INVALID),
        Case("ref-base64-of-text", base64.b64encode(b"just some text").decode(), INVALID),
        Case("ref-base64-truncated-png", png_b64[: len(png_b64) // 2], INVALID),
        Case("ref-plain-path", "/etc/passwd", INVALID),
        Case("ref-home-path", "~/cat.png", INVALID),
        Case("ref-data-no-comma", "data:image/png;base64" + png_b64, INVALID),
        Case("ref-data-not-base64", "data:image/png," + png_b64, INVALID),
        Case("ref-data-text-plain", "data:text/plain;base64," + png_b64, INVALID),
        Case("ref-data-json", "data:application/json;base64," + png_b64, INVALID),
        Case("ref-data-html", "data:text/html,<h1>hi</h1>", INVALID),
        Case("ref-data-empty-payload", "data:image/png;base64,", INVALID),
        Case("ref-data-bad-chars", "data:image/png;base64,@@@@", INVALID),
        Case("ref-data-svg", "data:image/svg+xml;base64," + svg_b64, UNSUPPORTED),
        Case("ref-data-random", "data:image/png;base64," + base64.b64encode(bytes(range(256))).decode(),
             INVALID),
        Case("ref-scheme-ftp", "ftp://example.com/cat.png", FORBIDDEN),
        Case("ref-scheme-gopher", "gopher://example.com/", FORBIDDEN),
        Case("ref-scheme-javascript", "javascript:alert(1)", FORBIDDEN),
        Case("ref-scheme-s3", "s3://bucket/key.png", FORBIDDEN),
        Case("ref-windows-drive", "C:\\images\\cat.png", FORBIDDEN),
        Case("ref-file-disabled", "file:///etc/passwd", FORBIDDEN),
        Case("ref-http-disabled", "http://example.com/cat.png", FORBIDDEN),
        Case("ref-https-disabled", "https://example.com/cat.png", FORBIDDEN),
    ]


CORPUS = _truncations() + _garbage() + _corrupt_structures() + _bombs() + _unsupported_formats() \
    + _references()


def test_corpus_is_big_enough() -> None:
    assert len(CORPUS) >= 100
    assert len({case.name for case in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_corpus_case_is_refused_exactly(case: Case) -> None:
    config = MediaConfig()
    if isinstance(case.data, bytes):
        exc = refusal(decode_image_bytes, case.data, config)
    else:
        exc = refusal(MediaResolver(config, ImageStore(config)).load, case.data)
    cls, code, status = case.expect
    assert type(exc) is cls, f"{type(exc).__name__}: {exc.message}"
    assert (exc.code, exc.status) == (code, status)
    assert exc.to_body()["error"]["code"] == code
    assert exc.message.endswith((".", "...")) and len(exc.message) > 30  # a sentence, not a token


@pytest.mark.parametrize("case", _bombs(), ids=lambda case: case.name)
def test_bombs_are_refused_from_the_header_without_decoding_pixels(case: Case, monkeypatch) -> None:
    loads: list[object] = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda im: loads.append(im))
    exc = refusal(decode_image_bytes, case.data, MediaConfig())
    assert (exc.code, exc.status) == (case.expect[1], case.expect[2])
    assert loads == [], "the pixels were decoded before the canvas size was refused"


def test_pixel_cap_message_states_size_and_limit() -> None:
    exc = refusal(decode_image_bytes, png(7000, 7000), MediaConfig())
    assert "7000x7000" in exc.message and "40,000,000" in exc.message


def test_byte_cap_refuses_before_decoding_with_413() -> None:
    config = MediaConfig(max_image_bytes=1000)
    big = encode(rgb(64, 64), "PNG")
    assert len(big) > 1000
    exc = refusal(decode_image_bytes, big, config)
    assert type(exc) is ImageTooLarge and exc.status == 413 and "1,000 bytes" in exc.message


@pytest.mark.parametrize("ref_prefix", ["data:image/png;base64,", ""])
def test_byte_cap_applies_to_base64_before_decoding(ref_prefix: str) -> None:
    config = MediaConfig(max_image_bytes=1000)
    huge = ref_prefix + "A" * 10_000_000  # never materialised as bytes
    exc = refusal(MediaResolver(config, ImageStore(config)).load, huge)
    assert type(exc) is ImageTooLarge and exc.status == 413


def test_animated_gif_bomb_frame_is_refused() -> None:
    # A 4x4 screen whose first frame claims to extend it to 60000x60000.
    gif = bytearray(gif_header(4, 4))
    gif[13 + 6 + 5:13 + 6 + 9] = (60000).to_bytes(2, "little") * 2
    exc = refusal(decode_image_bytes, bytes(gif), MediaConfig())
    assert exc.code == "image_too_large"


def test_pil_global_max_pixels_is_respected_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # Our cap is the one that speaks, but a stricter PIL global must still end as our error.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    exc = refusal(decode_image_bytes, encode(rgb(20, 20), "PNG"), MediaConfig())
    assert type(exc) is ImageTooManyPixels
