"""Shared memory between the encoder pool and a local encode worker: tensors cross without a copy
through a pipe and without pickling.

The pool owns two segments per worker (pixels out, embeddings back), sized for the batch at
hand and grown by replacing them; the worker attaches to them by name. Only one batch is in
flight per worker, so a segment is rewritten only after its reader has copied what it needed.
On a GPU machine each side registers its mapping with CUDA (pinned memory), so the copies
between the segment and the device are DMA at the bus's rate instead of staged through a
pageable bounce buffer. The pool unlinks its segments when it replaces or closes them, so a
killed worker leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import contextlib
import logging
from multiprocessing import shared_memory

import torch

log = logging.getLogger("fovea.disagg")

ALIGN = 256  # each tensor starts on a 256-byte boundary: aligned DMA and dtype views


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Segment:
    """One named shared-memory block, as a flat uint8 tensor (``view``)."""

    def __init__(self, size: int = 0, name: str | None = None, pin: bool = False) -> None:
        self.owner = name is None
        if self.owner:
            self.shm = shared_memory.SharedMemory(create=True, size=max(ALIGN, aligned(size)))
        else:
            # A spawned worker shares its parent's resource tracker, where attaching only
            # re-adds the name the owner registered: the owner's unlink is the one that counts.
            self.shm = shared_memory.SharedMemory(name=name)
        self.name, self.capacity = self.shm.name, self.shm.size
        self.bytes = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.pinned = pin and _register(self.bytes)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or offset + nbytes > self.capacity:
            raise ValueError(f"bytes {offset}..{offset + nbytes} lie outside segment {self.name} of {self.capacity}")
        return self.bytes[offset:offset + nbytes]

    def close(self) -> None:
        if self.pinned:
            _unregister(self.bytes)
        del self.bytes  # the tensor holds the buffer: it must go before the mapping can close
        with contextlib.suppress(BufferError, OSError):
            self.shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


class OwnedSegment:
    """A segment the pool writes or reads, replaced by a larger one when a batch needs more."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.segment: Segment | None = None

    def ensure(self, nbytes: int) -> Segment:
        if self.segment is None or self.segment.capacity < nbytes:
            if self.segment is not None:
                self.segment.close()
            self.segment = Segment(max(nbytes, 2 * (self.segment.capacity if self.segment else 0)), pin=self.pin)
        return self.segment

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def _register(data: torch.Tensor) -> bool:
    """Pin a mapping for CUDA's DMA; False (pageable, slower) where it cannot be."""
    if not torch.cuda.is_available():
        return False
    try:
        code = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0)
    except Exception as exc:  # noqa: BLE001 - a missing binding only costs speed
        log.debug("could not pin a shared segment: %s", exc)
        return False
    return int(code) == 0


def _unregister(data: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
