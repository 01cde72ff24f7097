"""Every way an image reference can be refused, each with a stable code and HTTP status.

Callers catch ``FoveaError`` (or these classes) only; nothing from PIL, httpx or the OS is allowed to
escape the media package, so a bad upload can never surface as a 500.
"""

from __future__ import annotations

from fovea.errors import FoveaError, InvalidImage, InvalidRequest


class MalformedImage(InvalidImage):
    """Not an image at all, truncated, corrupt, bad base64 or a bad data URL."""

    status, code = 400, "invalid_image"


class UnsupportedImageFormat(InvalidImage):
    """A real image format (SVG, PSD, ICO, HEIC, ...) that fovea does not accept."""

    status, code = 400, "unsupported_image_format"


class ImageTooLarge(InvalidImage):
    """Encoded size over the byte cap: 413, the body itself is too large."""

    status, code = 413, "image_too_large"


class ImageTooManyPixels(ImageTooLarge):
    """Declared dimensions over the pixel cap: 400, the bytes were fine but decoding them is not."""

    status = 400


class MediaSourceForbidden(FoveaError):
    """A file outside the allowed dirs, a host not allowlisted, a private address, a disallowed scheme."""

    status, code = 403, "media_source_forbidden"


class MediaFetchFailed(InvalidRequest):
    """The source was allowed but reading it failed (network error, timeout, non-200, too big)."""

    status, code = 400, "media_fetch_failed"


class ImageNotFound(InvalidRequest):
    status, code = 404, "image_not_found"


__all__ = [
    "FoveaError", "ImageNotFound", "ImageTooLarge", "ImageTooManyPixels", "MalformedImage",
    "MediaFetchFailed", "MediaSourceForbidden", "UnsupportedImageFormat",
]
