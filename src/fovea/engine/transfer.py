"""A step's small integer inputs to the device without stalling the host.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for
everything already queued on the stream: with the next step queued behind the running one
(see ``PagedEngine.step``), every such copy would make the host wait for the GPU. Here all
lists of one dtype go into one pinned buffer and cross in one asynchronous copy; torch's
pinned-memory allocator keeps that buffer until the copy has run.

Imports only torch: the runner, the sampler, attention, embeddings and the structured masks
all copy their inputs through it.
"""

from __future__ import annotations

import torch

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
