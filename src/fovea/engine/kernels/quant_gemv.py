"""Matrix-vector products with quantised weights for decode (1-4 rows): FP8 per channel with
dynamic per-token activations, FP8 with block scales and per-token-group activations, and 4-bit
integers with group scales (W4A16). Same layouts and semantics as ``quant_matmul``'s kernels (its
docstring), other arithmetic:

- no matrix instructions: a program holds ``BLOCK_N`` output columns and multiplies-and-adds its
  weights in float32 registers while they stream in; one launch per product (FP8: after the
  quantiser's), one more where K is split (float32 partials summed in a fixed order by
  ``split_sum.sum_splits``). At one row a tensor-core tile pads the row to 16 and moves the
  weight through shared memory; here the weight goes from memory to a multiply-add in registers.
- every row of x has its own 2-D tile of float32 sums, one value per weight a thread holds,
  reduced once after the loop (up to 4 named tiles: a [rows, ...] 3-D tile is re-laid out through
  shared memory on every step, which the first version of these kernels did: 7.6 (FP8) and 9.3
  (int4) sm_90 instructions a weight, against 4.0 and 4.3 now, counted in the SASS that triton
  3.9 and ptxas write for the 1-row kernels; ``bench/kernel_sass.py``).
- FP8: the activations quantised by ``fp8_quantize``'s launch; x is read as a tile of broadcast
  pointers in W's layout, so each x is loaded and converted once for the W rows a thread holds
  beside it. The products of two e4m3 values are exact in float32. Block-scaled weights: a step
  lies in one K group and a program's columns in one weight block, so the step's two scales
  multiply its activations (4.7 instructions a weight; the K group is a constant, so a step's group
  index is a shift).
- int4 (bf16/fp16 activations): one shift brings a byte of a packed int32 to bits 15..22, and
  one LOP3 each makes its two codes the float32 256 + q and 16 + q (``int4_codes.int4_pair``; no
  conversion instruction), multiplied by x exactly (at most 9 + 8 or 9 + 11 significant bits) and
  summed over a thread's packed rows from minus the codes' offsets, sum_j x_j (z + 256 or 16),
  made once per group, column and packed row (``int4_start``: the float32 sums carry terms at
  most 271 times the exact ones', a relative 2^-24 * 271 < 2^-15, below bf16's and fp16's output
  rounding). With float32 activations the codes are 2^23 + q less 2^23 + z, exact, before the
  product. Its pointers step a group at a time. 4.3 instructions a weight at 1 row (64 columns a
  program; 4.0 with 128), against 4.95 and 4.5 with a shift a code, the offsets taken off after
  the products and the addresses recomputed from the group's index.

Nothing is software-pipelined by triton here (no matrix instruction consumes the loads): resident
programs alone hide the memory's latency. At one row the choice also times the first candidates
with ``prefetch`` (each step loads the next step's weights before it computes: twice the bytes in
flight a program, for 7-9 more registers; the FP8 tile is carried as fp16, since e4m3 bytes carried
from step to step are re-packed every step).

Launch configurations are chosen per shape on first use by timing (``quant_matmul._choose``).
triton is imported lazily. Checked against the dequantised reference by the tests (the CPU
interpreter) and on the GPU by ``python3 bench/quant_matmul.py --impls fp8_gemv,fp8_block,int4_gemv``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from fovea.engine.kernels.fp8_quantize import quantize_per_token
from fovea.engine.kernels.split_sum import sum_splits
from fovea.engine.kernels.triton_util import next_pow2

GEMV_MAX_ROWS = 4  # products of at most this many rows may take these kernels
# Up to a group (or a step) a program: the small products of a decode step (q/k/v and o, 6-8 MB at
# 7B) read their weights at ~1 TB/s with 8 splits (each program's steps wait on memory one after
# another), so the choice also times 16 and 32; their partials are a few hundred KB
MAX_SPLIT_K = 32
FILLING_PROGRAMS = 1024  # programs of an unsplit grid that keep an H100's or H200's memory busy alone
# Where int4_codes.int4_pair finds its two codes once their byte is shifted to bits 15..22 (bit 23 is
# the exponent's lowest). Passed to the kernel as values, not written in it: as literals, ptxas
# re-materialises them before every LOP3 (which takes one immediate): ~0.6 more instructions a
# weight in the one-code-a-shift version (5.6 against 5.0).
LOW_CODE_MASK = 0x78000  # bits 15..18: units of the mantissa under 256's exponent
HIGH_CODE_MASK = 0x780000  # bits 19..22: units under 16's

# bound by _kernels() (epilogue, fp8_gemv_parts, int4_codes): module globals, where triton's interpreter
# looks a kernel's names up
store_row = fp8_weights = fp8_activations = fp8_row_sums = None
int4_pair = int4_exact_pair = int4_start = None


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program
    block_k: int  # FP8: weight columns per step; int4: packed rows (8 weights each) per step: a group's
    split_k: int = 1  # programs along K (partials summed by a second launch)
    num_warps: int = 4
    # each step loads the next step's weights before it computes: twice the bytes in flight a
    # program, for a few more registers (no software pipelining otherwise: resident programs alone
    # hide the memory's latency)
    prefetch: bool = False

    def describe(self) -> str:
        return (f"gemv {self.block_n}x{self.block_k} split={self.split_k} w{self.num_warps}"
                + (" prefetch" if self.prefetch else ""))


def with_prefetch(configs: list[GemvConfig], rows: int, first: int = 3) -> list[GemvConfig]:
    """``configs`` and, at one row (batch-1 decode, where bytes in flight bound the kernels), the
    first ``first`` of them again with ``prefetch``: the choice times whether it pays."""
    if rows != 1:
        return configs
    return configs + [dataclasses.replace(c, prefetch=True) for c in configs[:first]]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    from fovea.engine.kernels import epilogue, fp8_gemv_parts, int4_codes

    global store_row, fp8_weights, fp8_activations, fp8_row_sums, int4_pair, int4_exact_pair, int4_start
    store_row = epilogue.store_row
    fp8_weights, fp8_activations = fp8_gemv_parts.fp8_weights, fp8_gemv_parts.fp8_activations
    fp8_row_sums = fp8_gemv_parts.fp8_row_sums
    int4_pair, int4_exact_pair, int4_start = (int4_codes.int4_pair, int4_codes.int4_exact_pair,
                                              int4_codes.int4_start)

    @triton.jit
    def fp8_gemv_kernel(X, XS, W, WS, C, BIAS, M, N, K, k_split, stride_xm, stride_xs, stride_wn, stride_ws,
                        stride_cs, stride_cm, group_n, GROUP_K: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                        PREFETCH: tl.constexpr):
        # C[m, n] = sum_k xq[m, k] W[n, k] * xs[m] * ws[n]: xq e4m3 activations with their per-row
        # scales xs [M, 1] (the quantiser's), W e4m3 [N, K] with per-channel scales ws [N]. With
        # BLOCK_SCALED, xs is [M, K / GROUP_K] and ws [N / group_n, K / GROUP_K]: a step lies in one K
        # group (BLOCK_K divides GROUP_K, a constant, so a step's group is a shift, not a division)
        # and a program's columns in one weight block (BLOCK_N divides group_n), so both of a step's
        # scales multiply its activations, not each weight. One 2-D tile of float32 partial sums a
        # row of x (ROWS <= 4 named accumulators: a [ROWS, N, K] tile would be
        # re-laid out through shared memory on every step), reduced over K once, after the loop.
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        # x as a [BLOCK_N, BLOCK_K] tile of broadcast pointers: loaded in w's layout (a [BLOCK_K] load
        # would be re-laid out through shared memory every step); the repeated loads are one load
        x_ptrs = X + (k_start + offs_k)[None, :] + (offs_n * 0)[:, None]
        # rows past M (ROWS is M rounded up to a power of 2) read row M - 1 and are never stored: no masks
        x1 = tl.minimum(1, M - 1) * stride_xm
        x2 = tl.minimum(2, M - 1) * stride_xm
        x3 = tl.minimum(3, M - 1) * stride_xm
        xs0 = XS
        xs1 = XS + tl.minimum(1, M - 1) * stride_xs
        xs2 = XS + tl.minimum(2, M - 1) * stride_xs
        xs3 = XS + tl.minimum(3, M - 1) * stride_xs
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if PREFETCH:  # the first step's weights; each step then loads the next step's before computing
            # (carried as fp16, exact for e4m3: carried as bytes, they are re-packed every step)
            w = fp8_weights(w_ptrs, n_ok, k_start, k_end, offs_k, EVEN_K, True).to(tl.float16)
        for k0 in range(k_start, k_end, BLOCK_K):
            if PREFETCH:
                w_next = fp8_weights(w_ptrs + BLOCK_K, n_ok, k0 + BLOCK_K, k_end, offs_k, EVEN_K,
                                     True).to(tl.float16)
            else:
                w = fp8_weights(w_ptrs, n_ok, k0, k_end, offs_k, EVEN_K, False)
            k_ok = offs_k < BLOCK_K if EVEN_K else (k0 + offs_k) < k_end
            w = w.to(tl.float32)
            g = k0 // GROUP_K
            if BLOCK_SCALED:  # the program's columns lie in one weight block: its scale for this K group
                sw = tl.load(WS + (pid_n * BLOCK_N // group_n) * stride_ws + g)
            else:
                sw = 1.0
            acc0 += w * fp8_activations(x_ptrs, k_ok, xs0, g, sw, BLOCK_SCALED)
            if ROWS > 1:
                acc1 += w * fp8_activations(x_ptrs + x1, k_ok, xs1, g, sw, BLOCK_SCALED)
            if ROWS > 2:
                acc2 += w * fp8_activations(x_ptrs + x2, k_ok, xs2, g, sw, BLOCK_SCALED)
            if ROWS > 3:
                acc3 += w * fp8_activations(x_ptrs + x3, k_ok, xs3, g, sw, BLOCK_SCALED)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            if PREFETCH:
                w = w_next
        if BLOCK_SCALED:
            ws = tl.zeros([BLOCK_N], tl.float32)  # (unused: the steps were scaled)
        else:
            ws = tl.load(WS + offs_n, mask=n_ok, other=0.0)
        y = fp8_row_sums(acc0, ws, xs0, BLOCK_SCALED)
        store_row(C, BIAS, y, 0, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS, PARTIAL)
        if ROWS > 1:
            y = fp8_row_sums(acc1, ws, xs1, BLOCK_SCALED)
            store_row(C, BIAS, y, 1, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS, PARTIAL)
        if ROWS > 2:
            y = fp8_row_sums(acc2, ws, xs2, BLOCK_SCALED)
            store_row(C, BIAS, y, 2, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS, PARTIAL)
        if ROWS > 3:
            y = fp8_row_sums(acc3, ws, xs3, BLOCK_SCALED)
            store_row(C, BIAS, y, 3, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS, PARTIAL)

    @triton.jit
    def int4_gemv_kernel(X, P, S, Z, C, BIAS, M, N, K, k_split, stride_xm, stride_pk, stride_sk, stride_zk,
                         stride_cs, stride_cm, low_mask, high_mask, GROUP: tl.constexpr,
                         HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                         FOLD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREFETCH: tl.constexpr):
        # C[m, n] = sum_k x[m, k] (q[k, n] - z[g, n]) s[g, n], g = k // GROUP; packed [K / 8, N] (bits
        # 4j..4j+3 of row i: k = 8i + j); a group (GROUP / 8 packed rows, a power of 2) per step, and
        # k_split a multiple of GROUP. Every thread keeps float32 sums for its own packed rows and
        # columns (a 2-D tile a row of x, as the FP8 kernel), starts a group's from minus its
        # offsets, scales them into the tile at the group's end, and the tile is reduced over the
        # packed rows once, after the loop.
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_p = tl.arange(0, GROUP // 8)
        n_ok = offs_n < N
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        x1 = tl.minimum(1, M - 1) * stride_xm
        x2 = tl.minimum(2, M - 1) * stride_xm
        x3 = tl.minimum(3, M - 1) * stride_xm
        acc0 = tl.zeros([GROUP // 8, BLOCK_N], tl.float32)
        acc1 = tl.zeros([GROUP // 8, BLOCK_N], tl.float32)
        acc2 = tl.zeros([GROUP // 8, BLOCK_N], tl.float32)
        acc3 = tl.zeros([GROUP // 8, BLOCK_N], tl.float32)
        # pointers stepped a group at a time (recomputed from the group's index they cost ~0.5
        # instructions a weight in address arithmetic)
        g_start = k_start // GROUP
        s_ptrs = S + g_start * stride_sk + offs_n
        z_ptrs = Z + g_start * stride_zk + offs_n
        p_ptrs = P + (k_start // 8 + offs_p).to(tl.int64)[:, None] * stride_pk + offs_n[None, :]
        x_ptrs = X + k_start + 8 * offs_p
        p_step = (GROUP // 8) * stride_pk
        if PREFETCH:  # the first group's weights; each step then loads the next group's before computing
            p = tl.load(p_ptrs, mask=n_ok[None, :], other=0, eviction_policy="evict_first")
        for g0 in range(k_start, k_end, GROUP):
            if PREFETCH:
                # (a tile, uniform: a scalar condition is no mask to the interpreter)
                more = (offs_n * 0 + g0 + GROUP) < k_end
                p_next = tl.load(p_ptrs + p_step, mask=(n_ok & more)[None, :], other=0,
                                 eviction_policy="evict_first")
            s = tl.load(s_ptrs, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptrs, mask=n_ok, other=0.0).to(tl.float32)
            else:
                z = tl.full([BLOCK_N], 8.0, tl.float32)
            # the group's packed rows in one step; x read in the slice of p's layout (one load per
            # packed row and code, used for the thread's columns)
            if not PREFETCH:
                p = tl.load(p_ptrs, mask=n_ok[None, :], other=0, eviction_policy="evict_first")
            xs0, part0 = int4_start(x_ptrs, z, FOLD)
            if ROWS > 1:
                xs1, part1 = int4_start(x_ptrs + x1, z, FOLD)
            if ROWS > 2:
                xs2, part2 = int4_start(x_ptrs + x2, z, FOLD)
            if ROWS > 3:
                xs3, part3 = int4_start(x_ptrs + x3, z, FOLD)
            for b in tl.static_range(4):
                if FOLD:
                    low, high = int4_pair(p, b, low_mask, high_mask)
                else:
                    low, high = int4_exact_pair(p, b, z)
                part0 = part0 + low * xs0[2 * b][:, None]
                part0 = part0 + high * xs0[2 * b + 1][:, None]
                if ROWS > 1:
                    part1 = part1 + low * xs1[2 * b][:, None]
                    part1 = part1 + high * xs1[2 * b + 1][:, None]
                if ROWS > 2:
                    part2 = part2 + low * xs2[2 * b][:, None]
                    part2 = part2 + high * xs2[2 * b + 1][:, None]
                if ROWS > 3:
                    part3 = part3 + low * xs3[2 * b][:, None]
                    part3 = part3 + high * xs3[2 * b + 1][:, None]
            acc0 += part0 * s[None, :]
            if ROWS > 1:
                acc1 += part1 * s[None, :]
            if ROWS > 2:
                acc2 += part2 * s[None, :]
            if ROWS > 3:
                acc3 += part3 * s[None, :]
            s_ptrs += stride_sk
            z_ptrs += stride_zk
            p_ptrs += p_step
            if PREFETCH:
                p = p_next
            x_ptrs += GROUP
        store_row(C, BIAS, tl.sum(acc0, axis=0), 0, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS, PARTIAL)
        if ROWS > 1:
            store_row(C, BIAS, tl.sum(acc1, axis=0), 1, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS,
                      PARTIAL)
        if ROWS > 2:
            store_row(C, BIAS, tl.sum(acc2, axis=0), 2, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS,
                      PARTIAL)
        if ROWS > 3:
            store_row(C, BIAS, tl.sum(acc3, axis=0), 3, M, offs_n, n_ok, split, stride_cs, stride_cm, HAS_BIAS,
                      PARTIAL)

    return fp8_gemv_kernel, int4_gemv_kernel


def fp8_tile(rows: int) -> int:
    """Weights a 4-warp FP8 program streams a step: 32 a thread (two 16-byte loads) up to 2 rows,
    16 at 3-4 (its accumulators are rows times that: ~200 registers at 4 rows and 32)."""
    return 4096 if rows <= 2 else 2048


def fp8_gemv_candidates(rows: int) -> list[GemvConfig]:
    """FP8 configurations timed for ``rows`` (<= GEMV_MAX_ROWS) rows; the first is the default.
    ``fp8_tile`` weights a step. Splitting K fills the GPU where N is small (qkv, o and down give
    224-288 programs of 16 columns for 132 SMs)."""
    tile = fp8_tile(rows)
    configs = [GemvConfig(16, tile // 16), GemvConfig(16, tile // 16, 2), GemvConfig(16, tile // 16, 4),
               GemvConfig(32, tile // 32, 2), GemvConfig(8, tile // 8, 4), GemvConfig(16, tile // 16, 8)]
    return with_prefetch(configs, rows) + wide_splits(GemvConfig(16, tile // 16))


def fp8_block_gemv_candidates(rows: int, block: tuple[int, int]) -> list[GemvConfig]:
    """Configurations for FP8 weights with (bn, bk) blocks: a step is one K group or a part of it
    (bk's largest power-of-2 divisor, up to 256) and a program's columns lie in one block (bn's
    largest power-of-2 divisor, up to 64), so each step's scales multiply its activations only.
    The same weights a thread as per channel; none where a 16-byte load would cross a group."""
    step = min(256, block[1] & -block[1])
    widest = min(64, block[0] & -block[0])
    if step < 16:
        return []
    bn = min(widest, fp8_tile(rows) // step)
    return with_prefetch(list(dict.fromkeys(
        [GemvConfig(bn, step), GemvConfig(bn, step, 2), GemvConfig(bn, step, 4), GemvConfig(bn, step, 8),
         GemvConfig(max(1, bn // 2), step, 4), GemvConfig(max(1, bn // 2), step, 8)])), rows, 2) \
        + wide_splits(GemvConfig(bn, step))


def int4_group_supported(group: int) -> bool:
    """The int4 kernel takes a group a step: group / 8 packed rows, a power of 2 up to 32."""
    rows = group // 8
    return group % 8 == 0 and 1 <= rows <= 32 and rows & (rows - 1) == 0


def int4_gemv_candidates(rows: int, group: int) -> list[GemvConfig]:
    """int4 configurations (block_k: the group's packed rows, taken whole a step); none for groups
    the kernel does not take. A 4-warp thread holds 8 packed int32 a step (64 weights; 4 at 3-4
    rows), with float32 sums for each (~50, 70 and 130 registers at 1, 2 and 4 rows)."""
    if not int4_group_supported(group):
        return []
    packed_rows = group // 8
    bn = (64 if rows <= 2 else 32) * 16 // packed_rows
    configs = [GemvConfig(bn, packed_rows), GemvConfig(bn, packed_rows, 2), GemvConfig(bn, packed_rows, 4),
               GemvConfig(bn, packed_rows, 8), GemvConfig(bn // 2, packed_rows, 4),
               GemvConfig(bn // 2, packed_rows, 8)]
    if rows == 1:
        configs.append(GemvConfig(2 * bn, packed_rows, 4))
    return with_prefetch(configs, rows) + wide_splits(GemvConfig(bn // 2, packed_rows))


def wide_splits(config: GemvConfig) -> list[GemvConfig]:
    """``config`` split 16 and 32 ways over K (``MAX_SPLIT_K``; at most a step a program where K is
    shorter): the candidates for products too small to keep the memory busy otherwise."""
    return [dataclasses.replace(config, split_k=16), dataclasses.replace(config, split_k=32)]


def for_columns(configs: list[GemvConfig], n: int) -> list[GemvConfig]:
    """``configs`` for a product of ``n`` output columns: without the splits over 8 (``wide_splits``)
    where its columns alone make ``FILLING_PROGRAMS`` programs (gate/up: 2,368 at 7B), so the
    choice times no candidate that cannot win."""
    return [c for c in configs if c.split_k <= 8 or -(-n // c.block_n) < FILLING_PROGRAMS]


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
    by ``fp8_quantize``'s kernel first), ``weight`` fp8 [N, K] K-contiguous, ``scale`` float32 [N].
    Returns [M, N] in out_dtype."""
    if x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"the matrix-vector kernels take at most {GEMV_MAX_ROWS} rows, got {x.shape[0]}")
    xq, xs = quantize_per_token(x)
    return fp8_gemv_quantised(xq, xs, weight, scale, bias, out_dtype, config)


def fp8_gemv_quantised(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype, config: GemvConfig,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """The product of already quantised activations, as ``quant_matmul.fp8_gemm``: ``xq`` e4m3
    [M, K] with ``xs`` float32 [M, 1] and ``scale`` [N] (``block`` None), or ``xs`` [M, cdiv(K, bk)]
    and ``scale`` [cdiv(N, bn), cdiv(K, bk)] for ``block`` = (bn, bk), which the tile
    (``config.block_n`` x ``config.block_k``) must divide. Returns [M, N] in out_dtype."""
    rows, k = xq.shape
    n = weight.shape[0]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"the matrix-vector kernels take at most {GEMV_MAX_ROWS} rows, got {rows}")
    if block is not None and (block[1] % config.block_k or block[0] % config.block_n):
        raise ValueError(f"a {config.block_n}x{config.block_k} tile must divide the weight blocks "
                         f"({block[0]}x{block[1]}): a step takes one block's scale")
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    out = torch.empty((rows, n), dtype=out_dtype, device=xq.device)
    if rows == 0:
        return out
    splits, per = _split(k, config.block_k, config.split_k)
    target = _target(splits, out)
    grid = (-(-n // config.block_n), splits)
    group_n, group_k = block if block is not None else (1, 1)  # per channel: no group index is read
    _kernels()[0][grid](xq, xs, weight, scale, target, bias if bias is not None else out, rows, n, k, per,
                        xq.stride(0), xs.stride(0), weight.stride(0), scale.stride(0) if block is not None else 0,
                        target.stride(0) if splits > 1 else 0, target.stride(-2), group_n, group_k,
                        ROWS=next_pow2(rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                        EVEN_K=k % config.block_k == 0 and per % config.block_k == 0,
                        BLOCK_SCALED=block is not None, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
                        PREFETCH=config.prefetch, num_warps=config.num_warps)
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
    if not int4_group_supported(group) or config.block_k != group // 8:
        raise ValueError(f"the int4 matrix-vector kernel takes a whole group a step (group / 8 packed rows, "
                         f"a power of 2 up to 32): block_k {config.block_k} for groups of {group}")
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
                        target.stride(0) if splits > 1 else 0, target.stride(-2), LOW_CODE_MASK,
                        HIGH_CODE_MASK, GROUP=group, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
                        PARTIAL=splits > 1, FOLD=x.dtype != torch.float32, ROWS=next_pow2(rows),
                        BLOCK_N=config.block_n, PREFETCH=config.prefetch, num_warps=config.num_warps)
    _finish(target, bias, out, splits)
    return out
