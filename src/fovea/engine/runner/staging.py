"""A step's small integer inputs to the device without stalling the host.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for
everything already queued on the stream: with the next step queued behind the running one
(see ``PagedEngine.step``), every such copy would make the host wait for the GPU. Here all
lists of one dtype go into one pinned buffer and cross in one asynchronous copy; torch's
pinned-memory allocator keeps that buffer until the copy has run.

Also here: how a decode input that is not on the host yet is written (``pending_token``) and
read back on the device (``resolve_pending``).
"""

from __future__ import annotations

import torch


def pending_token(row: int) -> int:
    """The placeholder for a token still on the device: row ``row`` of the previous step's
    sampled tokens. Negative, so it can never be mistaken for a vocabulary id."""
    return -1 - row


Layout = list[tuple[torch.dtype, int, int, tuple[int, ...]]]  # (dtype, offset, numel, shape) per array
ALIGN_BYTES = 64  # every array starts 64-byte aligned in its buffer


def pack(arrays: list[tuple[list, torch.dtype]]) -> tuple[dict[torch.dtype, list[torch.Tensor]], Layout]:
    """Each array's host tensor, flattened and grouped by dtype, and where each one sits.

    Arrays start at aligned offsets: Triton compiles a kernel variant per pointer alignment,
    so views at whatever offset the previous arrays' lengths gave would compile new variants
    (about a second each) while serving.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    layout: Layout = []
    for values, dtype in arrays:
        host = torch.tensor(values, dtype=dtype)
        group = groups.setdefault(dtype, [])
        used = sum(p.numel() for p in group)
        step = max(1, ALIGN_BYTES // host.element_size())
        if used % step:
            group.append(torch.zeros(step - used % step, dtype=dtype))
            used += step - used % step
        layout.append((dtype, used, host.numel(), tuple(host.shape)))
        group.append(host.reshape(-1))
    return groups, layout


def unpack(flat: dict[torch.dtype, torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    return [flat[dtype][offset:offset + numel].view(shape) for dtype, offset, numel, shape in layout]


def to_device(device: torch.device, arrays: list[tuple[list, torch.dtype]]) -> list[torch.Tensor]:
    """Each (values, dtype) as a tensor on ``device``: a flat list of ints becomes 1-D, a list
    of equal-length rows 2-D. On CUDA, one asynchronous copy per dtype from pinned memory."""
    if device.type != "cuda":
        return [torch.tensor(values, dtype=dtype, device=device) for values, dtype in arrays]
    groups, layout = pack(arrays)
    flat = {}
    for dtype, parts in groups.items():
        pinned = torch.empty(sum(p.numel() for p in parts), dtype=dtype, pin_memory=True)
        torch.cat(parts, out=pinned)
        flat[dtype] = pinned.to(device, non_blocking=True)
    return unpack(flat, layout)


def resolve_pending(ids: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """``ids`` (int64, on the device) with every ``pending_token(row)`` replaced by
    ``previous[row]``, the previous step's sampled tokens, without a round trip to the host."""
    if previous is None or previous.numel() == 0:  # no sampled rows: nothing can be pending
        return ids
    rows = (-1 - ids).clamp(min=0)
    return torch.where(ids < 0, previous[rows], ids)
