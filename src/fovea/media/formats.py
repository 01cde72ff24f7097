"""Recognise image formats by their first bytes, without asking PIL.

PIL is only ever handed the formats we accept, so it cannot tell a PSD from random bytes; these magic
numbers let the refusal say "PSD is not supported" (actionable) instead of "not an image", and let a
truncated PNG be reported as a damaged PNG.
"""

from __future__ import annotations

# PIL format names we decode. MPO is how PIL names a JPEG that carries extra pictures (phone cameras).
PIL_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
ACCEPTED_PIL_FORMATS: frozenset[str] = frozenset(PIL_FORMATS) | {"MPO"}
ACCEPTED_DESCRIPTION = "JPEG, PNG, WebP, GIF, BMP or TIFF"

_ACCEPTED_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),  # BigTIFF
    (b"MM\x00+", "TIFF"),
)

_UNSUPPORTED_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"8BPS", "PSD"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x02\x00", "CUR (cursor)"),
    (b"icns", "ICNS"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"),
    (b"\xff\x0a", "JPEG XL"),
    (b"qoif", "QOI"),
    (b"DDS ", "DDS"),
    (b"%PDF", "PDF"),
    (b"%!PS", "PostScript/EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"\x01\xda", "SGI"),
    (b"gimp xcf", "XCF"),
    (b"SIMPLE  =", "FITS"),
    (b"Image type:", "IM"),
    (b"#define", "XBM"),
    (b"/* XPM */", "XPM"),
    (b"\x76\x2f\x31\x01", "OpenEXR"),
    (b"#?RADIANCE", "Radiance HDR"),
)

_HEIF_BRANDS: dict[bytes, str] = {
    b"heic": "HEIC", b"heix": "HEIC", b"hevc": "HEIC", b"heim": "HEIC", b"heis": "HEIC",
    b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF", b"avis": "AVIF",
}


def sniff_accepted(data: bytes) -> str | None:
    """The accepted format these bytes claim to be, or None."""
    for magic, name in _ACCEPTED_MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def sniff_unsupported(data: bytes) -> str | None:
    """The name of a recognised image format that we refuse, or None."""
    if data.endswith(b"TRUEVISION-XFILE.\x00"):  # first: a TGA header can look like a CUR one
        return "TGA"
    for magic, name in _UNSUPPORTED_MAGIC:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return _HEIF_BRANDS[data[8:12]]
    if len(data) >= 3 and data[0] == ord("P") and data[1] in b"1234567fF" and data[2] in b" \t\r\n":
        return "PNM (PBM/PGM/PPM)"
    if len(data) >= 3 and data[0] == 0x0A and data[1] in (0, 2, 3, 4, 5) and data[2] in (0, 1):
        return "PCX"
    if looks_like_svg(data):
        return "SVG"
    return None


def _text_head(data: bytes) -> bytes:
    return data[:2048].lstrip(b"\xef\xbb\xbf \t\r\n").lower()


def looks_like_svg(data: bytes) -> bool:
    head = _text_head(data)
    return head.startswith((b"<svg", b"<!doctype svg")) or (head.startswith(b"<?xml") and b"<svg" in head)


def looks_like_html(data: bytes) -> bool:
    head = _text_head(data)
    return head.startswith((b"<!doctype html", b"<html", b"<head", b"<body"))


def looks_like_text(data: bytes) -> bool:
    """Mostly printable ASCII/UTF-8 in the first KiB: someone sent a string, a path or JSON."""
    text = data[:1024].decode("utf-8", errors="replace")  # a cut multi-byte char costs one miss
    good = sum((c.isprintable() and c != "\ufffd") or c in "\r\n\t" for c in text)
    return bool(text) and good >= 0.95 * len(text)


def webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from a WebP header, or None if it has no recognisable one.

    PIL's WebP plugin hands the whole file to libwebp at open time, which sizes its canvas buffers
    before PIL ever reports a size; reading the header ourselves lets a bomb be refused first.
    """
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    kind = data[12:16]
    if kind == b"VP8X":  # extended: 24-bit canvas size minus one
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if kind == b"VP8L" and data[20] == 0x2F:  # lossless: two 14-bit fields minus one
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy key frame: 14-bit fields
        return (int.from_bytes(data[26:28], "little") & 0x3FFF,
                int.from_bytes(data[28:30], "little") & 0x3FFF)
    return None
