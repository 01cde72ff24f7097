"""On a real GPU: the autotuners' timer measures the GPU's work with cold caches, not the launch.

Skipped without CUDA (CI has none); passed on the H200 on 2026-12-03 (docs/benchmarks.md).
"""

import pytest
import torch

from fovea.engine.kernels.triton_util import launch_time

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_choice_times_gpu_work_not_the_launch():
    """A candidate's time is its GPU time with cold caches: a copy of 8x the bytes takes several
    times longer (timed from the host one launch at a time, both were the launch's cost)."""
    small = [torch.empty(8 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    large = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    t_small = launch_time(lambda: small[0].copy_(small[1]))
    t_large = launch_time(lambda: large[0].copy_(large[1]))
    assert 0 < t_small and 3 * t_small < t_large, (t_small, t_large)
