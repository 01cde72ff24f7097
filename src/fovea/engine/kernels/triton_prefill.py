"""Prefill attention over the paged KV cache as one Triton flash-attention kernel (CUDA).

Every prefill chunk of a step goes in one launch: the queries of all chunks are one flat
``[T, H, D]`` tensor, ``cu_q_lens`` says which rows belong to which chunk and ``q_starts``
where each chunk sits in its sequence. The chunk's own K/V are already in the cache, so
every key (the earlier context and the chunk itself) is read from the cache through the
chunk's block table; nothing is gathered into a contiguous copy first.

Grid ``(cdiv(max_q_len, BLOCK_M), H, S)``: one program per query tile of BLOCK_M rows, query
head and chunk. It depends only on the step's shape, never on the data, so there is no
Python loop per sequence and no re-planning per length (cuDNN SDPA builds a new plan for
every new sequence length). Programs whose tile lies past their chunk's length return at
once. A program walks key tiles of BLOCK_N tokens with an online softmax in fp32 (exp2,
scale folded in), looking up each key token's block id in the block table. The key loop
has two phases:

- keys at or before the tile's first query position are visible to every row: no masks;
- the last few key tiles, up to the tile's last query position: causal mask, and key
  loads masked so that cache slots past the chunk (padding of the block table, slots not
  yet written, which may hold NaN) are never read.

Key tiles past the tile's causal bound are never visited, so a causal prefill costs about
half a full one. Query tiles are launched last tile first: those see the most keys, and
starting them first shortens the tail of the launch.

GQA: query head ``h`` reads KV head ``h // (H // KVH)``. Programs of neighbouring query heads
that share a KV head read the same K/V tiles, which mostly come from L2.

triton is imported lazily: this module imports without it, and ``triton_util.available()`` says whether
the kernel can run. Check against the torch reference
(``fovea.engine.kernels.cases.prefill_torch_reference``; ``TRITON_INTERPRET=1`` runs the kernel
in triton's CPU interpreter with ``--device cpu``) and time it:

    python3 bench/kernels_check.py --kernel prefill --check [--bench] [--sweep]
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fovea.engine.kernels.triton_util import next_pow2

LOG2E = 1.4426950408889634


class PrefillConfig(NamedTuple):
    block_m: int  # query rows per program
    block_n: int  # key tokens per inner-loop step
    num_warps: int
    num_stages: int  # software-pipelining depth of the key loop's loads


def tile_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tiles for H100/H200 (no autotuning: triton's interpreter cannot run it, and a config
    chosen by a function keeps the compiled variants few).

    16-bit: BLOCK_M 128 x BLOCK_N 64 as in flash-attention 2's Hopper-era Triton kernels; with
    D=128 that is Q 32 KiB + (K, V) 32 KiB per pipeline stage in shared memory, and an fp32
    accumulator of 128x128 over 8 warps (64 registers a thread). D=64 needs only 4 warps.
    D=256 halves both tiles to keep the accumulator and the stages within the register file and
    the 227 KiB of shared memory. fp32 "ieee" dots run on FMA units with every operand in
    registers: small tiles (sized by compiling for sm_90 until ptxas no longer spills), two
    stages. (Register counts for sm_90, ptxas: 16-bit D=64 252, D=128 184, D=256 168; fp32
    D=64 95, D=128 64, D=256 120.)
    """
    block_d = max(16, next_pow2(head_dim))
    if dtype == torch.float32:
        return PrefillConfig(32, 32, 4, 2) if block_d <= 64 else PrefillConfig(32, 16, 8, 2)
    if block_d <= 64:
        return PrefillConfig(128, 64, 4, 3)
    if block_d <= 128:
        return PrefillConfig(128, 64, 8, 3)
    return PrefillConfig(64, 32, 8, 2)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["stride_bts"])  # the table width changes every step: no recompiles
    def prefill_kernel(Q, K, V, O, CU, QS, BT, qk_scale,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
                       stride_bts,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
        tile = tl.num_programs(0) - 1 - tl.program_id(0)  # last (longest) tiles first
        h = tl.program_id(1)
        seq = tl.program_id(2)  # the chunk
        q_lo = tl.load(CU + seq)
        q_len = tl.load(CU + seq + 1) - q_lo
        if tile * BLOCK_M >= q_len:  # past this chunk's end (the grid is sized by the longest)
            return
        start = tl.load(QS + seq)

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < q_len
        d_ok = offs_d < HEAD_DIM
        rows = (q_lo + offs_m).to(tl.int64)
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
        pos = start + offs_m  # each row's position in its sequence

        # Keys [0, full_end): at or before the tile's first position, visible to every row.
        # Keys [full_end, kv_end): up to the tile's last position, causally masked.
        first_pos = start + tile * BLOCK_M
        kv_end = start + tl.minimum((tile + 1) * BLOCK_M, q_len)
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N

        bt_row = BT + seq.to(tl.int64) * stride_bts
        kvh = h // GROUP
        K = K + kvh * stride_kh
        V = V + kvh * stride_kh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Two loops from one body: static_range unrolls, so `phase` is a compile-time constant
        # and the unmasked loop (phase 0) carries no mask arithmetic.
        for phase in tl.static_range(2):
            if phase == 1:
                lo, hi = full_end, kv_end
            else:
                lo, hi = 0, full_end
            for n0 in range(lo, hi, BLOCK_N):
                keys = n0 + offs_n
                if phase == 1:  # keys past kv_end may lie past the table's written entries
                    n_ok = keys < kv_end
                    blk = tl.load(bt_row + keys // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
                    kv_ok = n_ok[:, None] & d_ok[None, :]
                else:
                    blk = tl.load(bt_row + keys // BLOCK_SIZE).to(tl.int64)
                    kv_ok = d_ok[None, :]
                # int64: a whole cache's element count exceeds 2**31 on a large GPU.
                offs = (blk * stride_kb + (keys % BLOCK_SIZE) * stride_kt)[:, None] + offs_d[None, :]
                k = tl.load(K + offs, mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
                qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
                if phase == 1:
                    qk = tl.where(keys[None, :] <= pos[:, None], qk, float("-inf"))
                # Each row's first visited tile holds a visible key (key 0, or a fully visible
                # tile), so m_new is finite and exp2(-inf - m_new) is 0, never NaN.
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                # Masked keys load V as 0: slots past the chunk may hold NaN, and 0 * NaN is NaN.
                v = tl.load(V + offs, mask=kv_ok, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=q_mask)

    return prefill_kernel


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q_lens: torch.Tensor,
                  q_starts: torch.Tensor, block_tables: torch.Tensor, scale: float, max_q_len: int,
                  out: torch.Tensor | None = None, *, config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal attention of prefill chunks over the paged cache (their own K/V already in it).

    q: [T, H, D] (any row/head strides, head_dim contiguous); caches [num_blocks, block_size, KVH, D]
    with equal strides, head_dim contiguous; cu_q_lens [S+1] int32 (chunk s owns rows
    cu_q_lens[s]:cu_q_lens[s+1]); q_starts [S] int32 (position of each chunk's first token);
    block_tables [S, W] int32, covering positions < q_starts[s] + chunk length (entries past that
    are never read); max_q_len >= every chunk's length (rows past it are silently left unwritten).
    Returns ``out`` (allocated when None) [T, H, D] in q's dtype.
    """
    prefill_kernel = _kernels()
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, kdim = k_cache.shape
    if kdim != dim or heads % kv_heads or q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the cache {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the K and V caches need equal strides and head_dim contiguous, as q")
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError("out must be shaped as q, head_dim contiguous")
    num_chunks = q_starts.shape[0]
    if tokens == 0 or num_chunks == 0 or max_q_len <= 0:
        return out
    cfg = config or tile_config(dim, q.dtype)
    grid = (-(-max_q_len // cfg.block_m), heads, num_chunks)
    prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_q_lens, q_starts, block_tables, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_D=max(16, next_pow2(dim)), BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 only matters for fp32 inputs
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
