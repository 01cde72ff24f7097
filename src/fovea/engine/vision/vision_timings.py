"""What the vision stage cost each request, so a response can report its own encoder latency.

Images are encoded in batches that mix requests. A request's encoder time is the sum of the
vision calls that encoded its images (each call counted once, whole: that is what it waited
for); images taken from the encoder cache add nothing and are counted as cached. On CUDA a
call's time is its GPU time, read from its events once they have passed (never waiting on them).
Requests are remembered by their prompt object, weakly: nothing here keeps a prompt's pixels alive.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

KEEP = 4096  # prompts remembered; an older one reports no time


@dataclass
class PromptVision:
    calls: list[Any] = field(default_factory=list)  # ms (float) or CUDA (begin, end) events, one per call
    encoded: int = 0  # images this request's calls encoded
    cached: int = 0  # images found in the encoder cache
    unknown: int = 0  # images whose time is not known here (e_pd: encoded ahead by a worker)


class VisionTimings:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._by_prompt: OrderedDict[int, tuple[weakref.ref, PromptVision]] = OrderedDict()
        self._lock = threading.Lock()

    def _entry(self, prompt: object) -> PromptVision:
        key = id(prompt)
        held = self._by_prompt.get(key)
        if held is None or held[0]() is not prompt:  # new, or an id reused after a collection
            held = (weakref.ref(prompt), PromptVision())
            self._by_prompt[key] = held
            while len(self._by_prompt) > self.keep:
                self._by_prompt.popitem(last=False)
        return held[1]

    def begin(self, prompt: object) -> bool:
        """True the first time ``prompt`` is seen (later prefill chunks find its images cached:
        those are not new cache hits)."""
        with self._lock:
            held = self._by_prompt.get(id(prompt))
            fresh = held is None or held[0]() is not prompt
            self._entry(prompt)
            return fresh

    def note(self, prompt: object, cached: int = 0, unknown: int = 0, call: Any = None, encoded: int = 0) -> None:
        """Add to ``prompt``'s record: images found cached or of unknown cost, or one vision call
        (ms or CUDA events) that encoded ``encoded`` of its images."""
        with self._lock:
            entry = self._entry(prompt)
            entry.cached += cached
            entry.unknown += unknown
            if call is not None and not any(_same_call(c, call) for c in entry.calls):
                entry.calls.append(call)
            entry.encoded += encoded

    def report(self, prompt: object) -> dict | None:
        """``{"encoder_ms", "images_encoded", "images_cached"}`` for ``prompt`` (encoder_ms is None
        while a GPU call has not finished or when a cost is unknown); None if never seen."""
        with self._lock:
            held = self._by_prompt.get(id(prompt))
            if held is None or held[0]() is not prompt:
                return None
            entry = held[1]
            calls, encoded, cached, unknown = list(entry.calls), entry.encoded, entry.cached, entry.unknown
        total: float | None = 0.0
        for call in calls:
            if isinstance(call, float):
                total += call
            elif call[1].query():
                total += float(call[0].elapsed_time(call[1]))
            else:
                total = None
                break
        if unknown:
            total = None
        return {"encoder_ms": None if total is None else round(total, 3),
                "images_encoded": encoded, "images_cached": cached}


def _same_call(a: Any, b: Any) -> bool:
    """One vision call is the same object for every image it encoded (its ms float, or its pair of
    CUDA events, compared event by event)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
    return a is b
