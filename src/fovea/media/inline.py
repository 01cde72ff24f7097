"""Images carried inside the request: ``data:`` URLs and bare base64.

Clients are sloppy here in harmless ways (no mime type, ``application/octet-stream``, line breaks,
missing padding, URL-safe alphabet, percent-encoding) and we accept all of those; what we refuse is
anything that cannot be an image payload, with a message that shows the expected shape.
"""

from __future__ import annotations

import base64
import binascii
from urllib.parse import unquote

from fovea.media.config import MediaConfig
from fovea.media.decode import check_byte_size
from fovea.media.errors import MalformedImage

_EXAMPLE = "data:image/png;base64,iVBORw0KGgo..."
_GENERIC_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})


def decode_data_url(ref: str, config: MediaConfig) -> bytes:
    header, comma, payload = ref[len("data:"):].partition(",")
    if not comma:
        raise MalformedImage(f"The data URL has no ',' before its payload; expected {_EXAMPLE}")
    params = [p.strip().lower() for p in header.split(";")]
    mime = params[0]
    if mime not in _GENERIC_TYPES and not mime.startswith("image/"):
        raise MalformedImage(
            f"The data URL declares the media type {mime!r}, which is not an image; "
            f"expected {_EXAMPLE}")
    if "base64" not in params[1:]:
        raise MalformedImage(
            f"The data URL is not base64-encoded (its header lacks ';base64'); expected {_EXAMPLE}")
    return decode_base64(payload, config, what="data URL payload")


def decode_base64(text: str, config: MediaConfig, *, what: str = "base64 image") -> bytes:
    # Refuse oversized payloads before doing any O(n) work on them: base64 is 4 chars per 3 bytes.
    if len(text) > 2 * (config.max_image_bytes * 4 // 3) + 4096:
        check_byte_size(len(text) * 3 // 4, config)
    if "%" in text:
        text = unquote(text)  # some clients percent-encode '+', '/' and '='
    compact = "".join(text.split())
    if "-" in compact or "_" in compact:
        compact = compact.replace("-", "+").replace("_", "/")
    compact = compact.rstrip("=")
    if not compact:
        raise MalformedImage(f"The {what} is empty; send the image bytes base64-encoded.")
    if len(compact) % 4 == 1:
        raise MalformedImage(f"The {what} is not valid base64 (its length is impossible); "
                             "it may have been cut off in transit.")
    check_byte_size(len(compact) * 3 // 4, config)  # exact to within 2 bytes, before decoding
    try:
        data = base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise MalformedImage(
            f"The {what} is not valid base64 (it contains characters outside A-Z, a-z, 0-9, '+', '/' "
            "and '='); encode the image file's bytes with standard base64.") from None
    check_byte_size(len(data), config)
    return data

