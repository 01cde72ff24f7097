"""The last step the quantised products share, as a Triton helper: a program's float32 tile of C
stored as one K split's partial, or as the result (+ bias) in C's dtype.

This module imports triton at the top, so it is only imported from inside a lazy ``_kernels()``
builder (as ``fp8_rounding``); a module-level ``@triton.jit`` helper is one the CPU interpreter can call.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_tile(C, BIAS, acc, c_ptrs, c_ok, offs_n, n_ok, split, stride_cs, HAS_BIAS: tl.constexpr,
               PARTIAL: tl.constexpr):
    """acc (float32 [rows, BLOCK_N]) into C at c_ptrs: with PARTIAL into split ``split``'s float32
    slab (the splits are summed later, bias and all), else plus the bias, cast to C's dtype."""
    if PARTIAL:
        tl.store(C + split.to(tl.int64) * stride_cs + c_ptrs, acc, mask=c_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(C + c_ptrs, acc.to(C.dtype.element_ty), mask=c_ok)


@triton.jit
def store_row(C, BIAS, y, row, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS: tl.constexpr,
              PARTIAL: tl.constexpr):
    """One row of C (float32 y [BLOCK_N]) as ``store_tile`` stores a tile; nothing where row >= M."""
    c_ptrs = (row * stride_cm + offs_n)[None, :]
    ok = n_ok & ((offs_n * 0 + row) < M)  # (a tensor comparison: the interpreter's row and M may be ints)
    store_tile(C, BIAS, y[None, :], c_ptrs, ok[None, :], offs_n, n_ok, split, stride_cs, HAS_BIAS, PARTIAL)
