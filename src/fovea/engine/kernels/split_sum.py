"""The second launch of a product split over K: the float32 partials of every split summed in a
fixed order (deterministic, unlike atomics), plus the bias, cast to the output's dtype. Shared by
``quant_matmul``'s tensor-core kernels and ``quant_gemv``'s matrix-vector ones.

triton is imported lazily, as in the other kernel modules.
"""

from __future__ import annotations

import functools
import threading

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


COUNTERS = 1 << 20  # int32 counters a device keeps for launches that sum their own splits (4 MiB)
_COUNTERS: dict[str, list] = {}  # str(device) -> [the counters, the next launch's first]
_COUNTERS_LOCK = threading.Lock()


def split_counters(device: torch.device, programs: int) -> torch.Tensor | None:
    """``programs`` counters at zero for one launch whose programs sum their K splits themselves
    (``epilogue.sum_splits_if_last``, which leaves them at zero again). Launches take consecutive
    slices of one buffer a device, round and round: slices taken by launches that run one after
    another on a stream, as a CUDA graph's do, may be taken again; none is shared by launches that
    run at once unless a million counters lie between them. None where there are none to take:
    more programs than the buffer, or inside a graph's capture before the device's buffer was made
    (its zeros would be written only when the graph replays): that launch sums in a second one."""
    if programs > COUNTERS:
        return None
    key = str(device)
    with _COUNTERS_LOCK:
        entry = _COUNTERS.get(key)
        if entry is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            entry = _COUNTERS[key] = [torch.zeros(COUNTERS, dtype=torch.int32, device=device), 0]
        first = entry[1] if entry[1] + programs <= COUNTERS else 0
        entry[1] = first + programs
        return entry[0][first:first + programs]
