"""The images uploaded through the front, kept so a PD worker that (re)joins gets them too.

Every ready PD worker is sent each upload, so a request that refers to it by id can land on
any of them. A worker that restarts has an empty store: before it is ready, ``sync`` uploads
to it what the others hold (and deletes what was deleted meanwhile). The record is bounded as
a worker's store is (its bytes, least recent first, and its TTL from the first upload).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Upload:
    body: bytes  # the request body as the client sent it (multipart, JSON or raw)
    content_type: str
    at: float


class UploadRecord:
    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self.entries: OrderedDict[str, Upload] = OrderedDict()
        self.total = 0

    def add(self, image_id: str, body: bytes, content_type: str) -> None:
        self.remove(image_id)
        self.entries[image_id] = Upload(body, content_type, self.clock())
        self.total += len(body)
        while self.total > self.max_bytes and len(self.entries) > 1:
            self.remove(next(iter(self.entries)))

    def remove(self, image_id: str) -> None:
        entry = self.entries.pop(image_id, None)
        if entry is not None:
            self.total -= len(entry.body)

    def live(self) -> dict[str, Upload]:
        now = self.clock()
        for image_id in [i for i, u in self.entries.items() if now - u.at >= self.ttl_s]:
            self.remove(image_id)
        return dict(self.entries)


async def sync(record: UploadRecord, upload: Callable[[Upload], Awaitable[None]],
               delete: Callable[[str], Awaitable[None]]) -> None:
    """Bring a joining worker's store to the record. Returns when nothing is left to send, with
    no await after the last look: the caller marks the worker ready in that same step, so an
    upload recorded later is sent to it as to any ready worker."""
    sent: set[str] = set()
    while True:
        want = record.live()
        missing = [i for i in want if i not in sent]
        gone = [i for i in sent if i not in want]
        if not missing and not gone:
            return
        for image_id in missing:
            await upload(want[image_id])
            sent.add(image_id)
        for image_id in gone:
            await delete(image_id)
            sent.discard(image_id)
