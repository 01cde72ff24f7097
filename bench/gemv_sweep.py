"""Sweep the Triton matrix-vector kernel's launch configurations on the LLaVA-7B decode shapes.

    python3 bench/gemv_sweep.py [--rows 1] [--quick]

Each figure is timed as inside a decode step: one CUDA graph of back-to-back products over
distinct copies of the weight (more bytes than the L2 cache holds), replayed; cuBLAS
(``F.linear``) is timed the same way. Prints, per shape, cuBLAS and the best configurations
in microseconds per product and in TB/s of weight bytes read. Configurations whose result
differs from cuBLAS's beyond bf16 rounding are reported and never ranked.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fovea.engine.kernels.triton_ops import gemv_launch

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32064, 4096)}
STREAMED_BYTES = 512 * 1024 * 1024  # per graph: several times the H200's 50 MB L2


def graph_time(fn, copies: int, reps: int = 20) -> float:
    """Seconds per call of fn(i) for i in range(copies), captured as one graph and replayed."""
    for i in range(copies):  # compile and allocate outside the capture
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
    return statistics.median(times)


def configs(quick: bool) -> list[tuple[int, int, int, int]]:
    tiles = [(4, 1024), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 256), (32, 128), (64, 128)]
    warps, stages = ((4, 8), (3, 5)) if not quick else ((4,), (3,))
    return [(bn, bk, w, s) for (bn, bk), w, s in itertools.product(tiles, warps, stages)]


def sweep_shape(name: str, n: int, k: int, rows: int, quick: bool, gen: torch.Generator) -> None:
    device = gen.device
    nbytes = n * k * 2
    copies = max(2, -(-STREAMED_BYTES // nbytes))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x, weights[0]).float()
    t_cublas = graph_time(lambda i: F.linear(x, weights[i]), copies)
    ranked, wrong = [], []
    for cfg in configs(quick):
        try:
            err = (gemv_launch(x, weights[0], *cfg).float() - ref).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a launch the kernel cannot take (resources)
            wrong.append(f"{cfg}: {type(exc).__name__}")
            continue
        if not err <= 0.05 * ref.abs().max().item():
            wrong.append(f"{cfg}: error {err:.2e}")
            continue
        ranked.append((graph_time(lambda i, c=cfg: gemv_launch(x, weights[i], *c), copies), cfg))
    ranked.sort()
    best_t = ranked[0][0] if ranked else float("nan")
    tops = "; ".join(f"{c}: {1e6 * t:.1f}" for t, c in ranked[:3])
    print(f"{name:9s}{1e6 * t_cublas:10.1f}{nbytes / t_cublas / 1e12:6.2f}{1e6 * best_t:9.1f}"
          f"{nbytes / best_t / 1e12:6.2f}  {tops}", flush=True)
    for line in wrong:
        print(f"    not ranked: {line}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1, help="rows of x (decode batch size)")
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':9s}{'cuBLAS us':>10s}{'TB/s':>6s}{'best us':>9s}{'TB/s':>6s}  "
          "best configs (block_n, block_k, warps, stages: us)")
    for name, (n, k) in SHAPES.items():
        sweep_shape(name, n, k, args.rows, args.quick, gen)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
