"""Encoded bytes in, an upright, fully loaded RGB ``PIL.Image`` out, or a ``FoveaError``.

This is the one place untrusted image bytes meet a decoder, so it is written as a boundary: cheap
checks first (byte count, magic numbers, declared dimensions from the header), the expensive full
decode only after them, and every exception the decoder can throw turned into a refusal.
"""

from __future__ import annotations

import io
import math
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import ExifTags, Image, ImageFile, ImageOps, UnidentifiedImageError

from fovea.media.config import MediaConfig
from fovea.media.errors import (
    FoveaError,
    ImageTooLarge,
    ImageTooManyPixels,
    MalformedImage,
    UnsupportedImageFormat,
)
from fovea.media.formats import (
    ACCEPTED_DESCRIPTION,
    ACCEPTED_PIL_FORMATS,
    PIL_FORMATS,
    looks_like_html,
    looks_like_text,
    sniff_accepted,
    sniff_unsupported,
    webp_canvas_size,
)
from fovea.media.heap import release_free_memory
from fovea.media.pixels import to_rgb

MiB = 1024 * 1024

# warnings.catch_warnings and ImageFile.LOAD_TRUNCATED_IMAGES are process-global; this lock keeps our
# own threads from interleaving their save/restore of them.
_GLOBALS_LOCK = threading.Lock()
# The EXIF orientations that exif_transpose turns or flips (1 and anything else: as stored).
_TURNED = frozenset(range(2, 9))


def decode_image_bytes(data: bytes, config: MediaConfig, reduce_to: int | None = None) -> Image.Image:
    """Decode ``data`` to an upright RGB image, refusing anything over ``config``'s limits.

    ``reduce_to``: the shortest side the model's processor resizes to. An image at least four
    times that large is brought down to about twice it before the processor sees it (unless
    ``config.prereduce`` is off): a JPEG by its decoder's DCT scaling, so the full-size pixels
    are never decoded, any other format by an integer box reduction after decoding. The
    processor's own resize then does the rest; the two-step result differs from the one-step
    one by rounding (tests/media/test_media_reduce.py measures it).
    """
    image, decoded_pixels = _decode(data, config, reduce_to)
    if decoded_pixels > config.large_image_pixels:
        release_free_memory()  # the full-size pixels are freed by now (see media/heap.py)
    return image


def _decode(data: bytes, config: MediaConfig, reduce_to: int | None) -> tuple[Image.Image, int]:
    """(the image, how many pixels were decoded to make it)."""
    check_byte_size(len(data), config)
    if not data:
        raise MalformedImage("The image is empty (0 bytes); send the file's contents.")
    claimed = sniff_accepted(data)
    unsupported = sniff_unsupported(data)
    if unsupported and not claimed:
        raise UnsupportedImageFormat(
            f"{unsupported} images are not supported; convert it to {ACCEPTED_DESCRIPTION}.")
    try:
        im = _open_checked(data, config, claimed)
        target = reduce_to if config.prereduce else None
        if target and im.format == "JPEG":
            _draft(im, target)
        _load_strict(im)
        check_pixels(im.size, config)  # a GIF's first frame may extend its logical screen
        rgb = to_rgb(_upright(im), config.background)
        return (_reduce(rgb, target) if target else rgb), im.size[0] * im.size[1]
    except FoveaError:
        raise
    except Image.DecompressionBombError as exc:
        raise _too_many_pixels_from_pil(config) from exc
    except MemoryError as exc:
        raise ImageTooManyPixels(
            "The image needs more memory to decode than the server can spare; "
            "send a smaller image.") from exc
    except Exception as exc:  # any decoder failure on untrusted bytes is the client's bad data
        raise MalformedImage(
            f"The {claimed or 'image'} data is truncated or corrupt and could not be decoded "
            f"({_reason(exc)}); re-export or re-upload the image.") from exc


def _draft(im: ImageFile.ImageFile, target: int) -> None:
    """Ask the JPEG decoder for a 1/2, 1/4 or 1/8 scale that keeps twice ``target`` on the short side."""
    short = min(im.size)
    if short >= 4 * target:
        scale = 2 * target / short
        im.draft(im.mode, (math.ceil(im.size[0] * scale), math.ceil(im.size[1] * scale)))


def _reduce(rgb: Image.Image, target: int) -> Image.Image:
    """Box-reduce an RGB image by the integer factor that keeps at least twice ``target`` on the short side."""
    factor = min(rgb.size) // (2 * target)
    return rgb.reduce(factor) if factor >= 2 else rgb


def check_byte_size(n: int, config: MediaConfig) -> None:
    if n > config.max_image_bytes:
        raise ImageTooLarge(
            f"The image is {_mib(n)} but the limit is {_mib(config.max_image_bytes)}; "
            "send a smaller or more compressed image.")


def check_pixels(size: tuple[int, int], config: MediaConfig) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MalformedImage(f"The image has no pixels ({width}x{height}); send a non-empty image.")
    if width * height > config.max_image_pixels:
        raise ImageTooManyPixels(
            f"The image is {width}x{height} ({width * height:,} pixels) but the limit is "
            f"{config.max_image_pixels:,} pixels; downscale it before sending.")


def _open_checked(data: bytes, config: MediaConfig, claimed: str | None) -> ImageFile.ImageFile:
    """Parse only the header, then refuse by declared size before any pixel is decoded."""
    declared = webp_canvas_size(data)
    if declared is not None:
        check_pixels(declared, config)
    try:
        with _GLOBALS_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
    except Image.DecompressionBombWarning as exc:
        raise _too_many_pixels_from_pil(config) from exc
    except UnidentifiedImageError as exc:
        raise _unidentified(data, claimed) from exc
    check_pixels(im.size, config)
    if im.format not in ACCEPTED_PIL_FORMATS:  # defensive: a plugin may hand back a sibling format
        raise UnsupportedImageFormat(
            f"{im.format} images are not supported; convert it to {ACCEPTED_DESCRIPTION}.")
    return im


def _load_strict(im: ImageFile.ImageFile) -> None:
    """Decode every pixel now, so truncation is an error here rather than grey rows later."""
    im.seek(0)  # animated GIF/WebP/APNG and multi-page TIFF: first frame
    with _truncated_images_refused():
        im.load()


@contextmanager
def _truncated_images_refused() -> Iterator[None]:
    # Only touch the global if someone else turned it on: the common path takes no lock at all.
    if not ImageFile.LOAD_TRUNCATED_IMAGES:
        yield
        return
    with _GLOBALS_LOCK:
        previous, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
        try:
            yield
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = previous


def _upright(im: Image.Image) -> Image.Image:
    """``im`` turned as its EXIF orientation says; ``im`` itself when there is nothing to turn
    (``exif_transpose`` would return a full copy of the pixels then: 2.8 MB at 1280x720)."""
    try:
        if im.getexif().get(ExifTags.Base.Orientation, 1) not in _TURNED:
            return im
        return ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - any failure reading EXIF means "no orientation"
        # Broken EXIF is common in camera files and says nothing reliable about orientation;
        # browsers show such images as stored, so do we.
        return im


def _unidentified(data: bytes, claimed: str | None) -> MalformedImage:
    if claimed:
        return MalformedImage(
            f"The data starts like a {claimed} image but its header is truncated or corrupt; "
            "re-export or re-upload the image.")
    if looks_like_html(data):
        return MalformedImage(
            "The data is an HTML page, not an image (often an error or login page served instead "
            f"of the file); send the image itself as {ACCEPTED_DESCRIPTION}.")
    if looks_like_text(data):
        return MalformedImage(
            "The data is text, not an image; send the image file's bytes, a base64 data URL, "
            "or an uploaded image id.")
    return MalformedImage(
        f"The data is not a recognisable image; send {ACCEPTED_DESCRIPTION} bytes.")


def _too_many_pixels_from_pil(config: MediaConfig) -> ImageTooManyPixels:
    return ImageTooManyPixels(
        "The image's declared dimensions are too large to decode safely (limit "
        f"{config.max_image_pixels:,} pixels); downscale it before sending.")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n:,} bytes"
