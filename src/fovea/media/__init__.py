"""Untrusted image references in, upright RGB images out, under explicit limits.

Public surface: ``MediaConfig`` (limits and permissions), ``decode_image_bytes`` (bytes to image),
``MediaResolver`` (any reference to bytes or image), ``ImageStore`` (uploaded images by id) and the
``FoveaError`` subclasses in ``fovea.media.errors`` that every refusal raises.
"""

from fovea.media.config import MediaConfig
from fovea.media.decode import decode_image_bytes
from fovea.media.errors import (
    ImageNotFound,
    ImageTooLarge,
    ImageTooManyPixels,
    MalformedImage,
    MediaFetchFailed,
    MediaSourceForbidden,
    UnsupportedImageFormat,
)
from fovea.media.sources import MediaResolver
from fovea.media.store import ImageStore, StoredImage, image_id_for, is_image_id

__all__ = [
    "ImageNotFound", "ImageStore", "ImageTooLarge", "ImageTooManyPixels", "MalformedImage",
    "MediaConfig", "MediaFetchFailed", "MediaResolver", "MediaSourceForbidden", "StoredImage",
    "UnsupportedImageFormat", "decode_image_bytes", "image_id_for", "is_image_id",
]
