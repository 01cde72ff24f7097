"""Turn a decoded PIL image of any mode into plain 8-bit RGB.

PIL's own ``convert("RGB")`` is right for most modes but wrong for two that real files produce:
high-bit-depth greyscale (it clips 16-bit values at 255, so a normal 16-bit photo turns almost white)
and transparency (it drops alpha, so whatever colour hid under transparent pixels shows through).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from fovea.media.errors import UnsupportedImageFormat

_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})


def to_rgb(im: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    mode = im.mode
    if mode == "RGB" and not im.has_transparency_data:
        return im
    if mode.startswith(("I", "F")):
        grey = Image.fromarray(_to_uint8(np.asarray(im), mode))
        alpha = _grey_transparency_mask(np.asarray(im), im.info.get("transparency"))
        if alpha is not None:
            grey = Image.merge("LA", (grey, alpha))
            return _composite(grey.convert("RGBA"), background)
        return grey.convert("RGB")
    try:
        if mode in _ALPHA_MODES or im.has_transparency_data:
            if mode == "La":
                im = im.convert("LA")  # PIL cannot go La -> RGBA in one step
            return _composite(im.convert("RGBA"), background)
        return im.convert("RGB")
    except (ValueError, OSError) as exc:
        raise UnsupportedImageFormat(
            f"The image uses the colour mode {mode!r}, which cannot be converted to RGB; "
            "re-save it as an 8-bit RGB or greyscale JPEG or PNG."
        ) from exc


def _to_uint8(arr: np.ndarray, mode: str) -> np.ndarray:
    if mode.startswith("F"):
        arr = np.nan_to_num(arr.astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if arr.size and arr.min() >= 0.0 and arr.max() <= 1.0:
            arr = arr * 255.0  # float images are conventionally 0..1
        return np.clip(np.rint(arr), 0, 255).astype(np.uint8)
    if mode.startswith("I;16"):
        return (np.clip(arr.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)
    # Mode "I" is 32-bit signed, but PIL also uses it to hold 16-bit samples; treat data that fits
    # 16 bits as 16-bit, anything else as unsigned 32-bit (how PIL reads uint32 TIFFs).
    arr = arr.astype(np.int64)
    if arr.size and arr.min() >= 0 and arr.max() <= 65535:
        return (arr >> 8).astype(np.uint8)
    return ((arr & 0xFFFFFFFF) >> 24).astype(np.uint8)


def _grey_transparency_mask(arr: np.ndarray, transparency: object) -> Image.Image | None:
    # PNG tRNS on a 16-bit greyscale image names one sample value as fully transparent.
    if not isinstance(transparency, int) or isinstance(transparency, bool):
        return None
    return Image.fromarray(np.where(arr == transparency, 0, 255).astype(np.uint8))


def _composite(rgba: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    base = Image.new("RGBA", rgba.size, (*background, 255))
    return Image.alpha_composite(base, rgba).convert("RGB")
