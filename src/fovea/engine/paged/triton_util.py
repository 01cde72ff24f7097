"""What the Triton kernel modules share: whether a kernel can run here, and tile sizing.

triton is imported lazily everywhere: fovea imports on machines without it (CPU serving,
CI), and the kernels are used only where ``available()`` says so.
"""

from __future__ import annotations

import argparse
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


def run_check(device: torch.device, check: Callable[[torch.device], float]) -> int:
    """The ``--check`` step of a kernel module's command line: ``check`` returns the worst
    error / tolerance over its cases; at most 1 passes. Returns the exit status."""
    if device.type == "cuda" and not available():
        print(f"FAIL: triton or CUDA missing (torch {torch.__version__}, cuda available: "
              f"{torch.cuda.is_available()})")
        return 1
    worst = check(device)
    print("PASS" if worst <= 1.0 else "FAIL", f"(worst error / tolerance = {worst:.3f})")
    return 0 if worst <= 1.0 else 1


def check_dtypes(device: torch.device) -> list[torch.dtype]:
    """The dtypes a kernel's ``--check`` covers: float32 on the CPU (triton's interpreter), all
    three on a GPU."""
    return [torch.float32] if device.type == "cpu" else [torch.float32, torch.bfloat16, torch.float16]


def kernel_main(argv: list[str] | None, description: str, check: Callable[[torch.device], float],
                timings: dict[str, tuple[str, Callable[[torch.device], None]]]) -> int:
    """The command line of a kernel module: ``--check`` (against torch) and one flag per
    timing in ``timings`` (name -> (help, function of the device)), on ``--device``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="compare with the torch reference")
    for name, (help_text, _) in timings.items():
        parser.add_argument(f"--{name}", action="store_true", help=help_text)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    chosen = [run for name, (_, run) in timings.items() if getattr(args, name)]
    if not args.check and not chosen:
        parser.print_help()
        return 2
    device = torch.device(args.device)
    status = run_check(device, check) if args.check else 0
    for run in chosen:
        run(device)
    return status


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
