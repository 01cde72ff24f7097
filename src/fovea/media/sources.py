"""One entry point from an image reference string to image bytes or an RGB image.

Requests name images in several ways (inline data URL or base64, an uploaded id, a file or web URL);
``MediaResolver`` tells them apart and sends each through the reader that enforces its own rules,
so callers never need to know which kind they were given.
"""

from __future__ import annotations

import asyncio
import re

from PIL import Image

from fovea.media.config import MediaConfig
from fovea.media.decode import decode_image_bytes
from fovea.media.errors import ImageNotFound, MalformedImage, MediaSourceForbidden
from fovea.media.inline import decode_base64, decode_data_url
from fovea.media.local_files import read_file_url
from fovea.media.remote import fetch_url
from fovea.media.store import ImageStore, is_image_id

# Base64 has no ':', so anything that starts like "scheme:" is a URL, never inline data.
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_KINDS = "a data URL, raw base64, an uploaded image id (img-...), a file:// URL or an http(s):// URL"


class MediaResolver:
    def __init__(self, config: MediaConfig, store: ImageStore) -> None:
        self.config = config
        self.store = store

    def load(self, ref: str) -> Image.Image:
        """The referenced image, upright and RGB; raises a ``FoveaError`` for any refusal."""
        return decode_image_bytes(self.load_bytes(ref), self.config)

    async def aload(self, ref: str) -> Image.Image:
        # Fetching and decoding block for milliseconds to seconds; keep them off the event loop.
        return await asyncio.to_thread(self.load, ref)

    async def aload_bytes(self, ref: str) -> bytes:
        """``load_bytes`` off the event loop: a fetch blocks, a large base64 payload takes milliseconds."""
        return await asyncio.to_thread(self.load_bytes, ref)

    def load_bytes(self, ref: str) -> bytes:
        """The referenced image's encoded bytes (not yet validated as an image)."""
        if not isinstance(ref, str):
            raise MalformedImage(f"An image reference must be a string: {_KINDS}.")
        ref = ref.strip()
        if not ref:
            raise MalformedImage(f"The image reference is empty; send {_KINDS}.")
        if is_image_id(ref):
            stored = self.store.get(ref)
            if stored is None:
                raise ImageNotFound(
                    f"No uploaded image has the id {ref!r}; it may have expired or been evicted. "
                    "Upload it again with POST /v1/images.")
            return stored.data
        match = _SCHEME_RE.match(ref)
        if match is None:
            return self._raw_base64(ref)
        scheme = match.group(1).lower()
        if len(scheme) == 1:
            raise MediaSourceForbidden(
                f"The image reference {ref[:80]!r} looks like a Windows path; send the image inline "
                "as a base64 data URL or upload it with POST /v1/images.")
        if scheme == "data":
            return decode_data_url(ref, self.config)
        if scheme == "file":
            return read_file_url(ref, self.config)
        if scheme in ("http", "https"):
            return fetch_url(ref, self.config)
        raise MediaSourceForbidden(
            f"Image references with the scheme {scheme!r} are not allowed; send {_KINDS}.")

    def _raw_base64(self, ref: str) -> bytes:
        # "/etc/x" is valid base64, so catch paths before decoding; base64 JPEG starts "/9j/".
        if ref.startswith(("/", "~", "./")) and not ref.startswith("/9j/") and len(ref) < 4096:
            raise MalformedImage(
                f"The image reference {ref[:80]!r} looks like a file path; local files must be given "
                "as file:///absolute/path URLs (and be inside an allowed directory).")
        try:
            return decode_base64(ref, self.config)
        except MalformedImage:
            raise MalformedImage(
                f"The image reference is not {_KINDS} (it is not valid base64 either).") from None
