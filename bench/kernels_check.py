"""Check fovea's Triton kernels against torch over a grid of shapes, and time them.

    python3 bench/kernels_check.py --kernel decode|prefill|ops|vision [--check] [--bench] [--sweep]
                                   [--device cuda]

- ``decode``: paged decode attention (``fovea.engine.kernels.triton_decode``); ``--bench`` times
  LLaVA-7B-shaped decode attention, ``--sweep`` variations of its launch config (slow);
- ``prefill``: paged prefill attention (``triton_prefill``); ``--bench`` against the per-chunk
  SDPA path, ``--sweep`` the same with alternative tile configs;
- ``ops``: add + RMSNorm, rotary + KV write, SiLU * up, matrix-vector (``triton_ops``);
  ``--bench`` times the matrix-vector kernel against cuBLAS;
- ``vision``: the fused vision stage's kernels and the whole stage against transformers'
  modules (``fovea.engine.vision.vision_fused``); ``--bench`` times eager vs fused on LLaVA-1.5-7B's
  tower (random weights).

``--check`` prints one line per case and PASS or FAIL; it exits 1 when any case is outside its
tolerance (or CUDA or triton is missing for ``--device cuda``), 0 otherwise. With no action the
usage is printed and the exit status is 2. ``TRITON_INTERPRET=1 ... --device cpu`` runs the
kernels in triton's CPU interpreter (slow; float32 only, and float16 for prefill, whose CPU grid
is a few small cases).

The case builders and torch references live in ``fovea.engine.kernels.cases`` (the fused vision
stage's random-weight models in ``fovea.testing.kernel_cases``); the engine's
start-up check (one small case per kernel) is ``fovea.engine.runner.kernel_selfcheck``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fovea.engine.kernels import triton_ops, triton_util
from fovea.engine.kernels.cases import (
    check_dtypes,
    poison_past_context,
    prefill_torch_reference,
    random_decode_case,
    random_prefill_case,
    random_spans,
    rms_norm_reference,
    rope_reference,
)
from fovea.engine.kernels.triton_decode import DecodeConfig, _device_sms, choose_config, paged_decode
from fovea.engine.kernels.triton_ops import add_rms_norm, gemv, rope_write_kv, silu_mul
from fovea.engine.kernels.triton_prefill import PrefillConfig, paged_prefill, tile_config
from fovea.engine.kernels.triton_util import time_cuda
from fovea.engine.model.attention import paged_decode_torch
from fovea.testing.kernel_cases import llava15_vision, random_llava, tiny_vision


def run_check(device: torch.device, check: Callable[[torch.device], float]) -> int:
    """``--check``: ``check`` returns the worst error / tolerance over its cases; at most 1
    passes. Returns the exit status."""
    if device.type == "cuda" and not triton_util.available():
        print(f"FAIL: triton or CUDA missing (torch {torch.__version__}, cuda available: "
              f"{torch.cuda.is_available()})")
        return 1
    worst = check(device)
    print("PASS" if worst <= 1.0 else "FAIL", f"(worst error / tolerance = {worst:.3f})")
    return 0 if worst <= 1.0 else 1


# ---- paged decode --------------------------------------------------------------------------------

def decode_check(device: torch.device | None = None) -> float:
    """Compare against the torch reference (in float32) over a grid of shapes; returns the
    worst error / tolerance and prints one line per case."""
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
            q, kc, vc, bt, cl = random_decode_case(b, h, kvh, d, bs, ctx, dtype, device, seed=i, width=width)
            ref_bt = bt
            if width is not None:
                kc, vc, bt, ref_bt = poison_past_context(kc, vc, bt, cl)
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


def _decode_bench_case(batch: int, ctx: int, width: int, device: torch.device, copies: int = 1):
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


DECODE_BENCH_ROWS = [(1, 705, 45), (32, 705, 45), (256, 705, 45), (1, 705, 256), (32, 705, 256),
                     (256, 705, 256)]


def _kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * 32 * 128 * 2


def _decode_bench_fn(batch: int, ctx: int, width: int, device: torch.device):
    """A call of paged_decode on one bench row; consecutive calls read different K/V (at
    least ~200 MB between repeats, well past the 50 MB L2) as consecutive layers would."""
    copies = max(1, min(16, -(-200_000_000 // _kv_bytes(batch, ctx))))
    q, kc, vc, tables, cl = _decode_bench_case(batch, ctx, width, device, copies)
    cycle = itertools.cycle(tables)

    def fn(config: DecodeConfig | None = None) -> torch.Tensor:
        return paged_decode(q, kc, vc, next(cycle), cl, 128 ** -0.5, config=config)

    return fn


def decode_bench(device: torch.device) -> None:
    """One layer of LLaVA-7B-shaped decode attention (32 heads of 128, bf16, 705-token
    contexts), with tables just wide enough (45 blocks) and as wide as a 4096-token graph's
    (256 blocks): time launched eagerly ('us', includes any CPU launch overhead) and replayed
    from a CUDA graph ('graph us', as in the engine), and K/V bytes read per second."""
    import triton

    sms = _device_sms(device)
    print(f"{sms} SMs; TB/s from the graph time where there is one")
    print(f"{'batch':>6s}{'ctx':>6s}{'width':>6s}{'us':>9s}{'graph us':>9s}{'TB/s':>7s}  config")
    for batch, ctx, width in DECODE_BENCH_ROWS:
        fn = _decode_bench_fn(batch, ctx, width, device)
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


def decode_sweep(device: torch.device) -> None:
    """For each bench row, time the automatic config and variations of it (tile, warps,
    stages, partitions) from CUDA-graph replays; prints the five fastest per row."""
    import triton

    sms = _device_sms(device)
    for batch, ctx, width in DECODE_BENCH_ROWS:
        fn = _decode_bench_fn(batch, ctx, width, device)
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


# ---- paged prefill -------------------------------------------------------------------------------

PREFILL_CPU_CASES = [  # heads, kv_heads, head_dim, block_size, spans (the interpreter is slow: small)
    (4, 4, 64, 16, [(0, 1)]),
    (8, 2, 64, 16, [(0, 37), (21, 1), (40, 70), (16, 16)]),
    (4, 1, 128, 8, [(0, 20), (33, 9), (8, 1)]),
    (6, 2, 48, 32, [(0, 40), (65, 30)]),
]
PREFILL_CUDA_CASES = PREFILL_CPU_CASES + [
    (32, 32, 128, 16, [(0, 641), (0, 641), (0, 766)]),
    (32, 32, 128, 16, [(1536, 512)]),
    (32, 8, 128, 16, random_spans(9, 1500, 3000, seed=1)),
    (16, 4, 64, 16, random_spans(24, 300, 2000, seed=2)),
    (12, 4, 80, 8, random_spans(5, 200, 400, seed=3)),
    (8, 8, 256, 32, random_spans(4, 300, 700, seed=4)),
    (28, 4, 128, 16, [(0, 3000)]),
]


def prefill_check(device: torch.device | None = None, dtypes: list[torch.dtype] | None = None) -> float:
    """Compare against the torch reference over a grid of cases; prints one line per case and
    returns the worst error / tolerance (<= 1 passes)."""
    device = device or torch.device("cuda")
    if dtypes is None:  # triton's interpreter computes bf16 dots wrongly (triton 3.6): fp16 stands in
        cpu = [torch.float32, torch.float16]
        dtypes = cpu if device.type == "cpu" else [torch.float16, torch.bfloat16, torch.float32]
    cases = PREFILL_CPU_CASES if device.type == "cpu" else PREFILL_CUDA_CASES
    worst = 0.0
    for dtype in dtypes:
        for i, (h, kvh, d, bs, spans) in enumerate(cases):
            q, kc, vc, cu, qs, bt, max_len = random_prefill_case(spans, h, kvh, d, bs, dtype, device, seed=i)
            scale = d ** -0.5
            got = paged_prefill(q, kc, vc, cu, qs, bt, scale, max_len).float()
            ref = prefill_torch_reference(q.float(), kc.float(), vc.float(), cu, qs, bt, scale, max_len)
            err = (got - ref).abs().max().item()  # NaN (a poisoned slot read) fails too
            tol = 2e-4 if dtype == torch.float32 else 2e-2
            ratio = float("inf") if math.isnan(err) else err / tol
            worst = max(worst, ratio)
            print(f"{dtype!s:15s} H={h:2d} KVH={kvh:2d} D={d:3d} bs={bs:2d} chunks={len(spans):2d} "
                  f"tokens={int(cu[-1]):5d} max start={max(s for s, _ in spans):5d} "
                  f"max abs err {err:.2e} (tol {tol:.0e}) {'ok' if ratio <= 1 else 'FAIL'}")
    return worst


PREFILL_BENCH_SHAPES = [  # name, spans; LLaVA-7B: 32 heads x 128, bf16
    ("1 x 641 from 0", [(0, 641)]),
    ("641+641+766 from 0", [(0, 641), (0, 641), (0, 766)]),
    ("512 from 1536", [(1536, 512)]),
]
PREFILL_SWEEP = [PrefillConfig(*c) for c in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 8, 3),
                                             (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4),
                                             (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 4),
                                             (64, 128, 8, 3)]]


def _visible_pairs(spans: list[tuple[int, int]]) -> int:
    return sum(n * start + n * (n + 1) // 2 for start, n in spans)


def _sdpa_path(q, kc, vc, cu, bt, spans, scale, out):
    """The torch path (``attention.prefill_attention``): a Python loop of SDPA per chunk, K/V
    gathered from the cache for chunks past position 0."""
    from fovea.engine.model.attention import PrefillSpan, prefill_attention

    block_size = kc.shape[1]
    cu_l, bt_l = cu.tolist(), bt.long()
    pieces = []
    for s, (start, n) in enumerate(spans):
        ids = bt_l[s, :-(-(start + n) // block_size)]
        kv_rows = slice(start, start + n)
        pieces.append((slice(cu_l[s], cu_l[s + 1]), kc[ids].flatten(0, 1)[kv_rows],
                       vc[ids].flatten(0, 1)[kv_rows], PrefillSpan(cu_l[s], n, start, ids)))

    def run():
        for rows, k_new, v_new, span in pieces:
            out[rows] = prefill_attention(q[rows], k_new, v_new, kc, vc, span, scale)
    return run


def prefill_bench(device: torch.device, sweep: bool = False) -> None:
    """Time LLaVA-7B-shaped prefill attention (one layer: 32 heads x 128, bf16, block size 16)
    against the per-sequence SDPA path (whose cuDNN / flash plans are warm here, unlike a
    server's ever-new lengths). TFLOP/s count 4 * D flops per causally visible (query, key)
    pair and head. ``sweep`` also times the alternative tile configs in PREFILL_SWEEP."""
    import triton
    from triton.runtime.errors import OutOfResources

    heads, dim, bs, dtype = 32, 128, 16, torch.bfloat16
    scale = dim ** -0.5
    default = tile_config(dim, dtype)
    print(f"default config for D={dim} {dtype}: {default}")
    print(f"{'shape':22s}{'config (M, N, warps, stages)':>30s}{'us':>9s}{'TFLOP/s':>9s}")
    for name, spans in PREFILL_BENCH_SHAPES:
        q, kc, vc, cu, qs, bt, max_len = random_prefill_case(spans, heads, heads, dim, bs, dtype, device,
                                                             poison=False)
        flops = 4 * _visible_pairs(spans) * dim * heads
        out = torch.empty_like(q)
        runs = [(str(tuple(cfg)), functools.partial(paged_prefill, q, kc, vc, cu, qs, bt, scale, max_len, out,
                                                    config=cfg))
                for cfg in ([default, *PREFILL_SWEEP] if sweep else [default])]
        runs.append(("SDPA per chunk", _sdpa_path(q, kc, vc, cu, bt, spans, scale, out)))
        for label, fn in runs:
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            except OutOfResources as exc:  # a sweep config past the shared memory
                print(f"{name:22s}{label:>30s}  {exc}")
                continue
            print(f"{name:22s}{label:>30s}{1e3 * ms:9.1f}{flops / (ms / 1e3) / 1e12:9.1f}")


# ---- fused Llama ops -----------------------------------------------------------------------------

def ops_check(device: torch.device, dtypes: list[torch.dtype] | None = None) -> float:
    """Worst error / tolerance over all kernels and dtypes; prints one line per case."""
    dtypes = dtypes or check_dtypes(device)
    worst = 0.0

    def report(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
        nonlocal worst
        err = (got.float() - ref.float()).abs().max().item()
        worst = max(worst, err / tol)
        print(f"{name:48s} max abs err {err:.2e} (tol {tol:.0e}) {'ok' if err <= tol else 'FAIL'}")

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        tol = 2e-4 if dtype == torch.float32 else 3e-2
        for rows, cols in ((1, 256), (5, 4096), (3, 1000)):
            x = torch.randn(rows, cols, generator=gen).to(device, dtype)
            r = torch.randn(rows, cols, generator=gen).to(device, dtype)
            w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(device, dtype)
            report(f"{dtype} rms_norm {rows}x{cols}", add_rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), tol)
            r2 = r.clone()
            normed = add_rms_norm(x, w, 1e-5, residual=r2)
            report(f"{dtype} add_rms_norm sum {rows}x{cols}", r2, r + x, tol)
            report(f"{dtype} add_rms_norm norm {rows}x{cols}", normed, rms_norm_reference(r + x, w, 1e-5), tol)
        for tokens, heads, kvh, dim in ((1, 4, 2, 64), (7, 32, 8, 128), (3, 32, 32, 128)):
            block_size, blocks = 16, 8
            qkv = torch.randn(tokens, (heads + 2 * kvh) * dim, generator=gen).to(device, dtype)
            pos = torch.randint(0, 100, (tokens,), generator=gen).to(device)
            inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
            freqs = torch.arange(128).float()[:, None] * inv[None]
            emb = torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
            kc = torch.zeros(blocks, block_size, kvh, dim, dtype=dtype, device=device)
            vc = torch.zeros_like(kc)
            slots = torch.randperm(blocks * block_size, generator=gen)[:tokens].to(device)
            ref = qkv.clone()
            q, k, v = ref.split([heads * dim, kvh * dim, kvh * dim], dim=1)
            q_ref = rope_reference(q.view(tokens, heads, dim), cos[pos][:, None], sin[pos][:, None])
            k_ref = rope_reference(k.view(tokens, kvh, dim), cos[pos][:, None], sin[pos][:, None])
            rope_write_kv(qkv, pos, cos, sin, kc, vc, slots, heads, kvh, dim)
            name = f"{dtype} rope_write_kv T={tokens} H={heads} KVH={kvh} D={dim}"
            report(name + " q", qkv[:, :heads * dim].view(tokens, heads, dim), q_ref, tol)
            report(name + " k cache", kc.view(-1, kvh, dim)[slots], k_ref, tol)
            report(name + " v cache", vc.view(-1, kvh, dim)[slots], v.view(tokens, kvh, dim), 1e-6)
        for rows, inter in ((1, 512), (4, 11008), (9, 1000)):
            gu = torch.randn(rows, 2 * inter, generator=gen).to(device, dtype)
            g, u = gu.split(inter, dim=1)
            report(f"{dtype} silu_mul {rows}x{inter}", silu_mul(gu), F.silu(g) * u, tol)
        for rows, n, k in ((1, 64, 256), (3, 1000, 1100), (4, 4096, 4096), (1, 300, 11008)):
            x = torch.randn(rows, k, generator=gen).to(device, dtype)
            w = (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)
            ref = (x.float() @ w.float().T)
            gemv_tol = 1e-3 if dtype == torch.float32 else 2e-2
            report(f"{dtype} gemv {rows}x{k} @ {n}x{k}", gemv(x, w), ref, gemv_tol)
    return worst


def ops_bench(device: torch.device) -> None:
    """Matrix-vector products of the LLaVA-7B decode shapes: Triton vs cuBLAS, bytes/s."""
    import triton

    shapes = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
              "lm_head": (32064, 4096)}
    print(f"{'shape':10s}{'rows':>5s}{'triton us':>11s}{'TB/s':>7s}{'cublas us':>11s}{'TB/s':>7s}  config")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            t_tri = triton.testing.do_bench(lambda x=x, w=w: gemv(x, w), warmup=10, rep=100)
            t_cub = triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w), warmup=10, rep=100)
            gb = w.numel() * 2 / 1e12
            best = triton_ops._GEMV_CONFIG.get(triton_ops.gemv_key(x, w))
            print(f"{name:10s}{rows:5d}{1e3 * t_tri:11.1f}{gb / (t_tri / 1e3):7.2f}{1e3 * t_cub:11.1f}"
                  f"{gb / (t_cub / 1e3):7.2f}  {best}")


# ---- fused vision stage --------------------------------------------------------------------------

# One kernel against the torch op: the same roundings, so only an ulp here and there; bfloat16
# gets more because triton's CPU interpreter truncates float32 -> bfloat16.
VISION_KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def vision_check(device: torch.device, dtypes: list[torch.dtype] | None = None) -> float:
    """Worst error / tolerance over the kernels and the whole stage; prints one line per case."""
    from fovea.engine.vision.vision_fused import (
        GELU,
        MODEL_TOLERANCE,
        QUICK_GELU,
        FusedVision,
        activation,
        add_layer_norm,
        layer_norm,
        relative_error,
        sample_pixels,
    )
    from fovea.models.clip_vision import encode_images

    dtypes = dtypes or check_dtypes(device)
    worst = 0.0

    def report(name: str, err: float, tol: float) -> None:
        nonlocal worst
        worst = max(worst, err / tol if err <= tol or err > tol else float("inf"))  # NaN: fails
        print(f"{name:56s} relative err {err:.2e} (tol {tol:.0e}) {'ok' if err <= tol else 'FAIL'}")

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        kernel_tol = VISION_KERNEL_TOLERANCE[dtype]
        for rows, cols in ((3, 96), (37, 1024), (5, 1000)):
            x, r = (torch.randn(rows, cols, generator=gen).to(device, dtype) for _ in range(2))
            w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(device, dtype)
            b = torch.randn(cols, generator=gen).to(device, dtype)
            summed, normed = add_layer_norm(x, r, w, b, 1e-5)
            ref_sum = r + x
            report(f"{dtype} add_layer_norm sum {rows}x{cols}", relative_error(summed, ref_sum), kernel_tol)
            report(f"{dtype} add_layer_norm norm {rows}x{cols}",
                   relative_error(normed, F.layer_norm(ref_sum, (cols,), w, b, 1e-5)), kernel_tol)
            report(f"{dtype} layer_norm {rows}x{cols}",
                   relative_error(layer_norm(x, w, b, 1e-6), F.layer_norm(x, (cols,), w, b, 1e-6)), kernel_tol)
        for numel in (1000, 3 * 4096 + 5):
            x = (2 * torch.randn(numel, generator=gen)).to(device, dtype)
            report(f"{dtype} quick_gelu {numel}",
                   relative_error(activation(x, QUICK_GELU), x * torch.sigmoid(1.702 * x)), kernel_tol)
            report(f"{dtype} gelu {numel}", relative_error(activation(x, GELU), F.gelu(x)), kernel_tol)
        for act, layer, strategy in (("quick_gelu", -2, "default"), ("gelu", [-3, -1], "full")):
            loaded = random_llava(tiny_vision(act), 64, device, dtype, layer, strategy)
            pixels = sample_pixels(loaded, 3, seed=1)
            err = relative_error(FusedVision(loaded)(pixels), encode_images(loaded, pixels))
            report(f"{dtype} stage {act} layer {layer} {strategy}", err, MODEL_TOLERANCE[dtype])
    return worst


def matmul_workload(fused, images: int) -> tuple[Callable[[], None], Callable[[], None], float]:
    """(the stage's matrix products alone, its attention alone, FLOPs of both) at ``images``,
    on inputs made once, so each time is what cuBLAS / SDPA need on these shapes."""
    from fovea.engine.vision.vision_fused import attention

    loaded, dev, dt = fused.loaded, fused.loaded.device, fused.dtype
    vision = loaded.model.config.vision_config
    tokens = (vision.image_size // vision.patch_size) ** 2 + 1
    rows, width, inter = images * tokens, vision.hidden_size, vision.intermediate_size
    x, big = torch.randn(rows, width, device=dev, dtype=dt), torch.randn(rows, inter, device=dev, dtype=dt)
    qkv = torch.randn(rows, 3 * width, device=dev, dtype=dt)
    features = torch.randn(images * (tokens - 1), fused.projector.linear_1.in_features, device=dev, dtype=dt)
    mid = torch.randn(features.shape[0], fused.projector.linear_2.in_features, device=dev, dtype=dt)

    def products() -> None:
        for w in fused.layers:
            F.linear(x, w.qkv, w.qkv_bias)
            F.linear(x, w.out.weight, w.out.bias)
            F.linear(x, w.fc1.weight, w.fc1.bias)
            F.linear(big, w.fc2.weight, w.fc2.bias)
        fused.projector.linear_1(features)
        fused.projector.linear_2(mid)

    def attend() -> None:
        for w in fused.layers:
            attention(qkv, images, tokens, w)

    layer_flops = 2 * rows * width * (4 * width + 2 * inter) + 4 * images * tokens * tokens * width
    proj = fused.projector
    proj_flops = 2 * features.shape[0] * (proj.linear_1.in_features * proj.linear_1.out_features
                                          + proj.linear_2.in_features * proj.linear_2.out_features)
    return products, attend, len(fused.layers) * layer_flops + proj_flops


def matmul_ceiling(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of one large bf16 matrix product: what the stage's products could reach at best."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n ** 3 / time_cuda(lambda: a @ a)


def vision_bench(device: torch.device) -> None:
    """LLaVA-1.5-7B's vision stage (random bf16 weights): eager vs fused, with and without
    CUDA graphs, at batch 1 and 32, read against the matrix products alone."""
    from fovea.engine.vision.vision_fused import FusedVision, sample_pixels, startup_problem
    from fovea.engine.vision.vision_graphs import try_graphed_vision
    from fovea.models.clip_vision import encode_images

    loaded = random_llava(llava15_vision(), 4096, device, torch.bfloat16, weight_std=0.02)
    fused = FusedVision(loaded)
    print("start-up check:", startup_problem(loaded, fused) or "fused agrees with transformers' modules")
    peak = matmul_ceiling(device)
    graphed = {"eager": try_graphed_vision(loaded, 32), "fused": try_graphed_vision(loaded, 32, encode=fused)}
    runs = {"eager": functools.partial(encode_images, loaded), "fused": fused}
    print(f"bf16 matmul ceiling (8192^3): {peak / 1e12:.0f} TFLOP/s")
    print(f"{'path':16s}{'batch':>6s}{'ms':>9s}{'img/s':>9s}{'vs eager':>10s}")
    for images in (1, 32):
        pixels = sample_pixels(loaded, images, seed=images)
        base = None
        for name, run in runs.items():
            for suffix, fn in (("", run), (" +graph", graphed[name])):
                if fn is None:
                    continue
                seconds = time_cuda(functools.partial(fn, pixels))
                base = base or seconds
                print(f"{name + suffix:16s}{images:6d}{1e3 * seconds:9.2f}{images / seconds:9.0f}"
                      f"{base / seconds:9.2f}x")
        products, attend, flops = matmul_workload(fused, images)
        t_mm, t_attn, t_fused = time_cuda(products), time_cuda(attend), time_cuda(functools.partial(fused, pixels))
        print(f"  matrix products alone {1e3 * t_mm:.2f} ms ({100 * t_mm / t_fused:.0f}% of fused), "
              f"attention alone {1e3 * t_attn:.2f} ms ({100 * t_attn / t_fused:.0f}%), "
              f"FLOP floor {images * peak / flops:.0f} img/s")


# ---- command line --------------------------------------------------------------------------------

Timing = Callable[[torch.device], None]
# kernel -> (its check, {timing flag: function of the device})
KERNELS: dict[str, tuple[Callable[[torch.device], float], dict[str, Timing]]] = {
    "decode": (decode_check, {"bench": decode_bench, "sweep": decode_sweep}),
    "prefill": (prefill_check, {"bench": prefill_bench,
                                "sweep": lambda device: prefill_bench(device, sweep=True)}),
    "ops": (ops_check, {"bench": ops_bench}),
    "vision": (vision_check, {"bench": vision_bench}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[4:]))
    parser.add_argument("--kernel", required=True, choices=sorted(KERNELS), help="which kernel module")
    parser.add_argument("--check", action="store_true",
                        help="compare with the torch reference (exit 1 on a FAIL)")
    parser.add_argument("--bench", action="store_true", help="time it (decode, prefill, ops, vision)")
    parser.add_argument("--sweep", action="store_true",
                        help="time launch config variations (decode, prefill; slow)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    check, timings = KERNELS[args.kernel]
    wanted = [name for name in ("bench", "sweep") if getattr(args, name)]
    missing = [name for name in wanted if name not in timings]
    if missing:
        parser.error(f"--kernel {args.kernel} has no --{missing[0]}")
    if not args.check and not wanted:
        parser.print_help()
        return 2
    device = torch.device(args.device)
    status = run_check(device, check) if args.check else 0
    for name in wanted:
        timings[name](device)
    return status


if __name__ == "__main__":
    sys.exit(main())
