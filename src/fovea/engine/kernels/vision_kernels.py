"""The fused vision stage's Triton kernels (``fovea.engine.vision.vision_fused``, and Qwen3-VL's
LayerNorm in ``qwen_vision_kernels``): residual add + LayerNorm in one pass, and quick_gelu or
exact GELU in one pass.

The kernels round where the eager ops round (each eager op's result in the model dtype), so the
fused stage and transformers' modules differ only by summation order in the products. triton is
imported lazily: this module imports on machines without it.
"""

from __future__ import annotations

import functools

import torch

from fovea.engine.kernels.triton_util import next_pow2

QUICK_GELU, GELU = 0, 1  # the activations the fused kernel computes


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_layer_norm_kernel(X, R, RES_OUT, W, B, OUT, stride_x, stride_r, stride_ro, stride_o, n_rows, n_cols,
                              eps, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # ROWS rows per program as one [ROWS, BLOCK] tile: narrow rows get a full-size tile.
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        ok = (rows < n_rows) & (cols < n_cols)
        x = tl.load(X + rows * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:  # the new residual, rounded to the model dtype as torch's add
            x = (x.to(tl.float32) + tl.load(R + rows * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
            x = x.to(RES_OUT.dtype.element_ty)
            tl.store(RES_OUT + rows * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
        mean = tl.sum(xf, axis=1) / n_cols
        centred = tl.where(ok, xf - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        # torch's LayerNorm: all in float32, one rounding at the end.
        y = centred * rstd[:, None] * w + b
        tl.store(OUT + rows * stride_o + cols, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def activation_kernel(X, Y, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        dt = Y.dtype.element_ty
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        if KIND == 0:  # quick_gelu is x * sigmoid(1.702 x) as three eager ops: round after each
            t = (x * 1.702).to(dt).to(tl.float32)
            s = (1.0 / (1.0 + tl.exp(-t))).to(dt).to(tl.float32)
            y = x * s
        else:  # exact GELU, one eager op
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        tl.store(Y + offs, y.to(dt), mask=ok)

    return add_layer_norm_kernel, activation_kernel


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, C] with unit column stride, as the kernel indexes it (a copy only if it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm_launch(rows: int, cols: int) -> tuple[tuple[int], dict]:
    """Grid and tile: about 4096 elements a program (ROWS rows of a narrow width, one row of a
    wide one)."""
    block = next_pow2(cols)
    per_program = max(1, min(16, 4096 // block))
    warps = 8 if per_program * block >= 4096 else 4
    return (-(-rows // per_program),), {"ROWS": per_program, "BLOCK": block, "num_warps": warps}


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, C] rows: ``(residual + x, LayerNorm(residual + x))`` in one pass, both new tensors
    (the old residual stays intact: it may be a hidden state the caller keeps)."""
    kernel = _kernels()[0]
    x, residual = _rows(x), _rows(residual)
    rows, cols = x.shape
    summed, normed = torch.empty_like(residual), torch.empty_like(x)
    grid, tile = _norm_launch(rows, cols)
    kernel[grid](x, residual, summed, weight, bias, normed, x.stride(0), residual.stride(0), summed.stride(0),
                 normed.stride(0), rows, cols, eps, HAS_RESIDUAL=True, **tile)
    return summed, normed


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of [T, C] rows (the same kernel without the add)."""
    kernel = _kernels()[0]
    x = _rows(x)
    rows, cols = x.shape
    normed = torch.empty_like(x)
    grid, tile = _norm_launch(rows, cols)
    kernel[grid](x, x, x, weight, bias, normed, x.stride(0), x.stride(0), x.stride(0), normed.stride(0),
                 rows, cols, eps, HAS_RESIDUAL=False, **tile)
    return normed


def activation(x: torch.Tensor, kind: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """quick_gelu (``QUICK_GELU``) or exact GELU (``GELU``) of a contiguous tensor; ``out=x``
    works in place (each element is read before it is written, by the same program)."""
    assert x.is_contiguous()
    kernel = _kernels()[1]
    out = torch.empty_like(x) if out is None else out
    n = x.numel()
    block = 4096
    kernel[(-(-n // block),)](x, out, n, KIND=kind, BLOCK=block, num_warps=8)
    return out
