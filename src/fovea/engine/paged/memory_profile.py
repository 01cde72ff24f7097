"""Reading a CUDA device's memory, and measuring what one phase of start-up holds or peaks at.

Every measurement starts from a settled allocator (synchronized, cached blocks released), so
torch's reserved bytes are what live tensors hold, and reads the peak of reserved bytes (not of
allocated ones): fragmentation is part of what a step costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def settle(self) -> None:
        self.sync()
        torch.cuda.empty_cache()

    def free_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def used(self) -> int:
        free, total = self.free_total()
        return total - free

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


def measure(meter: CudaMeter, fn: Callable[[], T]) -> tuple[T, int, int]:
    """Run ``fn``: (its result, bytes it still holds once settled, its peak above the start)."""
    meter.settle()
    base = meter.reserved()
    meter.reset_peak()
    result = fn()
    meter.sync()
    peak = meter.peak_reserved() - base
    meter.settle()
    return result, max(0, meter.reserved() - base), max(0, peak)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once (fused weights are views)."""
    storages: dict[int, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
