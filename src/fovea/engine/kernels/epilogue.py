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


@triton.jit
def sum_splits_if_last(P, OUT, BIAS, COUNTERS, pid_n, splits, M, offs_n, n_ok, stride_ps, stride_pm, stride_om,
                       HAS_BIAS: tl.constexpr, ROWS: tl.constexpr):
    """After a program stored its K split's float32 partials of column block ``pid_n`` into P
    ([splits, M, N]): the program that stores the block's last partial sums all ``splits`` of them
    in split order (deterministic, as ``split_sum``'s launch), plus the bias, into OUT's rows in its
    dtype, and sets the block's counter back to zero for the next launch. This saves the second
    launch that ``split_sum`` is. The barrier and the acquire-release count make every program's
    partials visible to the last one; it reads them past L1 (.cg), which another program's
    stores do not update."""
    tl.debug_barrier()
    done = tl.atomic_add(COUNTERS + pid_n, 1, sem="acq_rel", scope="gpu")
    if done == splits - 1:
        for row in tl.static_range(ROWS):
            ok = n_ok & ((offs_n * 0 + row) < M)  # (a tensor comparison, as store_row's)
            acc = tl.load(P + row * stride_pm + offs_n, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                acc += tl.load(P + s * stride_ps + row * stride_pm + offs_n, mask=ok, other=0.0,
                               cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(OUT + row * stride_om + offs_n, acc.to(OUT.dtype.element_ty), mask=ok)
        tl.atomic_xchg(COUNTERS + pid_n, 0)
