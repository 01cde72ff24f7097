"""A load generator in processes of its own, so that the client is never the bottleneck.

One Python process cannot both parse hundreds of SSE streams and build the next requests without
its event loop adding to the latencies it measures. Here the requests are split over
``processes`` worker processes, each with its own event loop and HTTP client. They wait at a
barrier and start together, so the wall time is from that start to the last answer:

- ``burst``: every request at once;
- ``poisson``: open-loop arrivals at a rate, each worker sending its share at their times.

Every request is checked as ``serve_load.stream_one`` checks it (finish_reason "length", the
asked token count, ``[DONE]``); failures are counted. Each run also says what the client cost:
the workers' CPU seconds (user + system) over the wall time, as cores busy, and the busiest
worker's share of one core. A worker near 100% means the client, not the server, may set the
pace: add processes.

    run = burst(url, bodies, processes=4)   # run.results, run.wall_s, run.client
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import serve_load as load


@dataclass
class Run:
    results: list[load.Result]
    wall_s: float
    client: dict  # cpu_s (all workers), cores_busy (cpu_s / wall), busiest_worker_core_share, processes


def _context():
    """Forked children: a spawned one re-imports the benchmark's main module, and with it torch and
    transformers (14 s each on the H200 machine, 8 at once); the children never touch CUDA."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker(url: str, timed_bodies: list[tuple[float, dict]], barrier, out) -> None:
    """Send each body ``delay`` seconds after the common start (0: at once)."""
    async def run() -> tuple[list[load.Result], float, float]:
        async with load.client(len(timed_bodies)) as c:
            barrier.wait()
            started, cpu0 = time.time(), _cpu_s()
            origin = time.perf_counter()

            async def at(delay: float, body: dict) -> load.Result:
                if delay > 0:
                    await asyncio.sleep(max(0.0, origin + delay - time.perf_counter()))
                return await load.stream_one(c, url, body)

            results = await asyncio.gather(*(at(d, b) for d, b in timed_bodies))
            return list(results), started, _cpu_s() - cpu0

    results, started, cpu = asyncio.run(run())
    out.put((started, time.time(), cpu, [(r.ok, r.ttft_s, r.total_s, r.tokens, r.error) for r in results]))


def _run(url: str, timed_bodies: list[tuple[float, dict]], processes: int, timeout_s: float) -> Run:
    processes = max(1, min(processes, len(timed_bodies)))
    ctx = _context()
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    shares = [timed_bodies[i::processes] for i in range(processes)]
    procs = [ctx.Process(target=_worker, args=(url, share, barrier, out), daemon=True) for share in shares]
    for p in procs:
        p.start()
    reports = [out.get(timeout=timeout_s) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    start, end = min(r[0] for r in reports), max(r[1] for r in reports)
    wall = end - start
    cpu = [r[2] for r in reports]
    client = {"processes": processes, "cpu_s": sum(cpu), "cores_busy": sum(cpu) / wall if wall else float("nan"),
              "busiest_worker_core_share": max(c / (r[1] - r[0]) for c, r in zip(cpu, reports) if r[1] > r[0])
              if any(r[1] > r[0] for r in reports) else float("nan")}
    return Run([load.Result(*fields) for r in reports for fields in r[3]], wall, client)


def burst(url: str, bodies: list[dict], processes: int = 4, timeout_s: float = 900) -> Run:
    """All ``bodies`` at once from ``processes`` processes."""
    return _run(url, [(0.0, b) for b in bodies], processes, timeout_s)


def arrivals(rate: float, seconds: float, seed: int = 0, limit: int | None = None) -> list[float]:
    """The seconds (from the start) at which ``poisson`` sends, for these arguments: a caller makes
    exactly ``len(arrivals(...))`` bodies, not a margin of 720p JPEGs that are never sent."""
    import random

    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < seconds and (limit is None or len(out) < limit):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def poisson(url: str, bodies: list[dict], rate: float, seconds: float, processes: int = 4, seed: int = 0,
            timeout_s: float = 900) -> Run:
    """Open-loop Poisson arrivals at ``rate`` per second for ``seconds`` (as many bodies as arrive
    are used), spread over ``processes`` processes."""
    times = arrivals(rate, seconds, seed, limit=len(bodies))
    return _run(url, list(zip(times, bodies)), processes, timeout_s + seconds)


def describe(client: dict) -> str:
    return (f"client: {client['processes']} processes, {client['cores_busy']:.2f} cores busy, busiest worker at "
            f"{100 * client['busiest_worker_core_share']:.0f}% of a core")


def _chat_body(spec: tuple) -> dict:
    return load.chat_body(*spec[:4], images=spec[4], size=spec[5])


def chat_bodies(specs: list[tuple], processes: int | None = None) -> list[dict]:
    """``serve_load.chat_body(model, seed, text, max_tokens, images=, size=)`` for each
    (model, seed, text, max_tokens, images, size), made in parallel: a 720p photo-like JPEG takes
    a fraction of a second, and a burst needs a hundred of them before it can start."""
    workers = processes or min(8, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=_context()) as pool:
        return list(pool.map(_chat_body, specs, chunksize=max(1, len(specs) // (4 * workers))))
