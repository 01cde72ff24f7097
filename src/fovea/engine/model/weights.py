"""Weights shared in place between transformers' modules and fovea's fused forwards.

Imports only torch: the language model (``llama``) and the fused vision stages use it alike.
"""

from __future__ import annotations

import torch


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fuse_rows(modules: list[torch.nn.Module], attr: str, row_multiple: int = 1) -> torch.Tensor | None:
    """One tensor holding the modules' ``attr`` (weight or bias) stacked by rows, with each
    module's parameter re-pointed at its slice, so both views share memory. Returns the
    existing fused tensor when an earlier call already did this.

    ``row_multiple``: each module's rows are followed by zero rows up to a multiple of it, so
    that an activation computed from a slice (gate, up) has a row width the matrix kernels take
    at full speed; the module's own parameter still sees only its real rows."""
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
            rows += round_up(p.shape[0], row_multiple)
        else:
            if rows == fused.shape[0]:
                return fused
    parts = []
    for p in params:
        pad = round_up(p.shape[0], row_multiple) - p.shape[0]
        parts.append(p.data)
        if pad:
            parts.append(p.data.new_zeros((pad, *p.shape[1:])))
    fused = torch.cat(parts, dim=0)
    start = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[start:start + rows]
        start += round_up(rows, row_multiple)
    setattr(modules[0], marker, fused)
    return fused


def pad_columns(linear: torch.nn.Linear, multiple: int) -> torch.Tensor:
    """``linear``'s weight [out, in] with zero columns up to a multiple of ``multiple`` of ``in``,
    its parameter re-pointed at the first ``in`` columns (a strided view of the same memory).
    The partner of ``fuse_rows(..., row_multiple)``: zero inputs times zero columns add nothing."""
    weight = linear.weight
    width = round_up(weight.shape[1], multiple)
    padded = getattr(linear, "_fovea_padded_weight", None)
    if padded is not None and weight.data_ptr() == padded.data_ptr() and weight.stride() == padded.stride():
        return padded
    if width == weight.shape[1]:
        return weight
    padded = weight.data.new_zeros((weight.shape[0], width))
    padded[:, :weight.shape[1]] = weight.data
    weight.data = padded[:, :weight.shape[1]]
    linear._fovea_padded_weight = padded
    return padded
