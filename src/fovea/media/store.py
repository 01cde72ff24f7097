"""A bounded, content-addressed, in-memory store of uploaded images.

Clients upload an image once and refer to it by id in later requests, instead of re-sending megabytes
of base64 every turn. The store keeps the *encoded* bytes (a few hundred KiB each, not width*height*3)
and is bounded twice: by total bytes (least recently used goes first) and by age (TTL), so memory
stays flat however many clients upload. Ids are hashes of the bytes, so re-uploading is free.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fovea.media.config import MediaConfig
from fovea.media.decode import check_byte_size, decode_image_bytes

_ID_RE = re.compile(r"img-[0-9a-f]{32}")


def image_id_for(data: bytes) -> str:
    return "img-" + hashlib.sha256(data).hexdigest()[:32]


def is_image_id(ref: str) -> bool:
    return _ID_RE.fullmatch(ref) is not None


@dataclass(frozen=True, slots=True)
class StoredImage:
    id: str
    width: int  # upright (after EXIF orientation), as the model will see it
    height: int
    bytes: int  # encoded size
    created: int  # unix seconds; the entry expires store_ttl_s after this
    data: bytes = field(default=b"", repr=False, compare=False)

    def metadata(self) -> dict:
        return {"id": self.id, "object": "image", "width": self.width, "height": self.height,
                "bytes": self.bytes, "created": self.created}


class ImageStore:
    def __init__(self, config: MediaConfig, *, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        # id -> (image, stored_at); order is least recently used first.
        self._entries: OrderedDict[str, tuple[StoredImage, float]] = OrderedDict()
        self._total = 0

    def put(self, data: bytes) -> StoredImage:
        """Store ``data`` if it decodes; raises the decoder's ``FoveaError`` otherwise."""
        check_byte_size(len(data), self._config)
        image_id = image_id_for(data)
        with self._lock:
            known = self._get_locked(image_id)
        if known is None:
            # Decode outside the lock: it is the slow part and must not block readers.
            width, height = decode_image_bytes(data, self._config).size
            known = StoredImage(image_id, width, height, len(data), 0, bytes(data))
        now = self._clock()
        image = replace(known, created=int(now))  # re-uploading restarts the TTL
        with self._lock:
            self._remove_locked(image_id)
            self._entries[image_id] = (image, now)
            self._total += image.bytes
            self._evict_locked(keep=image_id)
        return image

    def get(self, image_id: str) -> StoredImage | None:
        with self._lock:
            return self._get_locked(image_id)

    def delete(self, image_id: str) -> bool:
        with self._lock:
            return self._remove_locked(image_id)

    def __len__(self) -> int:
        with self._lock:
            self._purge_expired_locked()
            return len(self._entries)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            self._purge_expired_locked()
            return self._total

    def _get_locked(self, image_id: str) -> StoredImage | None:
        entry = self._entries.get(image_id)
        if entry is None:
            return None
        if self._expired(entry[1]):
            self._remove_locked(image_id)
            return None
        self._entries.move_to_end(image_id)
        return entry[0]

    def _expired(self, stored_at: float) -> bool:
        return self._clock() - stored_at >= self._config.store_ttl_s

    def _remove_locked(self, image_id: str) -> bool:
        entry = self._entries.pop(image_id, None)
        if entry is None:
            return False
        self._total -= entry[0].bytes
        return True

    def _purge_expired_locked(self) -> None:
        for image_id in [i for i, (_, at) in self._entries.items() if self._expired(at)]:
            self._remove_locked(image_id)

    def _evict_locked(self, keep: str) -> None:
        self._purge_expired_locked()
        while self._total > self._config.store_max_bytes:
            oldest = next(iter(self._entries))
            if oldest == keep:  # cannot happen while store_max_bytes >= max_image_bytes
                break
            self._remove_locked(oldest)
