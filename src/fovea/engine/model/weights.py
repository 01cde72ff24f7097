"""Weights shared in place between transformers' modules and fovea's fused forwards.

Imports only torch: the language model (``llama``) and the fused vision stages use it alike.
"""

from __future__ import annotations

import torch


def fuse_rows(modules: list[torch.nn.Module], attr: str) -> torch.Tensor | None:
    """One tensor holding the modules' ``attr`` (weight or bias) stacked by rows, with each
    module's parameter re-pointed at its slice, so both views share memory. Returns the
    existing fused tensor when an earlier call already did this."""
    params = [getattr(m, attr) for m in modules]
    if any(p is None for p in params):
        return None
    marker = f"_fovea_fused_{attr}"
    fused = getattr(modules[0], marker, None)
    if fused is not None:  # fused by an earlier engine on the same model: still its views?
        offset, rows = fused.data_ptr(), 0
        for p in params:
            if p.data_ptr() != offset + rows * fused.stride(0) * fused.element_size():
                break
            rows += p.shape[0]
        else:
            if rows == fused.shape[0]:
                return fused
    fused = torch.cat([p.data for p in params], dim=0)
    start = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[start:start + rows]
        start += rows
    setattr(modules[0], marker, fused)
    return fused
