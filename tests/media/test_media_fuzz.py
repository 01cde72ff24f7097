"""Property tests: whatever bytes or strings arrive, the media layer answers with a FoveaError or an
RGB image within the pixel cap, quickly; never a bare PIL/OS exception that would become a 500."""

from __future__ import annotations

import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from media_helpers import encode, png, rgb
from PIL import Image

from fovea.errors import FoveaError
from fovea.media import ImageStore, MediaConfig, MediaResolver, decode_image_bytes

# A small pixel cap keeps a mutated header from asking for a large (slow) but "legal" decode.
CONFIG = MediaConfig(max_image_pixels=250_000, max_image_bytes=1_000_000, store_max_bytes=1_000_000)
# FOVEA_FUZZ_EXAMPLES=20000 for a long local run; the default keeps the suite to a few seconds.
EXAMPLES = int(os.environ.get("FOVEA_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=2000, database=None,
                suppress_health_check=[HealthCheck.too_slow])

_small = rgb(24, 16)
SEEDS = [
    encode(_small, "PNG"), encode(_small, "JPEG"), encode(_small, "JPEG", progressive=True),
    encode(_small.convert("P"), "GIF"), encode(_small, "BMP"), encode(_small, "TIFF"),
    encode(_small, "TIFF", compression="tiff_lzw"), encode(_small, "WEBP", lossless=True),
    encode(_small, "WEBP", quality=50), encode(_small.convert("RGBA"), "PNG"),
    encode(_small.convert("P"), "GIF", save_all=True, append_images=[_small.convert("P")], duration=10),
    png(3, 2, bit_depth=16, colour_type=0, rows=bytes(12)),
]


def _decode_or_refuse(data: bytes) -> None:
    start = time.perf_counter()
    try:
        im = decode_image_bytes(data, CONFIG)
    except FoveaError as exc:
        assert exc.status in (400, 413) and exc.code in ("invalid_image", "unsupported_image_format",
                                                         "image_too_large")
    else:
        assert isinstance(im, Image.Image) and im.mode == "RGB"
        assert 0 < im.width * im.height <= CONFIG.max_image_pixels
    assert time.perf_counter() - start < 5.0  # pathological inputs take far longer; slack for CI


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid image with a few bytes overwritten, inserted, deleted, or the tail cut off."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, draw(st.integers(0, 255))]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_never_escape_as_other_exceptions(data: bytes) -> None:
    _decode_or_refuse(data)


@FUZZ
@given(st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*",
                        b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"RIFF\x00\x00\x00\x00WEBPVP8L"]),
       st.binary(max_size=2048))
def test_magic_plus_random_bytes(magic: bytes, rest: bytes) -> None:
    _decode_or_refuse(magic + rest)


@FUZZ
@given(mutated())
def test_mutated_valid_images(data: bytes) -> None:
    _decode_or_refuse(data)


@settings(max_examples=EXAMPLES, deadline=2000, database=None)
@given(st.one_of(st.text(max_size=200),
                 st.from_regex(r"(data|DATA):[a-z/+.;=-]{0,30},[A-Za-z0-9+/=%_ -]{0,80}"),
                 st.from_regex(r"img-[0-9a-f]{32}"), st.from_regex(r"[a-z]{1,8}://[^\s]{0,40}")))
def test_any_reference_string_is_refused_cleanly(ref: str) -> None:
    # No dirs or domains allowed, so no file or network access can happen whatever the string says.
    resolver = MediaResolver(CONFIG, ImageStore(CONFIG))
    try:
        resolver.load(ref)
    except FoveaError as exc:
        assert 400 <= exc.status < 500
