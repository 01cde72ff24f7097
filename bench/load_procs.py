"""A load generator in processes of its own, so that the client is never the bottleneck.

One Python process cannot both parse 128 SSE streams and build the next requests without
its event loop adding to the latencies it measures. Here ``burst`` splits the requests over
``processes`` worker processes, each with its own event loop and HTTP client; they wait at a barrier and start together, so the wall time
is from that start to the last answer. Every request is checked as ``serve_load.stream_one``
checks it (finish_reason "length", the asked token count, ``[DONE]``); failures are counted.

    results, wall_s = burst(url, bodies, processes=4)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor

import serve_load as load


def _context():
    """Forked children: a spawned one re-imports the benchmark's main module, and with it torch and
    transformers (14 s each on the H200 machine, 8 at once); the children never touch CUDA."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _worker(url: str, bodies: list[dict], barrier, out) -> None:
    async def run() -> tuple[list[load.Result], float]:
        async with load.client(len(bodies)) as c:
            barrier.wait()
            started = time.time()
            results = await asyncio.gather(*(load.stream_one(c, url, b) for b in bodies))
            return list(results), started

    results, started = asyncio.run(run())
    out.put((started, time.time(), [(r.ok, r.ttft_s, r.total_s, r.tokens, r.error) for r in results]))


def burst(url: str, bodies: list[dict], processes: int = 4, timeout_s: float = 900) -> tuple[list[load.Result], float]:
    """All ``bodies`` at once from ``processes`` processes: (every result, wall seconds)."""
    processes = max(1, min(processes, len(bodies)))
    ctx = _context()
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    shares = [bodies[i::processes] for i in range(processes)]
    procs = [ctx.Process(target=_worker, args=(url, share, barrier, out), daemon=True) for share in shares]
    for p in procs:
        p.start()
    reports = [out.get(timeout=timeout_s) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    start = min(r[0] for r in reports)
    end = max(r[1] for r in reports)
    results = [load.Result(*fields) for r in reports for fields in r[2]]
    return results, end - start


def _chat_body(spec: tuple) -> dict:
    return load.chat_body(*spec[:4], images=spec[4], size=spec[5])


def chat_bodies(specs: list[tuple], processes: int | None = None) -> list[dict]:
    """``serve_load.chat_body(model, seed, text, max_tokens, images=, size=)`` for each
    (model, seed, text, max_tokens, images, size), made in parallel: a 720p photo-like JPEG takes
    a fraction of a second, and a burst needs a hundred of them before it can start."""
    workers = processes or min(8, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=_context()) as pool:
        return list(pool.map(_chat_body, specs, chunksize=max(1, len(specs) // (4 * workers))))
