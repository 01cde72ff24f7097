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
``triton_util.available()`` says whether the kernel can run. Check it against the torch reference:

    python -m fovea.engine.paged.triton_decode --check
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass, replace

import torch

from fovea.engine.paged.triton_util import check_dtypes, kernel_main, next_pow2

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


# ---- self-test ----------------------------------------------------------------------------
def random_case(batch: int, heads: int, kv_heads: int, dim: int, block_size: int, max_ctx: int,
                dtype: torch.dtype, device: torch.device, seed: int = 0, width: int | None = None):
    """Random caches, shuffled block tables and context lengths 1..max_ctx (max_ctx included).

    ``width`` (at least the blocks max_ctx needs) widens the table as a CUDA graph's is: the
    columns past the context point at random blocks, as stale entries would."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    used = -(-max_ctx // block_size)
    width = max(width or used, used)
    num_blocks = batch * used + 3
    k_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen).to(device, dtype)
    v_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen).to(device, dtype)
    q = torch.randn((batch, heads, dim), generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * used].view(batch, used)
    if width > used:
        stale = torch.randint(0, num_blocks, (batch, width - used), generator=gen)
        tables = torch.cat([tables, stale], dim=1)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen)
    lens[0] = max_ctx
    return q, k_cache, v_cache, tables.to(device, torch.int32), lens.to(device, torch.int32)


def _poison_past_context(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                         lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with one extra block of NaN and tables whose columns past each context point at
    it: a kernel that reads a block it should not returns NaN. Also returns the tables the
    reference should use (the same, with those columns at block 0)."""
    nan = torch.full_like(k_cache[:1], float("nan"))
    kc, vc = torch.cat([k_cache, nan]), torch.cat([v_cache, nan])
    block_size = k_cache.shape[1]
    cols = torch.arange(tables.shape[1], device=tables.device)[None, :]
    past = cols >= ((lens.long() + block_size - 1) // block_size)[:, None]
    poisoned = tables.masked_fill(past, k_cache.shape[0])
    return kc, vc, poisoned, tables.masked_fill(past, 0)


def check(device: torch.device | None = None) -> float:
    """Compare against the torch reference (in float32) over a grid of shapes; returns the
    worst error and prints one line per case."""
    from fovea.engine.paged.attention import paged_decode_torch

    device = device or torch.device("cuda")
    worst = 0.0
    # batch, heads, kv_heads, head_dim, block_size, max_ctx, table width (None: just enough),
    # partition_tokens (None: automatic)
    cases = [
        (1, 4, 4, 64, 16, 1, None, None), (3, 8, 2, 64, 16, 40, None, None),
        (5, 32, 8, 128, 16, 1100, None, None), (2, 32, 32, 128, 16, 2000, None, None),
        (7, 12, 4, 80, 8, 300, None, None), (64, 32, 8, 128, 16, 700, None, None),
        # automatic split at several batch sizes (P from 16 down to 1)
        (1, 32, 32, 128, 16, 705, None, None), (4, 16, 8, 64, 16, 705, None, None),
        (24, 8, 8, 64, 16, 300, None, None), (48, 4, 4, 64, 8, 150, None, None),
        # wide tables (a CUDA graph's): stale columns far past every context, poisoned
        (1, 32, 32, 128, 16, 705, 256, None), (3, 8, 2, 128, 16, 130, 64, None),
        (40, 4, 4, 64, 16, 90, 64, None), (2, 6, 2, 80, 8, 9, 40, None),
        (140, 16, 16, 64, 8, 150, 64, None),  # automatic single pass (P=1) over several tiles
        # explicit partition sizes, also not a multiple of the tile or of the block
        (3, 8, 2, 64, 16, 700, None, 512), (3, 8, 2, 64, 16, 300, 48, 16),
        (2, 8, 4, 64, 8, 250, 40, 100), (3, 8, 2, 64, 16, 700, None, 4096),
    ]
    sms = _device_sms(device)
    for dtype in check_dtypes(device):
        for i, (b, h, kvh, d, bs, ctx, width, pt) in enumerate(cases):
            q, kc, vc, bt, cl = random_case(b, h, kvh, d, bs, ctx, dtype, device, seed=i, width=width)
            ref_bt = bt
            if width is not None:
                kc, vc, bt, ref_bt = _poison_past_context(kc, vc, bt, cl)
            scale = d ** -0.5
            cfg = choose_config(b, kvh, bt.shape[1], bs, sms, pt)
            got = paged_decode(q, kc, vc, bt, cl, scale, pt).float()
            ref = paged_decode_torch(q.float(), kc.float(), vc.float(), ref_bt, cl, scale)
            err = (got - ref).abs().max().item()
            if math.isnan(err):
                err = float("inf")
            tol = 2e-2 if dtype != torch.float32 else 2e-4
            worst = max(worst, err / tol)
            print(f"{dtype!s:15s} B={b:3d} H={h:2d} KVH={kvh:2d} D={d:3d} bs={bs:2d} ctx<={ctx:5d} "
                  f"W={bt.shape[1]:3d} {cfg.describe():34s} max abs err {err:.2e} (tol {tol:.0e}) "
                  f"{'ok' if err <= tol else 'FAIL'}")
    return worst


def _bench_case(batch: int, ctx: int, width: int, device: torch.device, copies: int = 1):
    """LLaVA-7B decode shapes on device (32 heads of 128, bf16, block 16), every context
    ``ctx`` long, shuffled blocks, tables ``width`` blocks wide: ``copies`` tables over
    disjoint blocks, so that calls cycling through them are not served from L2."""
    heads, dim, bs = 32, 128, 16
    used = -(-ctx // bs)
    num_blocks = copies * batch * used + 1
    k_cache = torch.randn((num_blocks, bs, heads, dim), device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn((batch, heads, dim), device=device, dtype=torch.bfloat16)
    tables = torch.zeros((copies, batch, width), dtype=torch.int32, device=device)
    perm = torch.randperm(copies * batch * used, device=device).view(copies, batch, used)
    tables[:, :, :used] = perm.to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, list(tables.unbind(0)), lens


BENCH_ROWS = [(1, 705, 45), (32, 705, 45), (256, 705, 45), (1, 705, 256), (32, 705, 256), (256, 705, 256)]


def _kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * 32 * 128 * 2


def _bench_fn(batch: int, ctx: int, width: int, device: torch.device):
    """A call of paged_decode on one bench row; consecutive calls read different K/V (at
    least ~200 MB between repeats, well past the 50 MB L2) as consecutive layers would."""
    copies = max(1, min(16, -(-200_000_000 // _kv_bytes(batch, ctx))))
    q, kc, vc, tables, cl = _bench_case(batch, ctx, width, device, copies)
    cycle = itertools.cycle(tables)

    def fn(config: DecodeConfig | None = None) -> torch.Tensor:
        return paged_decode(q, kc, vc, next(cycle), cl, 128 ** -0.5, config=config)

    return fn


def bench(device: torch.device) -> None:
    """One layer of LLaVA-7B-shaped decode attention (32 heads of 128, bf16, 705-token
    contexts), with tables just wide enough (45 blocks) and as wide as a 4096-token graph's
    (256 blocks): time launched eagerly ('us', includes any CPU launch overhead) and replayed
    from a CUDA graph ('graph us', as in the engine), and K/V bytes read per second."""
    import triton

    sms = _device_sms(device)
    print(f"{sms} SMs; TB/s from the graph time where there is one")
    print(f"{'batch':>6s}{'ctx':>6s}{'width':>6s}{'us':>9s}{'graph us':>9s}{'TB/s':>7s}  config")
    for batch, ctx, width in BENCH_ROWS:
        fn = _bench_fn(batch, ctx, width, device)
        cfg = choose_config(batch, 32, width, 16, sms)
        eager = 1e3 * triton.testing.do_bench(fn, warmup=10, rep=100)
        try:
            graphed = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50)
        except Exception:  # noqa: BLE001 - the eager time still stands
            graphed = None
        best = graphed if graphed is not None else eager
        g = f"{graphed:9.1f}" if graphed is not None else f"{'-':>9s}"
        tbs = _kv_bytes(batch, ctx) / (best / 1e6) / 1e12
        print(f"{batch:6d}{ctx:6d}{width:6d}{eager:9.1f}{g}{tbs:7.2f}  {cfg.describe()}")
        del fn
        torch.cuda.empty_cache()


def sweep(device: torch.device) -> None:
    """For each bench row, time the automatic config and variations of it (tile, warps,
    stages, partitions) from CUDA-graph replays; prints the five fastest per row."""
    import triton

    sms = _device_sms(device)
    for batch, ctx, width in BENCH_ROWS:
        fn = _bench_fn(batch, ctx, width, device)
        auto = choose_config(batch, 32, width, 16, sms)
        part_options = sorted({auto.num_parts} | {p for p in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
                                                   if p <= max(4, 2 * auto.num_parts)})
        results = []
        grid = itertools.product((16, 32, 64, 128), (4, 8), (2, 3, 4), part_options)
        for tile, warps, stages, parts in grid:
            cfg = replace(auto, tile=tile, num_warps=warps, num_stages=stages, num_parts=parts)
            try:
                fn(cfg)
                us = 1e3 * triton.testing.do_bench_cudagraph(functools.partial(fn, cfg), rep=10)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                print(f"  {cfg.describe()}: {type(exc).__name__}")
                continue
            results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        auto_us = next((us for us, c in results if c == auto), float("nan"))
        read = _kv_bytes(batch, ctx)
        print(f"batch {batch} ctx {ctx} width {width}: auto {auto.describe()} {auto_us:.1f} us "
              f"({read / (auto_us / 1e6) / 1e12:.2f} TB/s); fastest:")
        for us, cfg in results[:5]:
            print(f"    {us:8.1f} us {read / (us / 1e6) / 1e12:5.2f} TB/s  {cfg.describe()}")
        sys.stdout.flush()
        del fn
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    return kernel_main(argv, __doc__.split("\n")[0], check, {
        "bench": ("time LLaVA-7B-shaped decode attention", bench),
        "sweep": ("time variations of the launch config (slow)", sweep)})


if __name__ == "__main__":
    sys.exit(main())
