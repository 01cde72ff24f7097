"""One message between the encoder pool and an encode worker: a list of items, each a JSON meta
and optionally a tensor's bytes.

A tensor travels in one of two ways, never pickled:
- in shared memory (one host): its bytes are copied into a segment and the meta says where
  (``"at": [segment name, offset, length]``); the reader views them in place;
- inline (Ray's object store, or when no segment has room): its bytes follow the meta.

Either way a message is bytes: ``handoff.pack`` frames (magic, lengths, JSON, raw bytes),
counted. Tensors are read back as flat uint8; the meta says their dtype and shape.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable

import torch

from fovea.disagg import host_copy
from fovea.disagg.handoff import as_bytes, byte_tensor, pack, unpack
from fovea.disagg.shared_segment import Segment, aligned

Item = tuple[dict, torch.Tensor | None]


def tensor_bytes(items: list[Item]) -> int:
    """Bytes a segment needs to carry the items' tensors."""
    return sum(aligned(t.numel() * t.element_size()) for _, t in items if t is not None)


def encode(items: list[Item], segment: Segment | None = None,
           written: Callable[[], None] | None = None) -> bytes:
    """The message's bytes. Tensors go into ``segment`` while it has room (copies from a GPU run
    asynchronously and are waited for once), the rest inline. ``written`` runs once the
    tensors are in place, before the metas are serialised (a worker times its writing there)."""
    placed: list[tuple[dict, bytes]] = []
    offset, from_device = 0, False
    for meta, tensor in items:
        if tensor is None:
            placed.append((meta, b""))
            continue
        n = host_copy.nbytes(tensor)
        if segment is not None and offset + n <= segment.capacity:
            if host_copy.copyable(tensor):  # no GIL-releasing torch call (host_copy.py says why)
                host_copy.copy_bytes(segment.view(offset, n), tensor)
            else:
                segment.view(offset, n).copy_(as_bytes(tensor), non_blocking=tensor.is_cuda)
                from_device |= tensor.is_cuda
            placed.append(({**meta, "at": [segment.name, offset, n]}, b""))
            offset += aligned(n)
        else:
            placed.append((meta, as_bytes(tensor).cpu().numpy().tobytes()))
    if from_device:
        torch.cuda.synchronize()
    if written is not None:
        written()
    frames = [pack(meta, payload) for meta, payload in placed]
    return struct.pack("<I", len(frames)) + b"".join(struct.pack("<I", len(f)) + f for f in frames)


def decode(data: bytes, segments: Callable[[str], Segment] | None = None) -> list[Item]:
    """The items of a message; a tensor in shared memory is a view of it (valid until the
    segment is next written: copy what must outlive the exchange)."""
    if len(data) < 4:
        raise ValueError("a message shorter than its count")
    (count,), offset, items = struct.unpack("<I", data[:4]), 4, []
    for _ in range(count):
        (length,) = struct.unpack("<I", data[offset:offset + 4])
        frame = data[offset + 4:offset + 4 + length]
        offset += 4 + length
        meta, payload = unpack(frame)
        at = meta.pop("at", None)
        if at is not None:
            if segments is None:
                raise ValueError("a shared-memory item where none can be attached")
            name, start, n = at
            items.append((meta, segments(name).view(int(start), int(n))))
        else:
            items.append((meta, byte_tensor(payload) if payload else None))
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} stray bytes after {count} items")
    return items


class Attachments:
    """The pool's segments as a worker sees them, attached by name on first use. The pool
    replaces a segment that grows, so the least recently used beyond ``keep`` is let go."""

    def __init__(self, pin: bool, keep: int = 2) -> None:
        self.pin, self.keep = pin, keep
        self.by_name: OrderedDict[str, Segment] = OrderedDict()

    def __call__(self, name: str) -> Segment:
        segment = self.by_name.get(name)
        if segment is None:
            segment = self.by_name[name] = Segment(name=name, pin=self.pin)
            while len(self.by_name) > self.keep:
                self.by_name.popitem(last=False)[1].close()
        self.by_name.move_to_end(name)
        return segment

    def close(self) -> None:
        for segment in self.by_name.values():
            segment.close()
        self.by_name.clear()
