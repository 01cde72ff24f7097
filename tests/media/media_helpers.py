"""Image builders for the media tests: every input is generated here, no binary fixtures.

Named ``media_helpers`` (not ``helpers``) because test dirs have no ``__init__.py`` and pytest's
prepend import mode needs module basenames to be unique across the suite.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from fovea.errors import FoveaError


def encode(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    im.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def pattern(width: int = 37, height: int = 23, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 array with gradients plus noise: asymmetric, so any flip or rotation shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x * y) % 256], axis=-1)
    noise = rng.integers(0, 40, size=arr.shape)
    return np.clip(arr + noise, 0, 255).astype(np.uint8)


def smooth(width: int = 37, height: int = 23) -> np.ndarray:
    """Gradients only: survives lossy codecs nearly intact, yet any flip or rotation still shows."""
    y, x = np.mgrid[0:height, 0:width]
    red = x * 255 // max(1, width - 1)
    green = y * 255 // max(1, height - 1)
    return np.stack([red, green, (red + green) // 2], axis=-1).astype(np.uint8)


def rgb(width: int = 37, height: int = 23, seed: int = 0) -> Image.Image:
    return Image.fromarray(pattern(width, height, seed), "RGB")


def composite(rgba: np.ndarray, background: tuple[int, int, int]) -> np.ndarray:
    """Reference alpha compositing in float, independent of PIL's implementation."""
    alpha = rgba[..., 3:4].astype(np.float64) / 255.0
    out = rgba[..., :3].astype(np.float64) * alpha + np.array(background, np.float64) * (1.0 - alpha)
    return np.rint(out).astype(np.int16)


def max_diff(a: Image.Image | np.ndarray, b: Image.Image | np.ndarray) -> int:
    a_arr = np.asarray(a, dtype=np.int16)
    b_arr = np.asarray(b, dtype=np.int16)
    assert a_arr.shape == b_arr.shape, (a_arr.shape, b_arr.shape)
    return int(np.abs(a_arr - b_arr).max())


def mean_diff(a: Image.Image | np.ndarray, b: Image.Image | np.ndarray) -> float:
    a_arr = np.asarray(a, dtype=np.float64)
    b_arr = np.asarray(b, dtype=np.float64)
    assert a_arr.shape == b_arr.shape, (a_arr.shape, b_arr.shape)
    return float(np.abs(a_arr - b_arr).mean())


# --- hand-made containers, for what PIL will not write (16-bit colour PNG, lying headers) ---

def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png(width: int, height: int, *, bit_depth: int = 8, colour_type: int = 2, rows: bytes | None = None,
        extra: tuple[bytes, ...] = ()) -> bytes:
    """A PNG; ``rows`` are raw scanlines without filter bytes (omitted: header-only, no IDAT)."""
    out = b"\x89PNG\r\n\x1a\n" + png_chunk(
        b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0))
    out += b"".join(extra)
    if rows is not None:
        stride = len(rows) // height
        raw = b"".join(b"\x00" + rows[i * stride:(i + 1) * stride] for i in range(height))
        out += png_chunk(b"IDAT", zlib.compress(raw))
    return out + png_chunk(b"IEND", b"")


def gif_header(width: int, height: int) -> bytes:
    """A GIF whose screen and only frame declare ``width`` x ``height`` but carry 1 byte of LZW."""
    return (b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
            + b"," + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x4c\x01\x00;")


def bmp_header(width: int, height: int) -> bytes:
    """A 24-bit BMP header declaring ``width`` x ``height`` followed by almost no pixel data."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + 16, 0, 0, 54) + info + b"\x00" * 16


def jpeg_header(width: int, height: int) -> bytes:
    """SOI + a baseline SOF0 declaring ``width`` x ``height`` and nothing decodable after it."""
    sof = struct.pack(">BHHB", 8, height, width, 3)
    sof += b"".join(bytes([i, 0x11, 0]) for i in (1, 2, 3))
    return b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof + b"\xff\xd9"


def tiff_header(width: int, height: int) -> bytes:
    """A little-endian TIFF IFD declaring ``width`` x ``height`` 8-bit greyscale, one tiny strip."""
    entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (273, 4, 1, 8), (277, 3, 1, 1), (278, 4, 1, height), (279, 4, 1, 4)]
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHII", tag, kind, count, value) if kind == 4 else
        struct.pack("<HHIHH", tag, kind, count, value, 0) for tag, kind, count, value in entries)
    ifd += struct.pack("<I", 0)
    return b"II*\x00" + struct.pack("<I", 12) + b"\x00\x00\x00\x00" + ifd


def webp_header(width: int, height: int) -> bytes:
    """A lossless (VP8L) WebP whose header declares ``width`` x ``height`` (max 16384 each)."""
    bits = (width - 1) | ((height - 1) << 14)
    payload = b"\x2f" + struct.pack("<I", bits) + b"\x00" * 8
    chunk = b"VP8L" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def refusal(fn, *args) -> FoveaError:
    """Run ``fn`` and return the FoveaError it raised; fail on success or on any other exception."""
    try:
        fn(*args)
    except FoveaError as exc:
        return exc
    raise AssertionError(f"{fn.__name__} accepted the input")
