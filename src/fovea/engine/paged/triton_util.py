"""What the Triton kernel modules share: whether a kernel can run here, and tile sizing.

triton is imported lazily everywhere: fovea imports on machines without it (CPU serving,
CI), and the kernels are used only where ``available()`` says so.
"""

from __future__ import annotations

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
