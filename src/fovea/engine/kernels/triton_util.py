"""What the Triton kernel modules share: whether a kernel can run here, tile sizing, a CUDA
timer for benchmarks and the autotuners' timer (``launch_time``).

triton is imported lazily everywhere: fovea imports on machines without it (CPU serving,
CI), and the kernels are used only where ``available()`` says so.
"""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Callable

import torch

log = logging.getLogger("fovea.engine.paged")


def available() -> bool:
    """CUDA is present and triton imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, (x - 1).bit_length())


def time_cuda(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` CUDA-event timings after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


GRAPH_REPS = 20  # launches per timed graph
GRAPH_REPLAYS = 5  # timed replays per graph (median)
_HOST_TIMING: list[str] = []  # the error of a failed timing capture: timed from the host after one
_FLUSH_MS: dict[int, float] = {}  # device -> ms of one graph of the L2-sized writes alone


def launch_time(launch: Callable[[], object]) -> float:
    """Milliseconds of GPU time per ``launch()``, as a decode step sees it: each launch follows a
    write of twice the L2's size (its weights come from HBM, as they do when a step streams every
    layer's), ``GRAPH_REPS`` of them captured in one CUDA graph (the host's launch cost, tens of
    microseconds per Triton launch, would otherwise be most of what is timed), less the writes
    alone (a graph of them, timed once per device). Timing each launch by itself from the host
    (triton's do_bench) chose nearly at random among kernels of 10-50 us (bench/quant_matmul.py
    --sweep, 2026-12-03: 2x off on some 7B shapes). The autotuners' timer; where no CUDA device is available, do_bench.
    A launch that cannot run raises from its first, uncaptured call."""
    launch()
    if torch.cuda.is_available() and not _HOST_TIMING:
        try:
            return _graph_time(launch)
        except RuntimeError as exc:  # a capture this torch or another thread's work refused: from the host
            _HOST_TIMING.append(str(exc))
            log.warning("timing kernel launches in a CUDA graph failed (%s); the kernel choices are timed from the "
                        "host from now on, which is less exact", str(exc).splitlines()[0][:200])
    import triton

    return triton.testing.do_bench(launch, warmup=5, rep=20)


def _graph_time(launch: Callable[[], object]) -> float:
    device = torch.cuda.current_device()
    flush = _flush_buffer(device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with_launches = _captured(stream, lambda: (flush.zero_(), launch()))
        timed = _replay_ms(with_launches)
        del with_launches
    finally:
        torch.cuda.current_stream().wait_stream(stream)
    if device not in _FLUSH_MS:  # the writes alone: the same on every call, timed once
        _FLUSH_MS[device] = _replay_ms(_captured(stream, flush.zero_))
        torch.cuda.current_stream().wait_stream(stream)
    return max(timed - _FLUSH_MS[device], 0.0) / GRAPH_REPS


def _captured(stream: torch.cuda.Stream, body: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``GRAPH_REPS`` calls of ``body`` captured on ``stream``. Not ``torch.cuda.graph``: that
    synchronises the device and empties the allocator's cache on every entry (and, in some torch
    versions or settings, collects garbage), twice per candidate with the flush graph; with it,
    FP8's 7B kernel choices took 17.9 s on the H200, 7.8-14.7 s with this capture on three fresh
    machines (docs/benchmarks.md, 2026-12-03 night). thread_local: the engine core checks the vision stage in
    another thread meanwhile, whose allocations a global capture would refuse."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(GRAPH_REPS):
                body()
        finally:
            graph.capture_end()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    return 1e3 * time_cuda(graph.replay, reps=GRAPH_REPLAYS, warmup=1)


@functools.cache
def _flush_buffer(device_index: int) -> torch.Tensor:
    """Twice the L2's size, written before each timed launch: kept for the process (the
    autotuners run at start-up, before the memory plan is measured, so it is inside the plan)."""
    return torch.empty(2 * _l2_bytes(device_index), dtype=torch.uint8, device=torch.device("cuda", device_index))


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0) or 64 << 20)
