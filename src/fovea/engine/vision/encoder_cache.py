"""Image embeddings by content hash, so the same image is encoded once while it is cached."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from fovea.engine.vision.vision_timings import VisionTimings


class EncoderCache:
    """LRU over embedding tensors, bounded by bytes. Thread-safe; counts hits and misses."""

    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.timings = VisionTimings()  # what encoding each cached image cost (fovea.timing in responses)

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        if value.untyped_storage().nbytes() > size:
            # A view of a larger block (a vision batch's output, an E/PD batch landed in one
            # copy): caching the view would keep the whole block allocated while counting only
            # the view's bytes. A compact copy holds what is counted.
            value = value.clone()
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes
