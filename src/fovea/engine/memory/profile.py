"""Reading a CUDA device's memory, and measuring what one phase of start-up holds or peaks at.

Every measurement starts from a settled allocator (synchronized, cached blocks released), so
torch's reserved bytes are what live tensors hold, and reads the peak of reserved bytes (not of
allocated ones): fragmentation is part of what a step costs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._nvml_handle = _nvml_handle(device)

    def process_used(self) -> int | None:
        """Device memory this process holds (NVML), context included; None where NVML cannot say
        (no driver library, or another PID namespace: a container's PIDs are not the host's)."""
        if self._nvml_handle is None:
            return None
        import pynvml

        try:
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml_handle)
        except pynvml.NVMLError:
            return None
        own = [p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory is not None]
        return int(own[0]) if own else None

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
    """Bytes of a module's parameters and buffers, each storage counted once (fused weights are views),
    and of its quantized layers' weights (``QuantLinear.quant``: tensors that are not parameters)."""
    storages: dict[int, int] = {}
    quantized = [t for m in module.modules() if getattr(m, "quant", None) is not None
                 for t in vars(m.quant).values() if isinstance(t, torch.Tensor)]
    for tensor in [*module.parameters(), *module.buffers(), *quantized]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _nvml_handle(device: torch.device):
    """NVML's handle of the GPU behind ``device`` (found by UUID: CUDA_VISIBLE_DEVICES renumbers),
    or None where NVML is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            found = pynvml.nvmlDeviceGetUUID(handle)
            found = found.decode() if isinstance(found, bytes) else found
            if found.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
                return handle
    except Exception:  # noqa: BLE001 - no NVML: the planner measures device-wide instead
        return None
    return None
