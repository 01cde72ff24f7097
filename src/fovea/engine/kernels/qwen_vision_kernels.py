"""The elementwise steps of the Qwen vision towers' fused forward, as Triton kernels and as torch ops.

``TritonOps`` and ``TorchOps`` have the same methods and compute the same values: the torch
twin is transformers' own eager arithmetic step for step (what the fused forward runs off
CUDA, and what the kernels are tested against). Each kernel rounds where the eager ops round
(each eager op's result in the model dtype; see ``vision_fused``), so the two differ only by
float32 rounding inside one step:

- ``rms_norm`` / ``add_rms_norm``: Qwen2.5-VL's RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps))``,
  normalised in float32, rounded, then scaled and rounded again), optionally after the residual
  add (rounded as torch's add);
- ``layer_norm`` / ``add_layer_norm``: Qwen3-VL's LayerNorm (``vision_kernels``' kernel);
- ``silu_and_mul``: ``silu(gate) * up`` from one [T, 2I] gate/up product (two eager ops: two roundings);
- ``gelu_tanh``: ``gelu(x, approximate="tanh")`` (one eager op), and exact ``gelu``;
- ``rotary``: the 2-D rotary of q and k straight from the [T, 3 * H * D] q/k/v product, written
  with v as one [3, T, H, D] tensor: q, k, v each [T, H, D] and contiguous, the layout the
  variable-length attention takes (transformers permutes, upcasts and copies three times).

triton is imported lazily: this module imports on machines without it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fovea.engine.kernels.triton_util import next_pow2
from fovea.engine.kernels.vision_kernels import GELU, activation, add_layer_norm, layer_norm


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(X, R, RES_OUT, W, OUT, stride_x, stride_r, stride_ro, stride_o, n_rows, n_cols, eps,
                            HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        ok = (rows < n_rows) & (cols < n_cols)
        dt = OUT.dtype.element_ty
        x = tl.load(X + rows * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:  # the new residual, rounded to the model dtype as torch's add
            x = (x.to(tl.float32) + tl.load(R + rows * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
            x = x.to(RES_OUT.dtype.element_ty)
            tl.store(RES_OUT + rows * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
        normed = (xf * rstd[:, None]).to(dt).to(tl.float32)  # hidden_states.to(input_dtype)
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(OUT + rows * stride_o + cols, (w * normed).to(dt), mask=ok)  # weight * hidden: one more rounding

    @triton.jit
    def silu_and_mul_kernel(GU, OUT, n, width, stride_gu, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        row, col = offs // width, offs % width
        dt = OUT.dtype.element_ty
        gate = tl.load(GU + row * stride_gu + col, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GU + row * stride_gu + width + col, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu, rounded
        tl.store(OUT + offs, (act * up).to(dt), mask=ok)  # * up, rounded

    @triton.jit
    def gelu_tanh_kernel(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)  # tanh(15) is 1 in float32; exp stays finite
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        tl.store(Y + offs, (0.5 * x * (1.0 + tanh)).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def rotary_kernel(QKV, COS, SIN, OUT, n_rows, stride_qkv, stride_cs, width, heads: tl.constexpr,
                      HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # One program: ROWS tokens of one head, its q, k (rotated) and v (copied).
        head = tl.program_id(1)
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        ok = (rows < n_rows) & (cols < HALF)
        dim = 2 * HALF
        c1 = tl.load(COS + rows * stride_cs + cols, mask=ok, other=0.0)
        c2 = tl.load(COS + rows * stride_cs + HALF + cols, mask=ok, other=0.0)
        s1 = tl.load(SIN + rows * stride_cs + cols, mask=ok, other=0.0)
        s2 = tl.load(SIN + rows * stride_cs + HALF + cols, mask=ok, other=0.0)
        dt = OUT.dtype.element_ty
        plane = n_rows * width  # elements of one of q, k, v in OUT
        for which in tl.static_range(3):
            src = QKV + rows * stride_qkv + which * width + head * dim + cols
            dst = OUT + which * plane + rows * width + head * dim + cols
            x1 = tl.load(src, mask=ok, other=0.0)
            x2 = tl.load(src + HALF, mask=ok, other=0.0)
            if which < 2:  # q * cos + rotate_half(q) * sin, in float32, rounded once
                f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
                tl.store(dst, (f1 * c1 - f2 * s1).to(dt), mask=ok)
                tl.store(dst + HALF, (f2 * c2 + f1 * s2).to(dt), mask=ok)
            else:
                tl.store(dst, x1, mask=ok)
                tl.store(dst + HALF, x2, mask=ok)

    return add_rms_norm_kernel, silu_and_mul_kernel, gelu_tanh_kernel, rotary_kernel


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm_launch(rows: int, cols: int) -> tuple[tuple[int], dict]:
    block = next_pow2(cols)
    per_program = max(1, min(16, 4096 // block))
    warps = 8 if per_program * block >= 4096 else 4
    return (-(-rows // per_program),), {"ROWS": per_program, "BLOCK": block, "num_warps": warps}


ELEMENTWISE_BLOCK = 2048


class TritonOps:
    """The steps as Triton kernels (CUDA, or triton's CPU interpreter in tests)."""

    name = "Triton kernels"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        kernel = _kernels()[0]
        x = _rows(x)
        rows, cols = x.shape
        out = torch.empty_like(x)
        grid, tile = _norm_launch(rows, cols)
        kernel[grid](x, x, x, weight, out, x.stride(0), x.stride(0), x.stride(0), out.stride(0), rows, cols, eps,
                     HAS_RESIDUAL=False, **tile)
        return out

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = _kernels()[0]
        x, residual = _rows(x), _rows(residual)
        rows, cols = x.shape
        summed, out = torch.empty_like(residual), torch.empty_like(x)
        grid, tile = _norm_launch(rows, cols)
        kernel[grid](x, residual, summed, weight, out, x.stride(0), residual.stride(0), summed.stride(0),
                     out.stride(0), rows, cols, eps, HAS_RESIDUAL=True, **tile)
        return summed, out

    @staticmethod
    def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        return layer_norm(x, weight, bias, eps)

    @staticmethod
    def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_layer_norm(x, residual, weight, bias, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = _rows(gate_up)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty((rows, width))
        n = rows * width
        _kernels()[1][(-(-n // ELEMENTWISE_BLOCK),)](gate_up, out, n, width, gate_up.stride(0),
                                                       BLOCK=ELEMENTWISE_BLOCK, num_warps=8)
        return out

    @staticmethod
    def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
        """In place: each element is read before it is written, by the same program."""
        assert x.is_contiguous()
        n = x.numel()
        _kernels()[2][(-(-n // ELEMENTWISE_BLOCK),)](x, x, n, BLOCK=ELEMENTWISE_BLOCK, num_warps=8)
        return x

    @staticmethod
    def gelu(x: torch.Tensor) -> torch.Tensor:
        """Exact GELU, in place (``vision_kernels``' kernel)."""
        return activation(x, GELU, out=x)

    @staticmethod
    def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        qkv, cos, sin = _rows(qkv), cos.contiguous(), sin.contiguous()
        rows, width = qkv.shape[0], qkv.shape[1] // 3
        dim = width // heads
        assert dim % 2 == 0 and cos.shape == sin.shape == (rows, dim) and cos.dtype == torch.float32
        out = qkv.new_empty((3, rows, heads, dim))
        half = dim // 2
        block = next_pow2(half)
        per_program = max(1, min(64, 2048 // block))
        _kernels()[3][(-(-rows // per_program), heads)](qkv, cos, sin, out, rows, qkv.stride(0), cos.stride(0), width,
                                                         heads=heads, HALF=half, ROWS=per_program, BLOCK=block,
                                                         num_warps=4)
        return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    """The same steps as transformers' eager ops (off CUDA, and the kernels' reference)."""

    name = "torch ops"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return summed, cls.rms_norm(summed, weight, eps)

    @staticmethod
    def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    @staticmethod
    def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return summed, F.layer_norm(summed, (x.shape[-1],), weight, bias, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def gelu(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)

    @staticmethod
    def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        rows = qkv.shape[0]
        q, k, v = qkv.view(rows, 3, heads, -1).unbind(1)
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()

        def rotated(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            return ((xf * cos) + (rotate_half(xf) * sin)).to(x.dtype)

        return torch.stack([rotated(q), rotated(k), v])
