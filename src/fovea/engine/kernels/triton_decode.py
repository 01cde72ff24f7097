"""Paged-attention decode as a Triton kernel (CUDA), split over context partitions.

Grid (batch, kv_head, partition): each program loads the query heads that share one KV
head and walks its partition of the context in tiles of TILE tokens (several cache blocks
per iteration, gathered through the block table token by token) with an online softmax.

How many partitions a sequence is split into depends only on tensor shapes (batch,
kv_heads, the block table's width), so a CUDA graph can capture the launch; how long each
partition is depends on the sequence's actual context length, read on the device: with P
partitions, a context of T tiles gives each partition cdiv(T, P) tiles. Partitions past
the context exit at once. With one partition the kernel writes the output itself; with
more it writes partial (max, sum, accumulator) and a second kernel merges them.

The automatic choice (``choose_config``) asks for about PROGRAMS_PER_SM programs per SM:
small batches split each sequence into up to MAX_PARTS partitions (latency), large
batches run one pass per (sequence, kv head) with no merge (bandwidth).

triton is imported lazily: this module imports on machines without it, and
``triton_util.available()`` says whether the kernel can run. Check it against the torch
reference, and time it, with ``python3 bench/kernels_check.py --kernel decode --check [--bench]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fovea.engine.kernels.triton_util import next_pow2

PARTITION_TOKENS = 512  # kept for callers that pass it explicitly; the default is automatic
TILE_TOKENS = 64  # context tokens per loop iteration (4 blocks of 16)
PROGRAMS_PER_SM = 16  # split sequences until batch * kv_heads * parts reaches this many per SM
MAX_PARTS = 16  # at most this many partitions per sequence
DEFAULT_SMS = 132  # H100/H200; used where no CUDA device can be asked
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    num_parts: int  # partitions per (sequence, kv head): the grid's third axis
    part_tokens: int  # 0: cdiv(context tiles, num_parts) tiles each, decided on the device
    tile: int  # tokens per loop iteration (a power of two >= 16)
    num_warps: int = 4
    num_stages: int = 3

    def describe(self) -> str:
        size = "auto" if self.part_tokens == 0 else str(self.part_tokens)
        return f"P={self.num_parts} part={size} tile={self.tile} w{self.num_warps}s{self.num_stages}"


@functools.cache
def _sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=256)
def choose_config(batch: int, kv_heads: int, width: int, block_size: int, sms: int = DEFAULT_SMS,
                  partition_tokens: int | None = None) -> DecodeConfig:
    """The launch for a block table of ``width`` blocks: depends on shapes only.

    Automatic (``partition_tokens`` None): P = cdiv(PROGRAMS_PER_SM * sms, batch * kv_heads),
    at most MAX_PARTS and at most the tiles the table can hold; P = 1 is a single pass. For
    LLaVA-7B (32 KV heads) on 132 SMs: batch 1 -> P = 12 (table of 45 blocks) or 16 (256
    blocks), batch 32 -> P = 3, batch >= 66 -> P = 1.
    Explicit: fixed partitions of ``partition_tokens`` tokens, as many as the table needs.

    Split programs walk few tiles each, so they get a shallower software pipeline (less
    shared memory, more programs resident); a single pass walks the whole context.
    """
    table_tokens = max(1, width) * block_size
    if partition_tokens is not None:
        part = max(1, int(partition_tokens))
        tile = min(TILE_TOKENS, max(16, next_pow2(part)))
        parts = max(1, -(-table_tokens // part))
        return DecodeConfig(num_parts=parts, part_tokens=0 if parts == 1 else part, tile=tile,
                            num_stages=3 if parts == 1 else 2)
    tile = TILE_TOKENS
    max_tiles = max(1, -(-table_tokens // tile))
    want = -(-PROGRAMS_PER_SM * sms // max(1, batch * kv_heads))
    parts = max(1, min(want, MAX_PARTS, max_tiles))
    return DecodeConfig(num_parts=parts, part_tokens=0, tile=tile, num_stages=3 if parts == 1 else 2)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # Integer arguments that change from step to step (table width, partition-dependent
    # strides) are not specialized on: each new value would otherwise compile a new variant
    # (about a second each) in the middle of serving.
    @triton.jit(do_not_specialize=["part_tokens_arg", "stride_btb", "stride_ab", "stride_ah", "stride_ap",
                                   "stride_mb", "stride_mh", "stride_mp"])
    def partial_kernel(Q, K, V, BT, CL, O, ACC, ML, qk_scale, part_tokens_arg,
                       stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                       stride_vb, stride_vt, stride_vh, stride_btb, stride_ob, stride_oh,
                       stride_ab, stride_ah, stride_ap, stride_mb, stride_mh, stride_mp,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                       SINGLE: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        num_parts = tl.num_programs(2)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = tl.arange(0, TILE)
        g_ok = offs_g < GROUP
        heads = kvh * GROUP + offs_g
        if BLOCK_D == HEAD_DIM:  # no mask along head_dim: keeps the loads vectorised
            gd_ok = g_ok[:, None]
        else:
            gd_ok = g_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        # Issued before the bounds are known, so its latency overlaps the context length's.
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_ok, other=0.0)

        ctx = tl.load(CL + b)
        if part_tokens_arg == 0:  # automatic: the context's tiles shared out over the partitions
            part_tokens = tl.cdiv(tl.cdiv(ctx, TILE), num_parts) * TILE
        else:
            part_tokens = part_tokens_arg + 0 * ctx
        start = part * part_tokens
        # A partition past the context does nothing: no loads, no stores (the merge skips it).
        if start < ctx:
            end = tl.minimum(start + part_tokens, ctx)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            bt_row = BT + b * stride_btb
            k_head = K + kvh * stride_kh + offs_d[None, :]
            v_head = V + kvh * stride_vh + offs_d[None, :]
            for t0 in range(start, end, TILE):
                tok = t0 + offs_t
                t_ok = tok < end
                block = tl.load(bt_row + tok // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
                slot = (tok % BLOCK_SIZE).to(tl.int64)
                if BLOCK_D == HEAD_DIM:
                    kv_ok = t_ok[:, None]
                else:
                    kv_ok = t_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
                k = tl.load(k_head + (block * stride_kb + slot * stride_kt)[:, None], mask=kv_ok, other=0.0)
                v = tl.load(v_head + (block * stride_vb + slot * stride_vt)[:, None], mask=kv_ok, other=0.0)
                # Tensor cores; the query heads are padded to >= 16 rows (decode is bound by
                # reading K/V, so the idle rows cost little). Scores are in log2 units.
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, TILE]
                s = tl.where(t_ok[None, :], s, float("-inf"))
                # Every visited tile holds at least one valid token, so m_new is finite.
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            if SINGLE:  # one partition covers the context: the output directly
                out = acc / l_i[:, None]
                tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         out.to(O.dtype.element_ty), mask=gd_ok)
            else:
                a_ptr = ACC + b * stride_ab + part * stride_ap
                tl.store(a_ptr + heads[:, None] * stride_ah + offs_d[None, :], acc, mask=gd_ok)
                ml = ML + b * stride_mb + heads * stride_mh + part * stride_mp
                tl.store(ml, m_i, mask=g_ok)
                tl.store(ml + 1, l_i, mask=g_ok)

    @triton.jit(do_not_specialize=["part_tokens_arg", "num_parts", "stride_ab", "stride_ah", "stride_ap",
                                   "stride_mb", "stride_mh", "stride_mp"])
    def merge_kernel(ACC, ML, CL, O, part_tokens_arg, num_parts, stride_ab, stride_ah, stride_ap,
                     stride_mb, stride_mh, stride_mp, stride_ob, stride_oh, TILE: tl.constexpr,
                     BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(CL + b)
        if part_tokens_arg == 0:
            part_tokens = tl.cdiv(tl.cdiv(ctx, TILE), num_parts) * TILE
        else:
            part_tokens = part_tokens_arg + 0 * ctx
        used = tl.minimum(tl.cdiv(ctx, part_tokens), num_parts)  # partitions that wrote
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        p_ok = offs_p < used
        d_ok = offs_d < HEAD_DIM
        ml = ML + b * stride_mb + h * stride_mh + offs_p * stride_mp
        m = tl.load(ml, mask=p_ok, other=float("-inf"))
        l = tl.load(ml + 1, mask=p_ok, other=0.0)
        m_max = tl.max(m, axis=0)  # partition 0 always holds a token: finite
        w = tl.exp2(m - m_max)
        denom = tl.sum(w * l, axis=0)
        acc = tl.load(ACC + b * stride_ab + h * stride_ah + offs_p[:, None] * stride_ap + offs_d[None, :],
                      mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / denom
        tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)

    return partial_kernel, merge_kernel


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, partition_tokens: int | None = None, *,
                 config: DecodeConfig | None = None) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [B, W] int32;
    context_lens [B] int32 (each in 1 .. W * block_size). Returns [B, H, D] in q's dtype.

    ``partition_tokens`` None chooses the split from the shapes (``choose_config``); a number
    fixes partitions of that many tokens. ``config`` overrides both (for tuning)."""
    partial_kernel, merge_kernel = _kernels()
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if config is None:
        config = choose_config(batch, kv_heads, block_tables.shape[1], block_size, _device_sms(q.device),
                               partition_tokens)
    group = heads // kv_heads
    parts = config.num_parts
    single = parts == 1
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    if single:
        acc = ml = out  # unused placeholders
        a_strides, m_strides = (0, 0, 0), (0, 0, 0)
    else:  # one allocation: accumulators [B, H, P, D], then (max, sum) pairs [B, H, P, 2]
        n = batch * heads * parts
        work = torch.empty(n * (dim + 2), dtype=torch.float32, device=q.device)
        acc = work[:n * dim].view(batch, heads, parts, dim)
        ml = work[n * dim:].view(batch, heads, parts, 2)
        a_strides, m_strides = acc.stride()[:3], ml.stride()[:3]
    block_d = max(16, next_pow2(dim))
    block_g = max(16, next_pow2(group))  # tl.dot needs every dimension >= 16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 inputs
    partial_kernel[(batch, kv_heads, parts)](
        q, k_cache, v_cache, block_tables, context_lens, out, acc, ml, scale * LOG2E, config.part_tokens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *a_strides, *m_strides,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        TILE=config.tile, SINGLE=single, PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if not single:
        merge_kernel[(batch, heads)](
            acc, ml, context_lens, out, config.part_tokens, parts, *a_strides, *m_strides,
            out.stride(0), out.stride(1), TILE=config.tile, BLOCK_P=next_pow2(parts),
            HEAD_DIM=dim, BLOCK_D=block_d, num_warps=2)
    return out
