"""What one HTTP request costs the server's host, in CPU time per thread, not wall time.

    python bench/http_host_cost.py [--model DIR] [--requests 200] [--concurrency 8] [--device cpu]

Runs ``fovea serve``'s app in this process (uvicorn on its own thread, as ``fovea serve`` runs it)
and ``bench/http_load.py`` as a separate process against it, then reads every server thread's
CPU clock before and after the load. CPU milliseconds per request are far steadier than
latencies on a shared machine, and they say where the host's time goes: the event loop
(FastAPI, middleware, SSE), the engine thread, and the worker threads that decode and
preprocess images. On a GPU the event loop and the workers compete with the engine thread for
the GIL, so their share is what HTTP takes from throughput (docs/benchmarks.md).
Linux only (per-thread CPU clocks).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

EVENT_LOOP_THREAD = "http-event-loop"
ENGINE_THREADS = ("fovea-paged-engine", "fovea-engine")


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of every live thread of this process, keyed by name (numbered if shared)."""
    seconds: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            seconds[f"{thread.name}#{thread.ident}"] = time.clock_gettime(clock)
        except (OSError, ProcessLookupError):  # it ended between enumerate and the read
            continue
    return seconds


def group_of(key: str) -> str:
    name = key.split("#", 1)[0]
    if name == EVENT_LOOP_THREAD:
        return "event loop (HTTP, SSE)"
    if name in ENGINE_THREADS:
        return "engine thread"
    if name == "MainThread":
        return "bench driver"
    return "worker threads (images, prompts)"


def run_load(url: str, args: argparse.Namespace, requests: int) -> str:
    cmd = [sys.executable, str(REPO / "bench" / "http_load.py"), "--url", url, "--single", "0", "--warmup", "0",
           "--concurrency", str(args.concurrency), "--requests", str(requests), "--mix", args.mix]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    # http_load exits 1 when an answer is wrong (the demo model misses a scene now and then);
    # that still measures the host's cost. Anything else means no measurement.
    if done.returncode not in (0, 1) or "concurrent" not in done.stdout:
        raise SystemExit(f"http_load failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "fovea-shapes"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--mix", default="caption")
    parser.add_argument("--runs", type=int, default=3, help="measured runs; the table shows medians")
    args = parser.parse_args()

    import uvicorn
    from scene_helpers import free_port

    from fovea.config import ServerSettings
    from fovea.serve.app import create_app

    port = free_port()
    settings = ServerSettings(model=Path(args.model), device=args.device, dtype=args.dtype,
                              port=port, canary=False)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=EVENT_LOOP_THREAD, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        run_load(url, args, args.requests)  # warm-up: batch shapes, executors, allocator (the first run is slower)
        per_run: list[dict[str, float]] = []
        walls: list[float] = []
        for _ in range(args.runs):
            before = thread_cpu_seconds()
            started = time.perf_counter()
            run_load(url, args, args.requests)
            walls.append(time.perf_counter() - started)
            after = thread_cpu_seconds()
            groups: dict[str, float] = defaultdict(float)
            for key, seconds in after.items():
                groups[group_of(key)] += seconds - before.get(key, 0.0)
            per_run.append({name: 1000 * s / args.requests for name, s in groups.items()})
    finally:
        server.should_exit = True
        thread.join(timeout=30)

    names = sorted({name for run in per_run for name in run} - {"bench driver"})
    print(f"{settings.model} on {args.device}, {args.requests} requests x {args.runs} runs, "
          f"{args.concurrency} clients, CPU ms per request (median of runs; each run's values)")
    for name in names:
        values = [run.get(name, 0.0) for run in per_run]
        print(f"{name:>34}: {statistics.median(values):7.2f}   ({' / '.join(f'{v:.2f}' for v in values)})")
    host = [sum(v for k, v in run.items() if k not in ("engine thread", "bench driver")) for run in per_run]
    print(f"{'all but the engine':>34}: {statistics.median(host):7.2f}   ({' / '.join(f'{v:.2f}' for v in host)})")
    print(f"{'wall req/s':>34}: {statistics.median(args.requests / w for w in walls):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
