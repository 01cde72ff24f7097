"""The second launch of a product split over K: the float32 partials of every split summed in a
fixed order (deterministic, unlike atomics), plus the bias, cast to the output's dtype. Shared by
``quant_matmul``'s tensor-core kernels and ``quant_gemv``'s matrix-vector ones.

triton is imported lazily, as in the other kernel modules.
"""

from __future__ import annotations

import functools

import torch

from fovea.engine.kernels.triton_util import next_pow2

BLOCK_N = 256


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def split_sum_kernel(WS, BIAS, C, N, splits, stride_ws, stride_wm, stride_cm,
                         HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
        # C[m, n] = sum over the K splits of their float32 partials (+ bias), in a fixed order.
        m = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_s = tl.arange(0, BLOCK_S)
        n_ok = offs_n < N
        part = tl.load(WS + offs_s[:, None] * stride_ws + m * stride_wm + offs_n[None, :],
                       mask=(offs_s < splits)[:, None] & n_ok[None, :], other=0.0)
        acc = tl.sum(part, axis=0)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(C + m * stride_cm + offs_n, acc.to(C.dtype.element_ty), mask=n_ok)

    return split_sum_kernel


def sum_splits(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, splits: int) -> None:
    """out = the sum of the float32 partials ws [splits, M, N] in a fixed order (+ bias), cast."""
    rows, n = out.shape
    _kernel()[(rows, -(-n // BLOCK_N))](ws, bias if bias is not None else out, out, n, splits, ws.stride(0),
                                        ws.stride(1), out.stride(0), HAS_BIAS=bias is not None,
                                        BLOCK_S=max(2, next_pow2(splits)), BLOCK_N=BLOCK_N, num_warps=4)
