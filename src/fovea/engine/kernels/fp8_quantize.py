"""Dynamic FP8 (e4m3) quantisation of activations, per token or per token group, as a Triton
kernel, with a torch twin of the same semantics for where no kernel can run.

Each group of ``group`` consecutive columns of a row (the whole row: per token) gets

    scale = max(absmax(group) / 448, MIN_SCALE)          (float32, IEEE division)
    q     = e4m3(clamp(x / scale, -448, 448))             (round to nearest even)

which is what torch computes for ``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``.
The kernel's quotient is made from the scale's reciprocal and one FMA correction, which rounds it
as the division does (``fp8_rounding.correctly_rounded_quotient``); its cast rounds as torch's on
the GPU, and in triton's CPU interpreter (whose own float-to-fp8 conversion rounds ties away and
drops the carry into the exponent) the value is rounded to e4m3 in float32 arithmetic before the
cast. So the codes are bit-identical to torch's on both. A zero row gets MIN_SCALE and quantises
to zeros.

triton is imported lazily, as in ``triton_decode``; ``can_run_triton(t)`` says whether a kernel
can run on ``t``'s device here (CUDA with triton, or the interpreter with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from fovea.engine.kernels.triton_util import available, next_pow2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # a zero (or tiny) row's scale, as vLLM's dynamic quantiser
MAX_ONE_PASS = 32768  # a group up to this many columns is held in registers: one read of x


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def can_run_triton(t: torch.Tensor) -> bool:
    """A Triton kernel can run on ``t``: CUDA with triton, or the CPU interpreter."""
    if t.is_cuda:
        return available()
    return interpreting() and importlib.util.find_spec("triton") is not None


def rounding_helpers() -> tuple:
    """``fp8_rounding``'s jit helpers (quantize_e4m3, token_scale), imported on first use (that module
    imports triton). A kernel module binds them as its own globals before defining its kernels:
    triton's interpreter resolves a kernel's names in its module's globals, not in the builder's locals."""
    from fovea.engine.kernels import fp8_rounding

    return fp8_rounding.quantize_e4m3, fp8_rounding.token_scale


quantize_e4m3 = token_scale = None  # bound by _kernels() (rounding_helpers)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    global quantize_e4m3, token_scale
    quantize_e4m3, token_scale = rounding_helpers()

    @triton.jit
    def quant_kernel(X, Q, S, K, stride_x, stride_q, stride_s, min_scale,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        first = g * GROUP
        offs = tl.arange(0, BLOCK)
        x_row = X + row * stride_x
        q_row = Q + row * stride_q
        if ONE_PASS:
            cols = first + offs
            ok = (offs < GROUP) & (cols < K)
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            scale = token_scale(tl.max(tl.abs(x), axis=0), min_scale)
            tl.store(q_row + cols, quantize_e4m3(x, scale).to(Q.dtype.element_ty), mask=ok)
        else:
            amax_v = tl.zeros([BLOCK], tl.float32)
            for start in range(0, GROUP, BLOCK):
                cols = first + start + offs
                ok = (start + offs < GROUP) & (cols < K)
                x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
                amax_v = tl.maximum(amax_v, tl.abs(x))
            scale = token_scale(tl.max(amax_v, axis=0), min_scale)
            for start in range(0, GROUP, BLOCK):
                cols = first + start + offs
                ok = (start + offs < GROUP) & (cols < K)
                x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
                tl.store(q_row + cols, quantize_e4m3(x, scale).to(Q.dtype.element_ty), mask=ok)
        tl.store(S + row * stride_s + g, scale)

    return quant_kernel


def quantize_groups_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch quantiser: x [M, K] -> (q fp8 [M, K], scale float32 [M, cdiv(K, group)])."""
    rows, k = x.shape
    groups = -(-k // group)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, groups * group - k)).view(rows, groups, group)
    # A tensor divisor: torch's CUDA division by a Python number multiplies by its reciprocal, one
    # ulp off the true quotient that the kernel (its correctly rounded quotient) and the CPU compute.
    scale = (padded.abs().amax(dim=2) / torch.full((), FP8_MAX, device=x.device)).clamp(min=MIN_SCALE)
    expanded = scale.repeat_interleave(group, dim=1)[:, :k]
    q = (xf / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _quantize_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = -(-k // group)
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(next_pow2(group), MAX_ONE_PASS)
    warps = 16 if block >= 16384 else 8 if block >= 4096 else 4 if block >= 512 else 1
    _kernels()[(rows, groups)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), MIN_SCALE,
                               GROUP=group, BLOCK=block, ONE_PASS=block >= group, num_warps=warps)
    return q, scale


def quantize_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32) -> (q float8_e4m3fn [M, K], scale float32 [M, cdiv(K, group)]),
    x[m, k] ~= q[m, k] * scale[m, k // group]. The Triton kernel where one can run, else torch."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D activation, got shape {tuple(x.shape)}")
    if can_run_triton(x):
        return _quantize_triton(x, group)
    return quantize_groups_torch(x, group)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, 1]): one dynamic scale per row."""
    return quantize_per_token_group(x, max(1, x.shape[-1]))
