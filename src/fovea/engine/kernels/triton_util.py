"""What the Triton kernel modules share: whether a kernel can run here, tile sizing, and a
CUDA timer for benchmarks.

triton is imported lazily everywhere: fovea imports on machines without it (CPU serving,
CI), and the kernels are used only where ``available()`` says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


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
