"""Matrix products with quantised weights: FP8 (per-channel or 128x128-block scales, dynamic
per-token FP8 activations) and 4-bit integers with group scales (W4A16).

Weight layouts (raw tensors, as the checkpoint readers hand them over):

- FP8 channel: ``weight`` float8_e4m3fn [N, K], ``scale`` float32 [N]; W[n, k] = weight[n, k] * scale[n].
- FP8 block: ``weight`` float8_e4m3fn [N, K], ``scale`` float32 [cdiv(N, bn), cdiv(K, bk)];
  W[n, k] = weight[n, k] * scale[n // bn, k // bk].
- Int4: ``packed`` int32 [K // 8, N], bits 4j..4j+3 of packed[i, n] the unsigned code q of W[n, 8i + j];
  ``scales`` [K // group, N] in the activation dtype; ``zeros`` the same shape and dtype holding the
  unsigned zero codes, or None for the symmetric zero 8; W[n, k] = (q - z[k // group, n]) * s[k // group, n].

What runs where:

- ``fp8_linear``: on CUDA with compute capability >= 8.9, the activations quantised per token
  (``fp8_quantize``) and ``torch._scaled_mm`` (cuBLASLt, row-wise scales), or this module's Triton
  FP8 kernel where ``_scaled_mm`` cannot take the shape or dtype, or where it timed faster (few rows,
  decided per shape on first use). Elsewhere (CPU, the interpreter, older GPUs): the same quantised
  activations times the dequantised weight in float32.
- ``fp8_block_linear``: the Triton kernel with per-token-group activation scales (the group is the
  weight block's K width): each K tile's product is scaled by a_scale[m] * w_scale[n // bn] before
  it is accumulated; for 1-4 rows also ``quant_gemv``'s matrix-vector kernel, whichever is faster.
  Without a kernel: the same in torch.
- ``int4_linear``: below ``INT4_DEQUANT_MIN_ROWS`` rows one Triton kernel, split over K for few
  rows (decode reads 0.5 byte per weight; the split keeps every SM busy), tiled for more. Each K
  tile (inside one group) is dot(x, q - z) in the activation dtype (exact: small integers; the
  codes made floats from their bits or by conversion, whichever timed faster), accumulated in
  float32 times the group's scale. From that many rows (prefill): the weight dequantised by a
  Triton kernel into a scratch buffer the caller holds (one for all layers), then torch's matmul.
  Without a kernel: the weight dequantised in float32, then one product.

For at most ``quant_gemv.GEMV_MAX_ROWS`` rows (decode) the FP8 and int4 choices also time
``quant_gemv``'s matrix-vector kernels (no matrix instructions), each product timed whole with
its quantiser, and keep whichever is faster per shape. Every candidate's output is first compared
with the first candidate's (the tensor-core kernel's): one that disagrees is never chosen.

Launch configurations are chosen per (kind, row bucket, N, K, group, dtype) on first use on a GPU by
timing a few candidates (``AUTOTUNE``); under the interpreter or a graph capture the first candidate
is used and not kept. Every launch is capturable in a CUDA graph: no host syncs, buffers from
torch's allocator.

triton is imported lazily, as in ``triton_decode``. Check on the GPU against the dequantised
reference, and time, with ``python3 bench/quant_matmul.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from fovea.engine.kernels import quant_gemv
from fovea.engine.kernels.split_sum import sum_splits
from fovea.engine.kernels.fp8_quantize import (
    can_run_triton,
    interpreting,
    quantize_per_token,
    quantize_per_token_group,
)
from fovea.engine.kernels.triton_util import launch_time, next_pow2

log = logging.getLogger("fovea.engine.paged")

DEFAULT_SMS = 132  # H100/H200; used where no CUDA device can be asked
SMALL_M = 16  # at most this many rows: the matrix-vector (decode) configurations
MAX_SPLIT_K = 16
# From this many rows on, ``int4_linear`` dequantises the weight into a scratch buffer in the
# activation dtype (``int4_dequantize``) and calls torch's matmul, instead of the fused kernel.
# Per weight, on the H200 (4.2 TB/s copy, 790 dense bf16 TFLOP/s):
#   dequantise + cuBLAS: 2.5 B / 4.2 TB/s (read 0.5, write 2) + max(2 B / 4.2 TB/s, 2 M / 790 TFLOP/s)
#                        = 0.595 ps + max(0.476 ps, 0.00253 M ps)
#   fused:               max(0.5 B / 4.2 TB/s, 2 M / (f * 790 TFLOP/s)), where f, the fused kernel's
#                        fraction of the tensor cores' rate at many rows, was 0.26 (bench/quant_matmul.py,
#                        2026-12-03: 20.7 and 130.6 ms per 7B step at 256 and 2,048 rows, cuBLAS 5.1, 34.5)
#                        = 0.00974 M ps
# The two meet at M = 1.071 / 0.00974 = 110 rows; the first power of two above is 128 (and 128 rows
# cost the detour 1.07 ps against 1.25). A better fused kernel (larger f) moves it up: at f = 0.5,
# M = 235. bench/quant_matmul.py times both (int4_fused, int4_dq) on every shape to confirm it.
INT4_DEQUANT_MIN_ROWS = 128
INT4_IMPLS = ("fused", "dequant", "torch")
AUTOTUNE = True  # time the candidate configurations of a new shape on first use (CUDA only)
FP8_IMPLS = ("scaled_mm", "triton", "torch")


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # 0: automatic (enough programs for every SM), only where the rows are few
    num_warps: int = 4
    num_stages: int = 3
    magic: bool = False  # int4: codes made floats from their bits, not converted (the kernel's comment)
    per_nibble: bool = False  # int4: one product per nibble position, no reshape (block_k >= 128)
    fold: bool = False  # int4 with magic, bf16/fp16: the zero points taken off the accumulator, not each weight

    def describe(self) -> str:
        split = "auto" if self.split_k == 0 else str(self.split_k)
        unpack = "".join(f" {name}" for name, on in (("magic", self.magic), ("nibbles", self.per_nibble),
                                                       ("fold", self.fold)) if on)
        return (f"{self.block_m}x{self.block_n}x{self.block_k} split={split} "
                f"w{self.num_warps}s{self.num_stages}{unpack}")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def fp8_capable(device: torch.device) -> bool:
    """FP8 matrix instructions (Ada, Hopper and later): compute capability >= 8.9."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


def _triton_fp8_runs(x: torch.Tensor) -> bool:
    return can_run_triton(x) and (not x.is_cuda or fp8_capable(x.device))


def _cannot_time() -> bool:
    return not AUTOTUNE or interpreting() or torch.cuda.is_current_stream_capturing()


store_tile = None  # bound by _kernels() (epilogue: a helper the interpreter finds in this module's globals)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    from fovea.engine.kernels import epilogue

    global store_tile
    store_tile = epilogue.store_tile

    @triton.jit
    def fp8_gemm_kernel(A, AS, B, BS, C, BIAS, M, N, K, k_split,
                        stride_am, stride_as, stride_bn, stride_bsn, stride_cs, stride_cm, group_n, group_k,
                        BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
        # C[m, n] = sum_k A[m, k] B[n, k] * scales; A, B fp8 (K-contiguous), K split over axis 1.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n  # grouped order: GROUP_M row tiles share the weight tiles in L2
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + (k_start + offs_k)[None, :]
        b_ptrs = B + offs_n.to(tl.int64)[None, :] * stride_bn + (k_start + offs_k)[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = (k0 + offs_k) < k_end
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
            if BLOCK_SCALED:  # the tile lies in one K block (BLOCK_K divides group_k)
                kb = k0 // group_k
                a_s = tl.load(AS + offs_m * stride_as + kb, mask=m_ok, other=0.0)
                b_s = tl.load(BS + (offs_n // group_n) * stride_bsn + kb, mask=n_ok, other=0.0)
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            else:  # each tile's product added in float32: Hopper's fp8 MMA accumulates with fewer bits
                acc += tl.dot(a, b)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if not BLOCK_SCALED:
            a_s = tl.load(AS + offs_m * stride_as, mask=m_ok, other=0.0)
            b_s = tl.load(BS + offs_n, mask=n_ok, other=0.0)
            acc = acc * a_s[:, None] * b_s[None, :]
        c_ptrs = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_ok = m_ok[:, None] & n_ok[None, :]
        store_tile(C, BIAS, acc, c_ptrs, c_ok, offs_n, n_ok, split, stride_cs, HAS_BIAS, PARTIAL)

    @triton.jit
    def int4_gemm_kernel(A, P, S, Z, C, BIAS, M, N, K, k_split,
                         stride_am, stride_pk, stride_sk, stride_zk, stride_cs, stride_cm,
                         GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr,
                         PER_NIBBLE: tl.constexpr, FOLD: tl.constexpr):
        # C[m, n] = sum_k A[m, k] (q[k, n] - z[g, n]) s[g, n], g = k // GROUP; K % BLOCK_K == 0 and
        # GROUP % BLOCK_K == 0, so every K tile is whole and lies in one group.
        # Unpacking a code q (0..15) into the activation dtype (written out twice below: triton's
        # interpreter does not see a jit helper defined in ``_kernels``, and the module imports triton lazily):
        # - MAGIC_BITS 0: (word >> 4j) & 0xF, converted int -> float32, minus z, converted to the dtype
        #   (two conversion instructions per weight, at a quarter of the integer and float rates);
        # - MAGIC_BITS b (b the bits of the float MAGIC, 2^7 in bf16, 2^10 in fp16, 2^23 in fp32, whose
        #   last mantissa bit is 1): ((word >> 4j) & 0xF) | b reinterpreted as the dtype is MAGIC + q
        #   exactly, and (MAGIC + q) - (MAGIC + z) = q - z exactly; no conversion instruction;
        # - FOLD (bf16/fp16 only): no subtraction per weight: the tile's product with MAGIC + q, less
        #   (MAGIC + z[n]) times the sum of the tile's activations of each row. The products a (MAGIC + q)
        #   are exact in float32 (8 + 8 or 11 + 11 significant bits); the float32 sums carry terms up to
        #   MAGIC + 15 times larger than q - z, a relative 2^-24 * 1039 < 2^-13 of them, below fp16's
        #   output rounding (2^-11) and far below bf16's (2^-8).
        # PER_NIBBLE: nibble j of the packed rows [BLOCK_K / 8, BLOCK_N] is multiplied by the
        # activation columns 8i + j (a strided load of a few rows) in its own product, so the codes are
        # never reshaped across registers (needs BLOCK_K / 8 >= 16, the product's smallest K).
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_p = tl.arange(0, BLOCK_K // 8)
        shifts = tl.arange(0, 8) * 4
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        dt = A.dtype.element_ty
        if PER_NIBBLE:  # column 8i of the tile; nibble j reads column 8i + j
            a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + (k_start + 8 * offs_p)[None, :]
        else:
            a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + (k_start + tl.arange(0, BLOCK_K))[None, :]
        p_ptrs = P + (k_start // 8 + offs_p).to(tl.int64)[:, None] * stride_pk + offs_n[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            p = tl.load(p_ptrs, mask=n_ok[None, :], other=0, eviction_policy="evict_first")
            g = k0 // GROUP
            s = tl.load(S + g * stride_sk + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(Z + g * stride_zk + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            else:
                z = tl.full([BLOCK_N], 8.0, tl.float32)
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            a_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            if PER_NIBBLE:
                for j in tl.static_range(8):
                    a = tl.load(a_ptrs + j, mask=m_ok[:, None], other=0.0)
                    q = (p >> (4 * j)) & 0xF
                    if MAGIC_BITS == 0:
                        w = (q.to(tl.float32) - z[None, :]).to(dt)
                    else:
                        bits = q | MAGIC_BITS
                        if dt != tl.float32:
                            bits = bits.to(tl.int16)
                        w = bits.to(dt, bitcast=True)
                        if UPCAST:  # (the interpreter's bf16 arithmetic is on bit patterns; exact either way)
                            w = w.to(tl.float32)
                            if not FOLD:
                                w = w - (z + MAGIC)[None, :]
                        elif not FOLD:
                            w = w - (z + MAGIC).to(dt)[None, :]  # MAGIC + z and the difference: exact
                    if UPCAST:  # the interpreter multiplies bf16 tiles as their integer bit patterns
                        part += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                    else:
                        part += tl.dot(a, w, input_precision=PRECISION)
                    if FOLD:
                        a_sum += tl.sum(a.to(tl.float32), axis=1)
            else:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                # [BLOCK_K / 8, 8, BLOCK_N] nibbles -> [BLOCK_K, BLOCK_N]: row 8i + j is nibble j of row i
                q = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
                if MAGIC_BITS == 0:
                    w = (q.to(tl.float32) - z[None, :]).to(dt)
                else:
                    bits = q | MAGIC_BITS
                    if dt != tl.float32:
                        bits = bits.to(tl.int16)
                    w = bits.to(dt, bitcast=True)
                    if UPCAST:
                        w = w.to(tl.float32)
                        if not FOLD:
                            w = w - (z + MAGIC)[None, :]
                    elif not FOLD:
                        w = w - (z + MAGIC).to(dt)[None, :]
                if UPCAST:
                    part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(a, w, input_precision=PRECISION)
                if FOLD:
                    a_sum = tl.sum(a.to(tl.float32), axis=1)
            if FOLD:
                part -= a_sum[:, None] * (z + MAGIC)[None, :]
            acc += part * s[None, :]
            a_ptrs += BLOCK_K
            p_ptrs += (BLOCK_K // 8) * stride_pk
        c_ptrs = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_ok = m_ok[:, None] & n_ok[None, :]
        store_tile(C, BIAS, acc, c_ptrs, c_ok, offs_n, n_ok, split, stride_cs, HAS_BIAS, PARTIAL)

    @triton.jit
    def int4_dequant_kernel(P, S, Z, W, N, stride_pk, stride_sk, stride_zk, stride_wk,
                            GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr):
        # W[k, n] = (q[k, n] - z[g, n]) s[g, n] in W's dtype, one [BLOCK_K, BLOCK_N] tile per program
        # (GROUP % BLOCK_K == 0: one row of scales and zeros). The packed rows [BLOCK_K / 8, BLOCK_N]
        # are read once; nibble j of each is written to row 8i + j, one [BLOCK_K / 8, BLOCK_N] slab at
        # a time (no reshape across registers); every row is BLOCK_N contiguous elements, as read.
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_p = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        p = tl.load(P + offs_p.to(tl.int64)[:, None] * stride_pk + offs_n[None, :], mask=n_ok[None, :], other=0,
                    eviction_policy="evict_first")
        g = (pid_k * BLOCK_K) // GROUP
        s = tl.load(S + g * stride_sk + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(Z + g * stride_zk + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 8.0, tl.float32)
        zm = z + 8388608.0
        w_ptrs = W + (8 * offs_p).to(tl.int64)[:, None] * stride_wk + offs_n[None, :]
        for j in tl.static_range(8):
            q = (p >> (4 * j)) & 0xF
            # 2^23 + q from its bits (no int -> float conversion), then exact integer arithmetic in float32
            w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - zm[None, :]) * s[None, :]
            if ROUND_BF16:  # the interpreter's float32 -> bf16 cast truncates: round to nearest even first
                bits = w.to(tl.int32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
                w = bits.to(tl.float32, bitcast=True)
            tl.store(w_ptrs + j * stride_wk, w.to(W.dtype.element_ty), mask=n_ok[None, :])

    return fp8_gemm_kernel, int4_gemm_kernel, int4_dequant_kernel


# ---------------------------------------------------------------------------------------------
# launch configurations


def _m_bucket(rows: int) -> int:
    return min(next_pow2(max(rows, 1)), 1024)


def fp8_candidates(rows: int, block_k_max: int = 128) -> list[GemmConfig]:
    """The configurations timed for an FP8 product of ``rows`` rows (the first is the default)."""
    bk = min(128, block_k_max)
    if rows <= SMALL_M:
        # Not candidates, from the H200 of 2026-12-03 (night; docs/benchmarks.md): a transposed tile
        # (the weight's rows on the M side of Hopper's wgmma), 3% faster per 7B step, whose fp8 sums
        # erred ~2^-14 relative inside each K tile where these kernels add in float32; and the
        # activations quantised inside this kernel, 3x slower than the quantiser's own launch.
        return [GemmConfig(16, 64, bk, 0, 4, 4), GemmConfig(16, 128, bk, 0, 4, 4), GemmConfig(16, 32, bk, 0, 2, 5)]
    if rows <= 64:
        return [GemmConfig(64, 64, bk, 0, 4, 4), GemmConfig(32, 128, bk, 0, 4, 4), GemmConfig(64, 128, bk, 1, 4, 4)]
    if rows <= 256:
        return [GemmConfig(64, 128, bk, 1, 4, 4), GemmConfig(128, 128, bk, 1, 8, 3), GemmConfig(64, 64, bk, 1, 4, 4)]
    return [GemmConfig(128, 128, bk, 1, 8, 3), GemmConfig(128, 256, bk, 1, 8, 3), GemmConfig(64, 128, bk, 1, 4, 4)]


def int4_candidates(rows: int, group: int, unpack: str = "all") -> list[GemmConfig]:
    """The configurations timed for an int4 product (block_k is cut to divide the group; per-nibble
    products only where block_k stays 128). ``unpack``: "all" (the magic-number unpacking, and the
    old default beside it), "shift" (the int -> float conversion of the codes: the candidates of
    before 2026-12-03) or "magic"."""
    def magic(bm, bn, bk, split, warps, stages, nibbles=False, fold=False):
        return GemmConfig(bm, bn, bk, split, warps, stages, magic=True, per_nibble=nibbles, fold=fold)

    if rows <= SMALL_M:
        shift = [GemmConfig(16, 64, 128, 0, 4, 4), GemmConfig(16, 128, 128, 0, 4, 3),
                 GemmConfig(16, 32, 128, 0, 2, 5), GemmConfig(16, 64, 64, 0, 4, 5)]
        # A GEMV is bound by the unpacking's instructions more than by the bytes (the old kernel read
        # at 19-26% of the copy bandwidth): magic unpacking, with and without the zeros folded, a few
        # tile shapes, per-nibble products, and a deeper pipeline (more bytes in flight).
        fast = [magic(16, 64, 128, 0, 4, 4), magic(16, 64, 128, 0, 4, 4, fold=True),
                magic(16, 128, 128, 0, 4, 3), magic(16, 128, 128, 0, 4, 3, fold=True),
                magic(16, 64, 128, 0, 4, 4, nibbles=True), magic(16, 64, 128, 0, 4, 4, nibbles=True, fold=True),
                magic(16, 32, 128, 0, 2, 5), magic(16, 64, 128, 0, 4, 6, fold=True)]
    elif rows <= 64:
        shift = [GemmConfig(32, 128, 64, 0, 4, 4), GemmConfig(64, 64, 64, 0, 4, 4), GemmConfig(16, 128, 128, 0, 4, 3)]
        fast = [magic(32, 128, 64, 0, 4, 4), magic(32, 128, 64, 0, 4, 4, fold=True), magic(64, 64, 64, 0, 4, 4),
                magic(16, 128, 128, 0, 4, 3, fold=True), magic(32, 128, 128, 0, 4, 3, nibbles=True)]
    elif rows <= 256:
        shift = [GemmConfig(64, 128, 64, 1, 4, 4), GemmConfig(128, 128, 64, 1, 8, 3), GemmConfig(64, 64, 64, 1, 4, 4)]
        fast = [magic(64, 128, 64, 1, 4, 4), magic(128, 128, 64, 1, 8, 3), magic(128, 128, 64, 1, 8, 3, fold=True)]
    else:
        shift = [GemmConfig(128, 128, 64, 1, 8, 3), GemmConfig(128, 256, 64, 1, 8, 3), GemmConfig(64, 128, 64, 1, 4, 4)]
        fast = [magic(128, 128, 64, 1, 8, 3), magic(128, 256, 64, 1, 8, 3), magic(128, 128, 64, 1, 8, 3, fold=True)]
    if unpack not in ("all", "shift", "magic"):
        raise ValueError(f"unpack must be all, shift or magic, got {unpack!r}")
    configs = {"all": fast + shift[:1], "shift": shift, "magic": fast}[unpack]
    out = []
    for c in configs:
        bk = _pow2_divisor(c.block_k, group)
        if c.per_nibble and bk < 128:
            continue
        out.append(dataclasses.replace(c, block_k=bk))
    return out


def _pow2_divisor(want: int, group: int) -> int:
    """The largest power of two <= want that divides the group."""
    bk = want
    while bk > 1 and group % bk:
        bk //= 2
    return bk


def _splits(rows: int, n: int, k: int, config: GemmConfig, unit: int, sms: int) -> tuple[int, int]:
    """(number of K splits, K per split: a multiple of ``unit``)."""
    k_units = -(-k // unit)
    split = config.split_k
    if split == 0:
        tiles = -(-rows // config.block_m) * -(-n // config.block_n)
        split = 1 if tiles >= sms else -(-2 * sms // tiles)
    split = max(1, min(split, MAX_SPLIT_K, k_units))
    per = -(-k_units // split) * unit
    return -(-k // per), per


# Choices made on first use of a shape, by timing (start-up makes them: memory.planner); the
# tuning cache keeps them between starts. Keys (``candidates_for`` reads them):
#   ("fp8", row bucket, N, K, out dtype): the whole product from unquantised activations, the
#       tensor-core kernel (with the quantiser's launch) or, for a few rows, the matrix-vector one;
#   ("fp8-mma", ...): the same for the tensor-core kernel alone (``fp8_gemm`` without a config);
#   ("fp8-block", row bucket, N, K, out dtype, bn, bk);
#   ("int4", row bucket, N, K, group, dtype, has zeros) and ("int4-mma", ...): as fp8 and fp8-mma.
Config = GemmConfig | quant_gemv.GemvConfig
_CHOSEN: dict[tuple, Config] = {}  # -> the fastest candidate


def candidates_for(key: tuple) -> list[Config]:
    """The configurations timed for a choice ``key`` (``_CHOSEN``'s); ValueError for a key no
    kernel here makes."""
    kind, bucket = key[0], key[1]
    gemv = bucket <= quant_gemv.GEMV_MAX_ROWS
    if kind in ("fp8", "fp8-mma", "fp8-quantised") and len(key) == 5:
        extra = quant_gemv.fp8_gemv_candidates(bucket) if gemv and kind != "fp8-mma" else []
        return fp8_candidates(bucket) + quant_gemv.for_columns(extra, key[2])
    if kind == "fp8-block" and len(key) == 7:
        extra = quant_gemv.fp8_block_gemv_candidates(bucket, (key[5], key[6])) if gemv else []
        return fp8_candidates(bucket, _block_k_max(key[6])) + quant_gemv.for_columns(extra, key[2])
    if kind in ("int4", "int4-mma") and len(key) == 7:
        extra = quant_gemv.int4_gemv_candidates(bucket, key[4]) if gemv and kind == "int4" else []
        return int4_candidates(bucket, key[4]) + quant_gemv.for_columns(extra, key[2])
    raise ValueError(f"not a quantized kernel's choice: {key!r}")


def config_from_fields(fields: dict) -> Config:
    """A configuration from its dataclass fields (the tuning cache's JSON)."""
    kind = GemmConfig if "block_m" in fields else quant_gemv.GemvConfig
    return kind(**fields)


def _block_k_max(block_k: int | None) -> int:
    """The deepest K tile for a weight block of ``block_k`` columns (None: per-channel scales)."""
    return 128 if block_k is None else min(128, _pow2_divisor(128, block_k))


def _choose(key: tuple, candidates: list[Config], launch) -> Config:
    config = _CHOSEN.get(key)
    if config is not None:
        return config
    if _cannot_time() or len(candidates) == 1:
        return candidates[0]
    times, failed = [], []
    reference, reference_config = None, None  # the first candidate that ran (the long-standing default first)
    for c in candidates:
        try:
            out = launch(c)
            if reference_config is None:
                reference, reference_config = out, c
            elif (problem := _disagreement(out, reference)) is not None:
                # A kernel this GPU's compiler got wrong must not win on speed: it is not a candidate.
                log.error("%s: %s disagrees with %s on this device (%s); it is not a candidate", key, c.describe(),
                          reference_config.describe(), problem)
                times.append(float("inf"))
                continue
            times.append(launch_time(lambda c=c: launch(c)))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot compile here (resources) is skipped
            times.append(float("inf"))
            failed.append(exc)
            log.warning("%s: %s did not run (%s: %s); timing the others", key, c.describe(), type(exc).__name__,
                        str(exc).splitlines()[0][:200] if str(exc) else "")
    if len(failed) == len(candidates):
        raise failed[0]
    best = min(range(len(candidates)), key=times.__getitem__)
    log.debug("%s: %s (%s)", key, candidates[best].describe(),
              ", ".join(f"{c.describe()} {1e3 * t:.1f} us" for c, t in zip(candidates, times, strict=True)))
    return _CHOSEN.setdefault(key, candidates[best])


def _disagreement(out: object, reference: object) -> str | None:
    """Why two candidates' outputs for the same inputs are not the same product (None: they are).
    Both sum exact or dtype-rounded terms in float32, in different orders, then round once to the
    output dtype: they may differ by an output rounding step each (2 eps of the largest value) plus
    float32 sums far below 2^-10 of it. A misread weight or activation is off by the order of the
    values themselves."""
    if not (isinstance(out, torch.Tensor) and isinstance(reference, torch.Tensor)):
        return None  # (a test's stand-in launch)
    if out.shape != reference.shape:
        return f"shape {tuple(out.shape)} against {tuple(reference.shape)}"
    got, ref = out.float(), reference.float()
    largest = float(ref.abs().max()) if ref.numel() else 0.0
    bound = (2 * torch.finfo(out.dtype).eps + 2.0 ** -10) * largest
    diff = float((got - ref).abs().max()) if ref.numel() else 0.0
    if not diff <= bound:  # (NaN: not)
        return f"max difference {diff:.3g}, allowed {bound:.3g} of largest |value| {largest:.3g}"
    return None


# ---------------------------------------------------------------------------------------------
# FP8


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, block: tuple[int, int] | None = None,
             config: Config | None = None) -> torch.Tensor:
    """The Triton FP8 kernel on already quantised activations: ``xq`` fp8 [M, K] with ``xs`` float32
    [M, 1] (``block`` None: per-channel ``scale`` [N]) or [M, cdiv(K, bk)] (``block`` (bn, bk):
    ``scale`` [cdiv(N, bn), cdiv(K, bk)]). Returns [M, N] in ``out_dtype``."""
    rows, k = xq.shape
    n = weight.shape[0]
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    scale = scale.contiguous()
    if config is None:
        key = ("fp8-mma", _m_bucket(rows), n, k, str(out_dtype)) if block is None else \
            ("fp8-block", _m_bucket(rows), n, k, str(out_dtype), int(block[0]), int(block[1]))
        config = _choose(key, candidates_for(key),
                         lambda c: fp8_gemm(xq, xs, weight, scale, bias, out_dtype, block, c))
    if isinstance(config, quant_gemv.GemvConfig):  # (block-scaled weights, 1-4 rows)
        return quant_gemv.fp8_gemv_quantised(xq, xs, weight, scale, bias, out_dtype, config, block)
    if block is not None and block[1] % config.block_k:
        raise ValueError(f"block_k {config.block_k} must divide the weight block's K width {block[1]}")
    out = torch.empty((rows, n), dtype=out_dtype, device=xq.device)
    if rows == 0:
        return out
    splits, per = _splits(rows, n, k, config, config.block_k, _device_sms(xq.device))
    partial = splits > 1
    target = torch.empty((splits, rows, n), dtype=torch.float32, device=xq.device) if partial else out
    grid = (-(-rows // config.block_m) * -(-n // config.block_n), splits)
    group_n, group_k = block if block is not None else (1, 1)
    _kernels()[0][grid](
        xq, xs, weight, scale, target, bias if bias is not None else out, rows, n, k, per,
        xq.stride(0), xs.stride(0), weight.stride(0), scale.stride(0) if block is not None else 0,
        target.stride(0) if partial else 0, target.stride(-2), group_n, group_k,
        BLOCK_SCALED=block is not None, HAS_BIAS=bias is not None, PARTIAL=partial,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=8,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if partial:
        sum_splits(target, bias, out, splits)
    return out


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The float32 weight [N, K] of an FP8 weight with per-channel (``block`` None) or block scales."""
    w = weight.float()
    if block is None:
        return w * scale.float().reshape(-1, 1)
    n, k = w.shape
    bn, bk = block
    return w * scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """cuBLASLt's row-wise scaled product: bf16 output, K and N multiples of 16, the weight
    K-contiguous (its transpose column-major), one float32 scale per output channel."""
    n, k = weight.shape
    return (out_dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0 and weight.is_contiguous()
            and scale.dtype == torch.float32 and scale.numel() == n and fp8_capable(x.device))


def _scaled_mm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    fused = bias is not None and bias.dtype == out_dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.reshape(1, -1), bias=bias if fused else None,
                         out_dtype=out_dtype)
    if bias is not None and not fused:
        y = y + bias.to(out_dtype)
    return y




def _fp8_impl(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> str:
    if not (x2.is_cuda and fp8_capable(x2.device)):
        return "torch"
    if not _scaled_mm_takes(x2, weight, scale, out_dtype):
        return "triton" if can_run_triton(x2) else "torch"
    # A few rows (decode): the Triton kernel. On the H200 it beat cuBLASLt's row-wise scaled product
    # at 1 and 8 rows on every 7B and 72B shape (bench/quant_matmul.py, 2026-12-03: 2.84 against
    # 4.32 ms per 7B decode step), and a fixed choice is the same inside a CUDA graph's capture,
    # where nothing can be timed.
    return "triton" if x2.shape[0] <= SMALL_M and can_run_triton(x2) else "scaled_mm"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, *, impl: str | None = None) -> torch.Tensor:
    """y = quant(x) @ W^T (+ bias) for an FP8 weight with per-channel scales: ``weight`` fp8 [N, K],
    ``scale`` float32 [N]; x [..., K] bf16/fp16/fp32, quantised per token (dynamic e4m3).
    Returns [..., N] in ``out_dtype`` (x's dtype by default). ``impl`` forces "scaled_mm", "triton"
    or "torch" (the float32 product of the quantised activations and the dequantised weight)."""
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    impl = impl or _fp8_impl(x2, weight, scale, bias, out_dtype)
    if impl not in FP8_IMPLS:
        raise ValueError(f"impl must be one of {FP8_IMPLS}, got {impl!r}")
    if impl == "triton":
        return fp8_triton(x2, weight, scale.reshape(-1).contiguous(), bias, out_dtype).reshape(*lead, weight.shape[0])
    xq, xs = quantize_per_token(x2)
    return fp8_quantised_product(xq, xs, weight, scale, bias, out_dtype, impl=impl).reshape(*lead, weight.shape[0])


def fp8_quantised_product(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype, *, impl: str | None = None,
                          config: Config | None = None) -> torch.Tensor:
    """``fp8_linear``'s product on activations already quantised per token (``xq`` fp8 [M, K], ``xs``
    float32 [M, 1]: by their producer, ``fp8_activation``), in the same ``impl`` ``fp8_linear``
    would take; for "triton" the choice of key ("fp8-quantised", ...) between the tensor-core and
    the matrix-vector kernels, without the quantiser. Returns [M, N] in ``out_dtype``."""
    impl = impl or _fp8_impl(xq, weight, scale, bias, out_dtype)
    if impl == "scaled_mm":
        return _scaled_mm(xq, xs, weight, scale, bias, out_dtype)
    if impl == "triton":
        scale = scale.reshape(-1).contiguous()
        if config is None:
            key = ("fp8-quantised", _m_bucket(xq.shape[0]), weight.shape[0], xq.shape[1], str(out_dtype))
            config = _choose(key, candidates_for(key), lambda c: fp8_quantised_product(
                xq, xs, weight, scale, bias, out_dtype, impl="triton", config=c))
        return fp8_gemm(xq, xs, weight, scale, bias, out_dtype, config=config)
    y = (xq.float() @ weight.float().t()) * xs * scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_triton(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, config: Config | None = None) -> torch.Tensor:
    """The Triton FP8 product of x2 [M, K] (unquantised): the choice of key ("fp8", ...) between the
    quantiser followed by the tensor-core kernel and, for at most ``GEMV_MAX_ROWS`` rows, the
    quantiser followed by the matrix-vector kernel, each timed whole."""
    if config is None:
        rows, k = x2.shape
        key = ("fp8", _m_bucket(rows), weight.shape[0], k, str(out_dtype))
        config = _choose(key, candidates_for(key), lambda c: fp8_triton(x2, weight, scale, bias, out_dtype, c))
    if isinstance(config, quant_gemv.GemvConfig):
        return quant_gemv.fp8_gemv(x2, weight, scale, bias, out_dtype, config)
    xq, xs = quantize_per_token(x2)
    return fp8_gemm(xq, xs, weight, scale, bias, out_dtype, config=config)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
                     config: Config | None = None) -> torch.Tensor:
    """y = quant(x) @ W^T (+ bias) for an FP8 weight with block scales: ``weight`` fp8 [N, K],
    ``scale`` float32 [cdiv(N, bn), cdiv(K, bk)] for ``block`` = (bn, bk); x [..., K] is quantised
    per token and group of bk columns. The Triton kernel where one can run (bk must then have a
    power-of-two factor >= 16), else the same in torch. Returns [..., N] in ``out_dtype`` (x's dtype)."""
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xq, xs = quantize_per_token_group(x2, int(block[1]))
    y = fp8_block_quantised_product(xq, xs, weight, scale, block, bias, out_dtype, config=config)
    return y.reshape(*lead, weight.shape[0])


def fp8_block_quantised_product(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                                block: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype, *,
                                config: Config | None = None) -> torch.Tensor:
    """``fp8_block_linear``'s product on activations already quantised per token and group of bk
    columns (``xq`` fp8 [M, K], ``xs`` float32 [M, cdiv(K, bk)]). Returns [M, N] in ``out_dtype``."""
    bn, bk = int(block[0]), int(block[1])
    if _triton_fp8_runs(xq) and _pow2_divisor(128, bk) >= 16:
        return fp8_gemm(xq, xs, weight, scale, bias, out_dtype, (bn, bk), config)
    a = xq.float() * xs.repeat_interleave(bk, 1)[:, :xq.shape[1]]
    y = a @ dequantize_fp8(weight, scale, (bn, bk)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# int4


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """The float32 weight [N, K] of a packed int4 weight (the layout above)."""
    rows, n = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(rows * 8, n).float()  # [K, N]
    z = zeros.float().repeat_interleave(group, 0) if zeros is not None else 8.0
    return ((q - z) * scales.float().repeat_interleave(group, 0)).t()


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
              bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """The Triton int4 kernel: x [M, K] -> [M, N] in x's dtype (see ``int4_linear``)."""
    rows, k = x.shape
    n = packed.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if packed.stride(1) != 1 or scales.stride(1) != 1 or (zeros is not None and zeros.stride(1) != 1):
        raise ValueError("packed, scales and zeros must be contiguous along N")
    if config is None:
        key = ("int4-mma", _m_bucket(rows), n, k, group, str(x.dtype), zeros is not None)
        config = _choose(key, candidates_for(key), lambda c: int4_gemm(x, packed, scales, zeros, group, bias, c))
    if group % config.block_k or config.block_k < 16 or config.block_k % 8:
        raise ValueError(f"block_k {config.block_k} must be >= 16 and divide the group {group}")
    if config.per_nibble and config.block_k < 128:
        raise ValueError(f"per-nibble products need block_k >= 128, got {config.block_k}")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    splits, per = _splits(rows, n, k, config, group, _device_sms(x.device))
    partial = splits > 1
    target = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device) if partial else out
    grid = (-(-rows // config.block_m) * -(-n // config.block_n), splits)
    _kernels()[1][grid](
        x, packed, scales, zeros if zeros is not None else scales, target, bias if bias is not None else out,
        rows, n, k, per, x.stride(0), packed.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, target.stride(0) if partial else 0, target.stride(-2),
        GROUP=group, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, PARTIAL=partial,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=8,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=interpreting() and x.dtype == torch.bfloat16,
        MAGIC_BITS=_MAGIC[x.dtype][0] if config.magic else 0, MAGIC=_MAGIC[x.dtype][1],
        PER_NIBBLE=config.per_nibble, FOLD=config.fold and config.magic and x.dtype != torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if partial:
        sum_splits(target, bias, out, splits)
    return out


def int4_fused(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
               bias: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """The int4 product in one Triton kernel (and a second summing K splits): the choice of key
    ("int4", ...) between the tensor-core kernel and, for at most ``GEMV_MAX_ROWS`` rows, the
    matrix-vector one."""
    if config is None:
        rows, k = x.shape
        key = ("int4", _m_bucket(rows), packed.shape[1], k, group, str(x.dtype), zeros is not None)
        config = _choose(key, candidates_for(key), lambda c: int4_fused(x, packed, scales, zeros, group, bias, c))
    if isinstance(config, quant_gemv.GemvConfig):
        return quant_gemv.int4_gemv(x, packed, scales, zeros, group, bias, config)
    return int4_gemm(x, packed, scales, zeros, group, bias, config)


# dtype -> (bits, value) of the float whose last mantissa bit is 1: bits | q is the float value + q
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0), torch.float32: (0x4B000000, 8388608.0)}
DEQUANT_BLOCK_N = 128


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
                    out: torch.Tensor) -> torch.Tensor:
    """The Triton dequantiser: W^T [K, N] (N contiguous, as ``packed``) written into ``out``, a
    [K, N] tensor of the scales' dtype (or a flat buffer of that dtype with at least K * N elements:
    its first K * N are used). Returns the [K, N] view. Reads 0.5 and writes 2 (bf16) bytes per
    weight, one [128 (or the group's power-of-two factor), 128] tile per program."""
    k, n = packed.shape[0] * 8, packed.shape[1]
    if out.dtype != scales.dtype or out.device != packed.device:
        raise ValueError(f"the dequantised weight's buffer is {out.dtype} on {out.device}; the weight needs "
                         f"{scales.dtype} on {packed.device}")
    if out.shape != (k, n):
        if not out.is_contiguous() or out.numel() < k * n:
            raise ValueError(f"the dequantised weight's buffer holds {out.numel()} elements (contiguous: "
                             f"{out.is_contiguous()}); a [{k}, {n}] weight needs {k * n}")
        out = out.reshape(-1)[:k * n].view(k, n)
    if packed.stride(1) != 1 or scales.stride(1) != 1 or (zeros is not None and zeros.stride(1) != 1):
        raise ValueError("packed, scales and zeros must be contiguous along N")
    block_k = _pow2_divisor(128, group)
    if block_k < 16:
        raise ValueError(f"the group {group} needs a power-of-two factor >= 16")
    grid = (k // block_k, -(-n // DEQUANT_BLOCK_N))
    _kernels()[2][grid](packed, scales, zeros if zeros is not None else scales, out, n, packed.stride(0),
                        scales.stride(0), zeros.stride(0) if zeros is not None else 0, out.stride(0),
                        GROUP=group, HAS_ZEROS=zeros is not None, BLOCK_K=block_k, BLOCK_N=DEQUANT_BLOCK_N,
                        ROUND_BF16=interpreting() and out.dtype == torch.bfloat16, num_warps=4)  # 16 weights a thread
    return out


def _int4_impl(x2: torch.Tensor, group: int, scratch: torch.Tensor | None) -> str:
    if not (can_run_triton(x2) and _pow2_divisor(128, group) >= 16):
        return "torch"
    if x2.shape[0] < INT4_DEQUANT_MIN_ROWS:
        return "fused"
    # Inside a CUDA graph's capture only into the caller's scratch buffer (allocated outside the
    # graph, used serially on the one stream): a temporary weight would be held by the graph's pool.
    if scratch is None and x2.is_cuda and torch.cuda.is_current_stream_capturing():
        return "fused"
    return "dequant"


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int, bias: torch.Tensor | None = None, *, config: Config | None = None,
                impl: str | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a packed int4 weight: x [..., K] (bf16/fp16/fp32), ``packed`` int32
    [K // 8, N], ``scales`` and ``zeros`` (or None: symmetric, zero 8) [K // group, N] in x's dtype;
    K % group == 0, group % 8 == 0, any N. Returns [..., N] in x's dtype.

    ``impl`` (default: by the row count) is "fused" (the dequantising Triton kernel; fewer than
    ``INT4_DEQUANT_MIN_ROWS`` rows), "dequant" (the weight dequantised by ``int4_dequantize`` into
    ``scratch``, a flat buffer of x's dtype shared by all layers, or a temporary where there is none,
    then torch's matmul) or "torch" (the weight dequantised in float32 by torch: where no Triton
    kernel can run, or the group has no power-of-two factor >= 16)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = packed.shape[1]
    if k % group or group % 8 or packed.shape[0] * 8 != k or scales.shape != (k // group, n):
        raise ValueError(f"int4 weight: packed {tuple(packed.shape)}, scales {tuple(scales.shape)} and group {group} "
                         f"do not fit K = {k}")
    x2 = x.reshape(-1, k)
    impl = impl or _int4_impl(x2, group, scratch)
    if impl not in INT4_IMPLS:
        raise ValueError(f"impl must be one of {INT4_IMPLS}, got {impl!r}")
    if impl == "fused":
        y = int4_fused(x2, packed, scales, zeros, group, bias, config)
    elif impl == "dequant":
        buffer = scratch if scratch is not None else torch.empty((k, n), dtype=x.dtype, device=x.device)
        w = int4_dequantize(packed, scales, zeros, group, buffer)
        if bias is not None and bias.dtype == x.dtype:
            y = torch.addmm(bias, x2, w)
        else:
            y = x2 @ w
            if bias is not None:
                y = (y.float() + bias.float()).to(x.dtype)
    else:
        y = x2.float() @ dequantize_int4(packed, scales, zeros, group).t()
        if bias is not None:
            y = y + bias.float()
        y = y.to(x.dtype)
    return y.reshape(*lead, n)
