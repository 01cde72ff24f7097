"""Which PD worker a request goes to: by load, and by affinity for the images it carries.

A worker that served an image recently holds it in its encoder cache (the vision stage's
output) and its prompt's KV blocks in its prefix cache, so the next request with that image is
cheaper there. The front remembers, per image, the worker that last got a request carrying it,
and sends the next one there unless that worker is overloaded next to the least-loaded one
(``choose``). Affinity is a hint: any worker answers any request the same.

The load is what the front knows: its own count of a worker's requests in flight (live), plus
the engine's waiting requests and KV-cache free share as the worker's ``/health`` last said
(read every second by the fleet's probe, so up to a second old).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fovea.front.pd_fleet import PdWorker

MAX_ENTRIES = 65_536  # image keys remembered (about 100 bytes each)
MIN_SLACK = 2  # requests a holder may have above the least-loaded worker, at any load
SLACK_SHARE = 0.25  # ... or this share of the least-loaded worker's load, when larger
KV_FLOOR = 0.05  # a holder with less of its KV cache free than this is passed over for one with more

OUTCOMES = ("hit", "overloaded", "miss", "none")

# The request fields that hold image (and video) references: chat's and the Responses API's
# content parts, /v1/completions' ``images`` and /generate's ``image``. A body without these
# bytes carries no image, and is not parsed at all.
_MARKERS = (b"image", b"video")


# ---- the request's keys -------------------------------------------------------------------
def image_key(ref: str) -> bytes:
    """A reference's key: a digest of the string as sent, so an inline image (a data URL or raw
    base64) is keyed without being decoded, and a URL or an uploaded image id (img-...) by
    itself; fixed size, whatever the reference's. Not a security boundary: a collision would
    only send a request to another worker than it might have gone to."""
    return hashlib.sha1(ref.strip().encode(), usedforsecurity=False).digest()[:16]  # ~2 GB/s: a 6 MB image in 3 ms


def affinity_keys(body: bytes) -> tuple[bytes, ...]:
    """The keys of the images a request body refers to, in order and without repeats; () for a
    body that carries none or is not a JSON object (the worker refuses that one itself)."""
    if not any(marker in body for marker in _MARKERS):
        return ()
    try:
        request = json.loads(body)
    except ValueError:
        return ()
    if not isinstance(request, dict):
        return ()
    return tuple(dict.fromkeys(image_key(ref) for ref in _refs(request)))


def _refs(request: dict[str, Any]) -> Iterable[str]:
    for message in _list(request.get("messages")) + _list(request.get("input")):  # chat; Responses API
        if isinstance(message, dict):
            for part in _list(message.get("content")):
                if isinstance(part, dict):
                    yield from _part_refs(part)
    yield from (ref for ref in _list(request.get("images")) if isinstance(ref, str))  # /v1/completions
    if isinstance(request.get("image"), str):  # /generate
        yield request["image"]


def _part_refs(part: dict[str, Any]) -> Iterable[str]:
    # chat: {"image_url": {"url": ...}} and {"video_url": {"url": ...}}; Responses API's
    # input_image: {"image_url": "..."} or {"file_id": "img-..."}.
    for name in ("image_url", "video_url", "file_id"):
        value = part.get(name)
        if isinstance(value, dict):
            value = value.get("url")
        if isinstance(value, str) and value:
            yield value


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


# ---- what the front remembers -------------------------------------------------------------
class AffinityTable:
    """Image key -> the index of the worker that last got a request carrying it; the least
    recently routed keys go first beyond ``max_entries``."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def holders(self, keys: Iterable[bytes]) -> Counter[int]:
        """Per worker index, how many of ``keys`` it holds."""
        return Counter(self.entries[key] for key in keys if key in self.entries)

    def record(self, keys: Iterable[bytes], index: int) -> None:
        for key in keys:
            self.entries[key] = index
            self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def forget(self, index: int) -> None:
        """A worker that restarted has empty caches: it holds nothing any more."""
        for key in [k for k, i in self.entries.items() if i == index]:
            del self.entries[key]


# ---- the rule -----------------------------------------------------------------------------
def load(worker: PdWorker) -> int:
    # ``waiting`` is part of ``in_flight`` too (every request a worker holds came through the
    # front): counted twice, a queue (the engine has no room for more) weighs more than
    # requests it is running, which continuous batching makes cheap.
    return worker.in_flight + worker.waiting


def slack(least: int) -> int:
    """How much more load than the least-loaded worker a holder may have and still be chosen.
    A cache hit saves one image's vision stage and prefill, worth about a request or two of
    queueing; as loads grow the slack grows with them (25%) so that affinity never makes one
    worker's queue much longer than another's."""
    return max(MIN_SLACK, int(least * SLACK_SHARE))


def overloaded(holder: PdWorker, least: PdWorker) -> bool:
    if load(holder) > load(least) + slack(load(least)):
        return True
    # KV free share: None when the worker has not reported it (yet).
    return (holder.kv_free is not None and least.kv_free is not None
            and holder.kv_free < KV_FLOOR and least.kv_free > holder.kv_free)


def choose(workers: list[PdWorker], keys: tuple[bytes, ...], table: AffinityTable | None
           ) -> tuple[PdWorker | None, str]:
    """Among ``workers`` (the ready ones not yet tried): the one holding most of ``keys`` if it
    is not overloaded, else the least-loaded (then the one sent fewest so far). With the outcome:
    hit, overloaded (a holder, refused), miss (keys, no holder among ``workers``), none (no keys)."""
    if not workers:
        return None, "miss" if keys else "none"
    least = min(workers, key=lambda w: (load(w), w.routed))
    if not keys or table is None:
        return least, "none"
    held = table.holders(keys)
    holders = [w for w in workers if held[w.index]]
    if not holders:
        return least, "miss"
    holder = max(holders, key=lambda w: (held[w.index], -load(w), -w.routed))
    if holder is least or not overloaded(holder, least):
        return holder, "hit"
    return least, "overloaded"


def take_health(worker: PdWorker, body: bytes) -> None:
    """A worker's /health body: its engine's waiting requests and KV-cache free share (unknown
    ones read as none waiting and no share: the rule then goes by in-flight counts alone)."""
    try:
        health = json.loads(body)
    except ValueError:
        health = None
    health = health if isinstance(health, dict) else {}
    waiting, kv_free = health.get("queue_depth"), health.get("kv_free_share")
    worker.waiting = waiting if isinstance(waiting, int) and waiting >= 0 else 0
    worker.kv_free = float(kv_free) if isinstance(kv_free, (int, float)) else None
