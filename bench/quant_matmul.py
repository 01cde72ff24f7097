"""Quantised linear layers on the GPU, checked and timed on the Qwen2.5-VL-7B and -72B decoder shapes:
bf16 ``F.linear``, FP8 per-channel through ``torch._scaled_mm`` and through the Triton kernel, FP8
128x128 blocks (Triton) and W4A16 int4 with group 128 and zero points, each FP8 path with its
dynamic per-token activation quantiser included. The int4 rows, old against new:

- ``int4_old``: the fused Triton kernel choosing among its configurations of before 2026-12-03 (codes
  converted int -> float: ``int4_candidates(..., "shift")``);
- ``int4_fused``: the fused kernel choosing among all (the magic-number and per-nibble unpacking too);
- ``int4_dq``: the weight dequantised into one scratch buffer (``int4_dequantize``), then cuBLAS;
- ``int4``: ``int4_linear`` as shipped: fused below ``INT4_DEQUANT_MIN_ROWS`` rows, int4_dq from it;
- ``int4_dqk``: the dequantiser alone (its floor: 0.5 byte read and 2 written per weight);
- ``fp8_quant``: the per-token activation quantiser alone (its time is inside every fp8 row);
- ``fp8_mma`` / ``int4_mma``: the tensor-core kernels alone (fp8 with the quantiser's launch);
- ``fp8_gemv`` / ``int4_gemv``: the matrix-vector kernels alone (``quant_gemv``; up to 4 rows);
  ``fp8_triton`` and ``int4_fused`` are the shipped choice between the two.

    python3 bench/quant_matmul.py [--model 7b|72b|all] [--rows 1,8,64,128,256,1275,2048] [--reps 20]
                                  [--impls ...] [--no-check] [--sweep]

For the int4 work alone (the two models within a 10-minute call):

    python3 bench/quant_matmul.py --impls bf16,int4_old,int4_fused,int4_dq,int4 --reps 10

First every kernel is CHECKED on the GPU, for every shape and row count, against a reference built
here from the layouts' definitions: the activation quantisers bit for bit against torch's cast, the
FP8 products against the float32 product of the same quantised activations and the dequantised
weight, the int4 product against x @ W^T with W dequantised from its codes (not by fovea's
unpacker); tolerances from ``fovea.testing.tolerance`` (float32 sums over K, bf16 output). Any
mismatch is printed and the script exits 1 (after timing, unless nothing could run).

Each figure is the median over ``--reps`` replays of one CUDA graph of back-to-back calls over
distinct copies of the weight (more bytes than the 50 MB L2 holds, as in a decode step), per call:
ms, effective TB/s (weight bytes read / time), TFLOP/s, and the floor: max(bytes / 4.2 TB/s copy,
flops / 790 TFLOP/s bf16 or ~1580 fp8). The table printed last sums each format over one decoder
step's linear layers (qkv, o, gate_up, down, times the layers), the number the decode goals are
about (the LM head and attention are not in it); then the int4 table: old against shipped, the
speed-up, the fused kernel against the dequantising path (the threshold's check) and the floor.
``--sweep`` also times every candidate launch configuration of the Triton kernels (the first use of
a shape picks the fastest by itself), and for FP8 at few rows a wider grid (``fp8_grid``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fovea.engine.kernels import quant_gemv
from fovea.engine.kernels import quant_matmul as qm
from fovea.engine.kernels.fp8_quantize import quantize_per_token, quantize_per_token_group
from fovea.testing.tolerance import eps, reduction_atol

# The floors' ceilings: measured on the card at the start of a run (measure_ceilings); these are
# the H200's (device KINDS.md), kept with --nominal-ceilings
COPY_TBS = 4.2  # copy bandwidth, TB/s
BF16_TFLOPS = 790.0  # dense bf16 matrix rate
FP8_TFLOPS = 1580.0  # twice bf16 (the fp8 tensor-core rate), not measured
STREAMED_BYTES = 384 * 1024 * 1024  # weight bytes per graph: several times the L2
GROUP = 128
BLOCK = (128, 128)
IMPLS = ("bf16", "fp8_scaled_mm", "fp8_triton", "fp8_mma", "fp8_gemv", "fp8_block", "int4_old", "int4_mma",
         "int4_gemv", "int4_fused", "int4_dq", "int4", "int4_dqk", "fp8_quant")
INT4 = tuple(i for i in IMPLS if i.startswith("int4"))
SWEPT = ("int4_fused", "fp8_triton", "fp8_block", "fp8_gemv", "int4_gemv")  # --sweep times their configurations

MODELS = {  # name -> (layers, {linear: (N, K)})
    "7b": (28, {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (2 * 18944, 3584), "down": (3584, 18944)}),
    "72b": (80, {"qkv": ((64 + 2 * 8) * 128, 8192), "o": (8192, 64 * 128), "gate_up": (2 * 29568, 8192),
                 "down": (8192, 29568)}),
}


@dataclass
class Weights:
    w: torch.Tensor  # bf16 [N, K]
    fp8: torch.Tensor  # per-channel quantised [N, K]
    fp8_scale: torch.Tensor  # [N]
    fp8b: torch.Tensor  # block quantised [N, K]
    fp8b_scale: torch.Tensor  # [N/128, K/128]
    packed: torch.Tensor  # int4 [K/8, N]
    scales: torch.Tensor  # bf16 [K/128, N]
    zeros: torch.Tensor  # bf16 [K/128, N]
    codes: torch.Tensor = field(repr=False)  # uint8 [N, K], the int4 codes (for the reference)


def make_weights(n: int, k: int, gen: torch.Generator) -> Weights:
    w = (torch.randn(n, k, generator=gen, device=gen.device) * 0.02).bfloat16()
    wf = w.float()
    ch = (wf.abs().amax(1) / 448).clamp(min=1e-12)
    fp8 = (wf / ch[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    bn, bk = BLOCK
    blocks = wf.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3))
    bscale = (blocks / 448).clamp(min=1e-12)
    fp8b = (wf / bscale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    g = wf.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(2), g.amax(2)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    z = (-lo / s).round().clamp(0, 15)
    s, z = s.bfloat16(), z.bfloat16()  # [N, K/G], as stored
    codes = (g / s.float()[:, :, None] + z.float()[:, :, None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    q = codes.t().contiguous().view(k // 8, 8, n).to(torch.int64)
    packed = sum(q[:, j] << (4 * j) for j in range(8))
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return Weights(w, fp8, ch.float(), fp8b, bscale.float(), packed.contiguous(), s.t().contiguous(),
                   z.t().contiguous(), codes)


def weight_bytes(impl: str, n: int, k: int) -> int:
    if impl == "bf16":
        return 2 * n * k
    if impl in ("fp8_scaled_mm", "fp8_triton", "fp8_mma", "fp8_gemv"):
        return n * k + 4 * n
    if impl == "fp8_block":
        return n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)
    if impl == "fp8_quant":  # the activation quantiser alone: no weight (its time is in the fp8 rows)
        return 0
    if impl == "int4_dqk":  # the dequantiser: reads the int4 weight, writes it in bf16
        return n * k // 2 + 2 * 2 * n * (k // GROUP) + 2 * n * k
    return n * k // 2 + 2 * 2 * n * (k // GROUP)  # codes, bf16 scales and zeros


def flop_rate(impl: str) -> float:
    return FP8_TFLOPS if impl.startswith("fp8") else BF16_TFLOPS


_SCRATCH: dict[str, torch.Tensor] = {}  # one dequantisation buffer, as the engine holds one for all layers


def scratch(n: int, k: int) -> torch.Tensor:
    buf = _SCRATCH.get("bf16")
    if buf is None or buf.numel() < n * k:
        buf = _SCRATCH["bf16"] = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
    return buf


def call(impl: str, x: torch.Tensor, wt: Weights, config=None):
    if impl == "fp8_quant":
        return quantize_per_token(x)
    if impl == "bf16":
        return F.linear(x, wt.w)
    if impl == "fp8_scaled_mm":
        return qm.fp8_linear(x, wt.fp8, wt.fp8_scale, impl="scaled_mm")
    if impl in ("fp8_triton", "fp8_mma", "fp8_gemv") and config is not None:
        return qm.fp8_triton(x, wt.fp8, wt.fp8_scale, None, x.dtype, config)
    if impl == "fp8_triton":
        return qm.fp8_linear(x, wt.fp8, wt.fp8_scale, impl="triton")
    if impl in ("fp8_mma", "fp8_gemv"):
        key = (f"{impl}-bench", qm._m_bucket(x.shape[0]), wt.fp8.shape[0], x.shape[1])
        config = qm._choose(key, own_candidates(impl, x.shape[0]),
                            lambda c: qm.fp8_triton(x, wt.fp8, wt.fp8_scale, None, x.dtype, c))
        return qm.fp8_triton(x, wt.fp8, wt.fp8_scale, None, x.dtype, config)
    if impl == "fp8_block":
        return qm.fp8_block_linear(x, wt.fp8b, wt.fp8b_scale, BLOCK, config=config)
    n, k = wt.w.shape
    if impl == "int4_old" and config is None:
        key = ("int4-shift", qm._m_bucket(x.shape[0]), n, k, GROUP, str(x.dtype), True)
        config = qm._choose(key, qm.int4_candidates(x.shape[0], GROUP, "shift"),
                            lambda c: qm.int4_gemm(x, wt.packed, wt.scales, wt.zeros, GROUP, None, c))
    if impl in ("int4_mma", "int4_gemv") and config is None:
        key = (f"{impl}-bench", qm._m_bucket(x.shape[0]), n, k)
        config = qm._choose(key, own_candidates(impl, x.shape[0]),
                            lambda c: qm.int4_fused(x, wt.packed, wt.scales, wt.zeros, GROUP, None, c))
    if impl in ("int4_old", "int4_fused", "int4_mma", "int4_gemv"):
        return qm.int4_linear(x, wt.packed, wt.scales, wt.zeros, GROUP, config=config, impl="fused")
    if impl == "int4_dq":
        return qm.int4_linear(x, wt.packed, wt.scales, wt.zeros, GROUP, impl="dequant", scratch=scratch(n, k))
    if impl == "int4_dqk":
        return qm.int4_dequantize(wt.packed, wt.scales, wt.zeros, GROUP, scratch(n, k))
    return qm.int4_linear(x, wt.packed, wt.scales, wt.zeros, GROUP, config=config, scratch=scratch(n, k))


def own_candidates(impl: str, rows: int) -> list:
    """The configurations of one kernel alone (the tensor-core or the matrix-vector one)."""
    if impl == "fp8_mma":
        return qm.fp8_candidates(rows)
    if impl == "int4_mma":
        return qm.int4_candidates(rows, GROUP)
    if rows > quant_gemv.GEMV_MAX_ROWS:
        raise ValueError(f"the matrix-vector kernels take at most {quant_gemv.GEMV_MAX_ROWS} rows")
    if impl == "fp8_gemv":
        return quant_gemv.fp8_gemv_candidates(rows)
    return quant_gemv.int4_gemv_candidates(rows, GROUP)


def graph_time(fn, copies: int, reps: int) -> float:
    """Seconds per call of fn(i) for i in range(copies), captured as one graph and replayed (median)."""
    for i in range(copies):  # compile, choose configurations and allocate outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    del graph
    return statistics.median(times)


# --------------------------------------------------------------------------------------------- checks


def torch_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and group: scale = max(absmax / 448, 1/(448*512)), q = e4m3(clamp(x / scale, ±448))."""
    qs, ss = [], []
    xf = x.float()
    for start in range(0, x.shape[1], group):
        part = xf[:, start:start + group]
        s = (part.abs().amax(1, keepdim=True) / torch.full((), 448.0, device=x.device)).clamp(  # true division
            min=1.0 / (448.0 * 512.0))
        ss.append(s)
        qs.append((part / s).clamp(-448, 448).to(torch.float8_e4m3fn))
    return torch.cat(qs, 1), torch.cat(ss, 1)


def check(impl: str, x: torch.Tensor, wt: Weights, failures: list[str], label: str) -> None:
    n, k = wt.w.shape
    if impl == "fp8_quant":  # checked bit for bit with every fp8 row's quantiser
        return
    if impl == "int4_dqk":  # (q - z) * s in float32, rounded once to bf16: bit for bit
        got = call(impl, x, wt)
        s = wt.scales.float().t().repeat_interleave(GROUP, 1)
        z = wt.zeros.float().t().repeat_interleave(GROUP, 1)
        if not torch.equal(got, ((wt.codes.float() - z) * s).t().bfloat16()):
            failures.append(f"{label} {impl}: the dequantised weight differs from its definition")
        return
    y = call(impl, x, wt).float()
    rows = torch.unique(torch.cat([torch.tensor([0, x.shape[0] - 1]),
                                   torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:62]]))
    rows = rows.to(x.device)
    xr = x[rows]
    if impl == "bf16":
        return
    if impl.startswith("fp8"):
        group = k if impl != "fp8_block" else BLOCK[1]
        xq, xs = torch_quant(xr, group)
        got_q, got_s = (quantize_per_token(xr) if impl != "fp8_block" else quantize_per_token_group(xr, group))
        if not (torch.equal(got_s, xs) and torch.equal(got_q.view(torch.uint8), xq.view(torch.uint8))):
            failures.append(f"{label} {impl}: the activation quantiser differs from torch's cast")
        a = xq.float() * xs.repeat_interleave(group, 1)[:, :k]
        if impl == "fp8_block":
            bn, bk = BLOCK
            wdq = wt.fp8b.float() * wt.fp8b_scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        else:
            wdq = wt.fp8.float() * wt.fp8_scale[:, None]
        ref = a @ wdq.t()
    else:
        s = wt.scales.float().t().repeat_interleave(GROUP, 1)  # [N, K]
        z = wt.zeros.float().t().repeat_interleave(GROUP, 1)
        ref = xr.float() @ ((wt.codes.float() - z) * s).t()
    got = y[rows]
    atol = reduction_atol(torch.float32, k, float(ref.abs().max()), storage=torch.bfloat16)
    if impl == "int4_dq" or (impl == "int4" and x.shape[0] >= qm.INT4_DEQUANT_MIN_ROWS):
        # the weight rounded once to bf16 before the product: at most eps/2 of each |x_k w_k|
        w = ((wt.codes.float() - wt.zeros.float().t().repeat_interleave(GROUP, 1))
             * wt.scales.float().t().repeat_interleave(GROUP, 1))
        atol += eps(torch.bfloat16) / 2 * float((xr.float().abs() @ w.abs().t()).max())
    err = float((got - ref).abs().max())
    if not err <= atol:
        failures.append(f"{label} {impl}: max error {err:.3g} > {atol:.3g}")


def check_symmetric_int4(x: torch.Tensor, wt: Weights, failures: list[str], label: str) -> None:
    """The same codes read with the symmetric zero 8 (zeros None)."""
    k = wt.w.shape[1]
    got = qm.int4_linear(x, wt.packed, wt.scales, None, GROUP).float()
    ref = x.float() @ ((wt.codes.float() - 8) * wt.scales.float().t().repeat_interleave(GROUP, 1)).t()
    atol = reduction_atol(torch.float32, k, float(ref.abs().max()), storage=torch.bfloat16)
    err = float((got - ref).abs().max())
    if not err <= atol:
        failures.append(f"{label} int4 symmetric: max error {err:.3g} > {atol:.3g}")


# --------------------------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["7b", "72b", "all"], default="all")
    p.add_argument("--rows", default="1,8,64,128,256,1275,2048",
                   help="comma-separated row counts (tokens; 1275: one 720p image's prefill)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-check", action="store_true", help="time only")
    p.add_argument("--sweep", action="store_true", help="also time every candidate configuration")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"a subset of {','.join(IMPLS)}")
    p.add_argument("--nominal-ceilings", action="store_true",
                   help="floors from the H200's ceilings (4.2 TB/s, 790 TFLOP/s) instead of this card's, measured")
    return p.parse_args(argv)


def measure_ceilings() -> None:
    """COPY_TBS, BF16_TFLOPS and FP8_TFLOPS (twice bf16) from this card: a 2 GiB device copy and an
    8192-square bf16 product (gpu_llava7b.ceilings)."""
    global COPY_TBS, BF16_TFLOPS, FP8_TFLOPS
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_llava7b import ceilings

    measured = ceilings()
    COPY_TBS = round(measured["copy_bandwidth_Bps"] / 1e12, 2)
    BF16_TFLOPS = round(measured["bf16_matmul_flops"] / 1e12)
    FP8_TFLOPS = 2 * BF16_TFLOPS


def fp8_grid(rows: int) -> list[qm.GemmConfig]:
    """FP8 launch configurations beyond the shipped candidates, for a few rows: tile widths, K depths,
    pipeline depths and fixed splits over K, to find what the candidates should be."""
    if rows > qm.SMALL_M:
        return []
    return [qm.GemmConfig(16, bn, bk, split, 4, stages)
            for bn, bk, stages in ((64, 128, 4), (64, 128, 6), (64, 256, 4), (128, 128, 4), (32, 128, 4))
            for split in (0, 4, 8, 16)]


def gemv_grid(impl: str, rows: int) -> list:
    """Matrix-vector configurations beyond the candidates: tile widths, warps and splits over K (the
    int4 kernel takes a group a step)."""
    if rows > quant_gemv.GEMV_MAX_ROWS:
        return []
    tile = quant_gemv.fp8_tile(rows)  # weights a 4-warp step, as the candidates
    if impl == "fp8_gemv":
        return [quant_gemv.GemvConfig(bn, tile * warps // 4 // bn, split, warps)
                for bn in (8, 16, 32, 64) for warps in (4, 8) for split in (1, 2, 4, 8)]
    return [quant_gemv.GemvConfig(bn, GROUP // 8, split, warps)
            for bn in (32, 64, 128, 256) for warps in (2, 4, 8) for split in (1, 2, 4, 8)]


def sweep(impl: str, x: torch.Tensor, wts: list[Weights], reps: int) -> None:
    rows = x.shape[0]
    if impl.endswith("_gemv"):
        cands, extra = own_candidates(impl, rows), gemv_grid(impl, rows)
    else:
        cands = qm.int4_candidates(rows, GROUP) if impl.startswith("int4") else qm.fp8_candidates(rows)
        extra = [qm.GemmConfig(c.block_m, c.block_n, c.block_k, s, c.num_warps, c.num_stages)
                 for c in cands[:1] for s in (1, 2, 4, 8) if c.split_k == 0]
        if impl == "fp8_triton":
            extra = [c for c in fp8_grid(rows) if c not in cands] or extra
        if impl == "fp8_block" and rows <= quant_gemv.GEMV_MAX_ROWS:  # the block-scaled matrix-vector kernel
            extra += quant_gemv.fp8_block_gemv_candidates(rows, BLOCK)
    extra = [c for c in extra if c not in cands]
    for c in cands + extra:
        try:
            kind = "int4_fused" if impl.startswith("int4") else impl
            t = graph_time(lambda i, c=c: call(kind, x, wts[i], c), len(wts), reps)
        except Exception as e:  # noqa: BLE001 - a configuration that cannot compile (resources)
            print(f"      sweep {impl:<10} {c.describe():<28} raised {type(e).__name__}: {str(e)[:120]}")
            continue
        print(f"      sweep {impl:<10} {c.describe():<28} {1e3 * t:8.4f} ms")


def int4_table(models, rows_list, totals, floors) -> None:
    """Per decoder step's linears: the old int4 kernel against what ships, and fused against dequantised."""
    def ms(model, rows, impl):
        t = totals.get((model, rows, impl))
        return f"{1e3 * t:8.3f}" if t is not None else f"{'-':>8}"

    if not any(key[2] in INT4 for key in totals):
        return
    print(f"\nint4 per decoder step (linears only), ms; shipped = fused below {qm.INT4_DEQUANT_MIN_ROWS} rows, "
          "dequant + cuBLAS from it:")
    print(f"{'model':<5} {'M':>5} {'old':>8} {'shipped':>8} {'speed-up':>8} {'fused':>8} {'dq+bf16':>8} "
          f"{'faster':>7} {'bf16':>8} {'floor':>8} {'of floor':>8}")
    for model in models:
        for rows in rows_list:
            old, new = totals.get((model, rows, "int4_old")), totals.get((model, rows, "int4"))
            fused, dq = totals.get((model, rows, "int4_fused")), totals.get((model, rows, "int4_dq"))
            floor = floors.get((model, rows, "int4")) or floors.get((model, rows, "int4_fused"))
            up = f"{old / new:7.2f}x" if old and new else f"{'-':>8}"
            faster = ("dq" if dq < fused else "fused") if fused and dq else "-"
            best = min(t for t in (new, fused, dq) if t) if any((new, fused, dq)) else None
            share = f"{100 * floor / best:7.1f}%" if floor and best else f"{'-':>8}"
            print(f"{model:<5} {rows:>5} {ms(model, rows, 'int4_old')} {ms(model, rows, 'int4')} {up} "
                  f"{ms(model, rows, 'int4_fused')} {ms(model, rows, 'int4_dq')} {faster:>7} "
                  f"{ms(model, rows, 'bf16')} {1e3 * floor if floor else 0:8.3f} {share}")


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows_list = [int(r) for r in args.rows.split(",") if r]
    impls = [i for i in args.impls.split(",") if i]
    if set(impls) - set(IMPLS):
        print(f"unknown --impls: {sorted(set(impls) - set(IMPLS))}", file=sys.stderr)
        return 2
    if not args.nominal_ceilings:
        measure_ceilings()
    source = "the H200's, nominal" if args.nominal_ceilings else "measured on this card; fp8 twice bf16"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  floors: {COPY_TBS} TB/s, "
          f"{BF16_TFLOPS:g} TFLOP/s bf16, {FP8_TFLOPS:g} fp8 ({source})")
    gen = torch.Generator(device="cuda").manual_seed(0)
    failures: list[str] = []
    totals: dict[tuple[str, int, str], float] = {}  # (model, rows, impl) -> s per decoder step's linears
    floors: dict[tuple[str, int, str], float] = {}
    models = ["7b", "72b"] if args.model == "all" else [args.model]
    for model in models:
        layers, shapes = MODELS[model]
        for name, (n, k) in shapes.items():
            base = make_weights(n, k, gen)
            copies = max(1, math.ceil(STREAMED_BYTES / weight_bytes("int4", n, k)))
            # distinct copies (same values, other addresses): each call streams its weight from memory
            wts = [base] + [Weights(*(t.clone() for t in (base.w, base.fp8, base.fp8_scale, base.fp8b,
                                                           base.fp8b_scale, base.packed, base.scales, base.zeros)),
                                    codes=base.codes) for _ in range(copies - 1)]
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
                label = f"{model} {name} {n}x{k} M={rows}"
                print(f"{label}")
                for impl in impls:
                    try:
                        if not args.no_check:
                            check(impl, x, base, failures, label)
                            if impl == "int4_fused" and rows == rows_list[0]:
                                check_symmetric_int4(x, base, failures, label)
                        wb, flops = weight_bytes(impl, n, k), 2.0 * rows * n * k
                        used = wts[:max(1, math.ceil(STREAMED_BYTES / max(wb, 1)))]
                        t = graph_time(lambda i, impl=impl, used=used, x=x: call(impl, x, used[i]), len(used), args.reps)
                    except Exception as e:  # noqa: BLE001 (reported; the script fails at the end)
                        failures.append(f"{label} {impl}: raised {type(e).__name__}: {e}")
                        print(f"    {impl:<14} raised {type(e).__name__}: {str(e)[:200]}")
                        continue
                    flops = 0.0 if impl in ("int4_dqk", "fp8_quant") else flops
                    floor = max(wb / (COPY_TBS * 1e12), flops / (flop_rate(impl) * 1e12))
                    totals[(model, rows, impl)] = totals.get((model, rows, impl), 0.0) + layers * t
                    floors[(model, rows, impl)] = floors.get((model, rows, impl), 0.0) + layers * floor
                    print(f"    {impl:<14} {1e3 * t:9.4f} ms  {wb / t / 1e12:6.2f} TB/s  {flops / t / 1e12:7.1f} TFLOP/s"
                          f"  floor {1e3 * floor:8.4f} ms ({100 * floor / t:5.1f}% of it)")
                    if args.sweep and impl in SWEPT:
                        sweep(impl, x, wts, args.reps)
                chosen = {key: c.describe() for key, c in qm._CHOSEN.items() if key[1] == qm._m_bucket(rows)
                          and key[2] == n and key[3] == k}
                for key, desc in chosen.items():
                    print(f"      chosen {key[0]}: {desc}")
            del wts, base
            torch.cuda.empty_cache()
    print("\nper decoder step, the linear layers only (qkv, o, gate_up, down x layers), ms "
          "[floor ms]:")
    header = f"{'model':<5} {'M':>5} " + " ".join(f"{i:>20}" for i in impls)
    print(header)
    for model in models:
        for rows in rows_list:
            cells = [f"{1e3 * totals[(model, rows, i)]:9.3f} [{1e3 * floors[(model, rows, i)]:7.3f}]"
                     if (model, rows, i) in totals else "-" for i in impls]
            print(f"{model:<5} {rows:>5} " + " ".join(f"{c:>20}" for c in cells))
    int4_table(models, rows_list, totals, floors)
    print(f"\n{time.monotonic() - started:.0f} s")
    if args.no_check:
        print("\nnot checked (--no-check)")
    elif failures:
        print(f"\nCHECK FAILED ({len(failures)}):")
        for f in failures:
            print("  " + f)
        return 1
    else:
        print("\nall kernels match their references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
