"""The FP8 matrix-vector kernel's per-row pieces, as Triton helpers: a step's activations (with the
group scale folded in, for block-scaled weights) and a row's finished sums.

This module imports triton at the top, so it is only imported from inside a lazy ``_kernels()``
builder (as ``epilogue`` and ``int4_codes``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_weights(w_ptrs, n_ok, k0, k_end, offs_k, EVEN_K: tl.constexpr, GUARD: tl.constexpr):
    """A step's e4m3 weights [BLOCK_N, BLOCK_K] from K index k0, as stored, zeros past N and k_end.
    EVEN_K (every step whole): no mask along K, so the loads stay 16 bytes wide; GUARD (a prefetch,
    which may start at k_end) adds the step's start, uniform along K."""
    if EVEN_K:
        ok = n_ok[:, None]
        if GUARD:  # as a tile uniform along K (a scalar condition is no mask to the interpreter)
            ok = ok & ((offs_k * 0 + k0) < k_end)[None, :]
    else:
        ok = n_ok[:, None] & ((k0 + offs_k) < k_end)[None, :]
    return tl.load(w_ptrs, mask=ok, other=0.0, eviction_policy="evict_first")


@triton.jit
def fp8_activations(x_ptrs, k_ok, xs_row, g, sw, BLOCK_SCALED: tl.constexpr):
    """A step's e4m3 activations of one row as float32 (a [BLOCK_N, BLOCK_K] tile of broadcast
    pointers, loaded and converted once for the W rows a thread holds); with BLOCK_SCALED times the
    row's scale for K group g and the weight block's scale sw for it, the step's two scales (per-
    channel weights scale the finished sums instead)."""
    x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
    if BLOCK_SCALED:
        x = x * (tl.load(xs_row + g) * sw)
    return x


@triton.jit
def fp8_row_sums(acc, ws, xs_row, BLOCK_SCALED: tl.constexpr):
    """A row's products summed over K: with per-channel scales times ws [BLOCK_N] and the row's
    one scale; block-scaled products were scaled as they were summed."""
    y = tl.sum(acc, axis=1)
    if not BLOCK_SCALED:
        y = y * (ws * tl.load(xs_row))
    return y
