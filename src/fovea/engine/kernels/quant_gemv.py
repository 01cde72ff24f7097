"""Matrix-vector products with quantised weights for decode (1-4 rows): FP8 per channel with
dynamic per-token activations, and 4-bit integers with group scales (W4A16). Same layouts and
semantics as ``quant_matmul``'s kernels (its docstring), other arithmetic:

- no matrix instructions: a program holds ``BLOCK_N`` output columns and multiplies-and-adds its
  weights in float32 registers while they stream in; one launch per product (FP8: after the
  quantiser's, unless it quantises inside), one more where K is split (float32 partials summed in
  a fixed order by ``split_sum.sum_splits``). At one row a tensor-core tile pads the row to 16
  and moves the weight through shared memory; here the weight goes from memory to a
  multiply-add in registers.
- FP8: the activations quantised per token by ``fp8_quantize``'s launch, or (a candidate) inside:
  every program computes its rows' absolute maxima from the whole row of x, then quantises x with
  ``fp8_rounding.quantize_e4m3`` as ``fp8_quantize`` does, bit for bit. The products of two e4m3
  values are exact in float32.
- int4 (bf16/fp16 activations): a code q becomes the float32 128 + q from its bits ((q << 16) |
  0x43000000; no conversion instruction), multiplied by x exactly (8 + 8 or 11 + 8 significant bits)
  and summed over the group; the zero point is taken off once per group and column as
  (128 + z) * sum(x over the group) (``quant_matmul``'s FOLD: the float32 sums carry terms at most
  143/1 times the exact ones', a relative 2^-24 * 143 < 2^-16, below bf16's and fp16's output
  rounding). With float32 activations the codes are 2^23 + q less 2^23 + z, exact, before the product.

Launch configurations are chosen per shape on first use by timing (``quant_matmul._choose``).
triton is imported lazily. Checked against the dequantised reference by the tests (the CPU
interpreter) and on the GPU by ``python3 bench/quant_matmul.py --impls fp8_gemv,int4_gemv``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fovea.engine.kernels.fp8_quantize import MIN_SCALE, quantize_per_token, rounding_helpers
from fovea.engine.kernels.split_sum import sum_splits
from fovea.engine.kernels.triton_util import next_pow2

GEMV_MAX_ROWS = 4  # products of at most this many rows may take these kernels
MAX_SPLIT_K = 8

quantize_e4m3 = token_scale = store_tile = None  # bound by _kernels() (rounding_helpers, epilogue)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program
    block_k: int  # FP8: weight columns per step; int4: packed rows (8 weights each) per step
    split_k: int = 1  # programs along K (partials summed by a second launch)
    num_warps: int = 4
    quantize: bool = False  # FP8: the activations quantised inside the kernel, not by the quantiser's launch

    def describe(self) -> str:
        inside = " quantize" if self.quantize else ""
        return f"gemv {self.block_n}x{self.block_k} split={self.split_k} w{self.num_warps}{inside}"


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    from fovea.engine.kernels import epilogue

    global quantize_e4m3, token_scale, store_tile
    quantize_e4m3, token_scale = rounding_helpers()
    store_tile = epilogue.store_tile

    @triton.jit
    def fp8_gemv_kernel(X, XS, W, WS, C, BIAS, M, N, K, k_split, stride_xm, stride_wn, stride_cs, stride_cm,
                        min_scale, QUANTIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
        # C[m, n] = sum_k e4m3(x[m, k] / s[m]) W[n, k] * s[m] * ws[n], s[m] the row's dynamic scale.
        # QUANTIZE: x unquantised, quantised here (each thread quantises the columns it multiplies, for
        # each of its rows of W); else x is already e4m3 with its scales in XS [M, 1].
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_r = tl.arange(0, ROWS)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        r_ok = offs_r < M
        n_ok = offs_n < N
        x_rows = X + offs_r.to(tl.int64)[:, None] * stride_xm
        if QUANTIZE:  # every program needs the whole row's maximum (x is small and read from L2)
            amax = tl.zeros([ROWS, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ok = r_ok[:, None] & ((k0 + offs_k) < K)[None, :]
                x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=ok, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = token_scale(tl.max(amax, axis=1), min_scale)
        else:
            scale = tl.load(XS + offs_r, mask=r_ok, other=0.0)
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:  # no mask along K: wide loads
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + offs_k) < k_end
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            if QUANTIZE:
                xq = quantize_e4m3(x.to(tl.float32), scale[:, None])
            else:
                xq = x.to(tl.float32)
            acc += w.to(tl.float32)[None, :, :] * xq[:, None, :]
            w_ptrs += BLOCK_K
        ws = tl.load(WS + offs_n, mask=n_ok, other=0.0)
        y = tl.sum(acc, axis=2) * scale[:, None] * ws[None, :]
        c_ptrs = offs_r.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_ok = r_ok[:, None] & n_ok[None, :]
        store_tile(C, BIAS, y, c_ptrs, c_ok, offs_n, n_ok, split, stride_cs, HAS_BIAS, PARTIAL)

    @triton.jit
    def int4_gemv_kernel(X, P, S, Z, C, BIAS, M, N, K, k_split, stride_xm, stride_pk, stride_sk, stride_zk,
                         stride_cs, stride_cm, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, FOLD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_P: tl.constexpr):
        # C[m, n] = sum_k x[m, k] (q[k, n] - z[g, n]) s[g, n], g = k // GROUP; packed [K / 8, N] (bits
        # 4j..4j+3 of row i: k = 8i + j); BLOCK_P packed rows per step, 8 * BLOCK_P divides GROUP and
        # k_split is a multiple of GROUP.
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_r = tl.arange(0, ROWS)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_p = tl.arange(0, BLOCK_P)
        r_ok = offs_r < M
        n_ok = offs_n < N
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        x_rows = X + offs_r.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for g0 in range(k_start, k_end, GROUP):
            g = g0 // GROUP
            s = tl.load(S + g * stride_sk + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(Z + g * stride_zk + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            else:
                z = tl.full([BLOCK_N], 8.0, tl.float32)
            part = tl.zeros([ROWS, BLOCK_P, BLOCK_N], tl.float32)
            x_part = tl.zeros([ROWS, BLOCK_P], tl.float32)
            for p0 in range(g0 // 8, (g0 + GROUP) // 8, BLOCK_P):
                p = tl.load(P + (p0 + offs_p).to(tl.int64)[:, None] * stride_pk + offs_n[None, :],
                            mask=n_ok[None, :], other=0, eviction_policy="evict_first")
                for j in tl.static_range(8):
                    x = tl.load(x_rows + (8 * (p0 + offs_p) + j)[None, :], mask=r_ok[:, None], other=0.0)
                    x = x.to(tl.float32)
                    if FOLD:  # 128 + q: the code in float32 mantissa bits 16..19 under 128's exponent
                        if j < 4:
                            bits = (p << (16 - 4 * j)) & 0xF0000
                        else:
                            bits = (p >> (4 * j - 16)) & 0xF0000
                        w = (bits | 0x43000000).to(tl.float32, bitcast=True)
                        x_part += x
                    else:  # (2^23 + q) - (2^23 + z) = q - z, exact
                        w = (((p >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                        w = w - (z + 8388608.0)[None, :]
                    part += w[None, :, :] * x[:, :, None]
            r = tl.sum(part, axis=1)
            if FOLD:
                r -= tl.sum(x_part, axis=1)[:, None] * (z + 128.0)[None, :]
            acc += r * s[None, :]
        c_ptrs = offs_r.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_ok = r_ok[:, None] & n_ok[None, :]
        store_tile(C, BIAS, acc, c_ptrs, c_ok, offs_n, n_ok, split, stride_cs, HAS_BIAS, PARTIAL)

    return fp8_gemv_kernel, int4_gemv_kernel


def fp8_gemv_candidates(rows: int) -> list[GemvConfig]:
    """FP8 configurations timed for ``rows`` (<= GEMV_MAX_ROWS) rows; the first is the default.
    Registers: rows * block_n * block_k / (32 * warps) float32 accumulators a thread."""
    per_row = 4096 // next_pow2(rows)  # accumulators of a 4-warp program
    # Quantising inside costs each thread ~20 instructions per column it holds, repeated for every
    # row of W it holds beside it (2 in these tiles): ~10 per weight against ~3 for the product, so
    # the quantiser's own launch comes first and one in-kernel candidate (a wide tile) is timed too.
    return [GemvConfig(16, per_row // 16), GemvConfig(8, per_row // 8), GemvConfig(32, per_row // 16, 1, 8),
            GemvConfig(16, per_row // 16, 2), GemvConfig(8, per_row // 8, 2),
            GemvConfig(64, per_row // 64, 1, 4, quantize=True)]


def int4_gemv_candidates(rows: int, group: int) -> list[GemvConfig]:
    """int4 configurations (block_k: packed rows a step, cut to divide the group's)."""
    configs = [GemvConfig(64, 16), GemvConfig(32, 16), GemvConfig(128, 16, 1, 8), GemvConfig(64, 16, 2),
               GemvConfig(32, 16, 2), GemvConfig(64, 8), GemvConfig(32, 16, 4)]
    out = []
    for c in configs:
        bp = c.block_k
        while bp > 1 and (group // 8) % bp:
            bp //= 2
        bn = c.block_n if rows <= 2 else c.block_n // 2  # [rows, block_k, block_n] partial sums a program
        out.append(GemvConfig(bn, bp, c.split_k, c.num_warps))
    return list(dict.fromkeys(out))


def _split(k: int, unit: int, split: int) -> tuple[int, int]:
    """(number of K splits, K per split: a multiple of ``unit``)."""
    units = -(-k // unit)
    split = max(1, min(split, MAX_SPLIT_K, units))
    per = -(-units // split) * unit
    return -(-k // per), per


def _target(splits: int, out: torch.Tensor) -> torch.Tensor:
    if splits == 1:
        return out
    return torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)


def _finish(target: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, splits: int) -> None:
    if splits > 1:
        sum_splits(target, bias, out, splits)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             out_dtype: torch.dtype, config: GemvConfig) -> torch.Tensor:
    """quant(x) @ W^T (+ bias) for x [M, K] (M <= GEMV_MAX_ROWS, bf16/fp16/fp32, quantised per token
    by ``fp8_quantize``'s kernel first, or inside with ``config.quantize``), ``weight`` fp8 [N, K]
    K-contiguous, ``scale`` float32 [N]. Returns [M, N] in out_dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"the matrix-vector kernels take at most {GEMV_MAX_ROWS} rows, got {rows}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    splits, per = _split(k, config.block_k, config.split_k)
    target = _target(splits, out)
    grid = (-(-n // config.block_n), splits)
    xs = out  # (unused when quantising inside)
    if not config.quantize:
        x, xs = quantize_per_token(x)
    _kernels()[0][grid](x, xs, weight, scale, target, bias if bias is not None else out, rows, n, k, per,
                        x.stride(0), weight.stride(0), target.stride(0) if splits > 1 else 0, target.stride(-2),
                        MIN_SCALE, QUANTIZE=config.quantize, ROWS=next_pow2(rows), BLOCK_N=config.block_n,
                        BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0 and per % config.block_k == 0,
                        HAS_BIAS=bias is not None, PARTIAL=splits > 1, num_warps=config.num_warps)
    _finish(target, bias, out, splits)
    return out


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
              bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """x @ W^T (+ bias) for x [M, K] (M <= GEMV_MAX_ROWS) and a packed int4 weight (``quant_matmul``'s
    layout: packed int32 [K // 8, N], scales and zeros [K // group, N], N contiguous). Returns [M, N]
    in x's dtype."""
    rows, k = x.shape
    n = packed.shape[1]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"the matrix-vector kernels take at most {GEMV_MAX_ROWS} rows, got {rows}")
    if (group // 8) % config.block_k:
        raise ValueError(f"{config.block_k} packed rows a step must divide the group's {group // 8}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    splits, per = _split(k, group, config.split_k)
    target = _target(splits, out)
    grid = (-(-n // config.block_n), splits)
    _kernels()[1][grid](x, packed, scales, zeros if zeros is not None else scales, target,
                        bias if bias is not None else out, rows, n, k, per, x.stride(0), packed.stride(0),
                        scales.stride(0), zeros.stride(0) if zeros is not None else 0,
                        target.stride(0) if splits > 1 else 0, target.stride(-2), GROUP=group,
                        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
                        FOLD=x.dtype != torch.float32, ROWS=next_pow2(rows), BLOCK_N=config.block_n,
                        BLOCK_P=config.block_k, num_warps=config.num_warps)
    _finish(target, bias, out, splits)
    return out
