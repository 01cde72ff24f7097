"""An encode worker's memory, sized by need: its vision weights, its measured peak, a margin.

Dynamo's encode worker inherited a 0.9 ``gpu_memory_utilization`` precheck and died on any GPU
another worker shared. fovea's asks for what it needs: before loading, the vision weights
(their bytes in the serving dtype, from the safetensors headers) plus the margin must fit in
what is free; after loading, a batch of the largest images it will be sent is encoded once and
the peak is measured (CUDA). A worker that does not fit refuses with need against free.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fovea.errors import FoveaError

GiB = 1024**3
MARGIN_BYTES = 256 * 1024**2  # the caching allocator's fragmentation, and the CUDA context's growth
SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1}


class EncoderMemoryError(FoveaError):
    status, code, type = 500, "insufficient_memory", "server_error"


@dataclass
class EncoderPlan:
    device: str
    weights_bytes: int
    activation_bytes: int | None  # the measured peak of the largest batch (CUDA); None: not measured
    margin_bytes: int
    batch_images: int
    free_bytes: int | None  # free on the device before this worker loaded (CUDA)

    @property
    def need_bytes(self) -> int:
        return self.weights_bytes + (self.activation_bytes or 0) + self.margin_bytes

    def render(self) -> str:
        peak = (f"{self.activation_bytes / GiB:.2f} GiB peak of {self.batch_images} largest image(s)"
                if self.activation_bytes is not None else "activation peak not measured on this device")
        free = f", {self.free_bytes / GiB:.2f} GiB were free" if self.free_bytes is not None else ""
        return (f"encode worker on {self.device} needs {self.need_bytes / GiB:.2f} GiB: vision weights "
                f"{self.weights_bytes / GiB:.2f}, {peak}, margin {self.margin_bytes / GiB:.2f}{free}")

    def to_dict(self) -> dict:
        return {**asdict(self), "need_bytes": self.need_bytes}


def header_bytes(files: dict[str, Path], names: list[str], dtype: torch.dtype) -> int:
    """Bytes of the named checkpoint tensors once cast to ``dtype`` (floating ones), read from the
    safetensors headers: nothing is loaded."""
    headers: dict[Path, dict] = {}
    total = 0
    for name in names:
        file = files[name]
        if file not in headers:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                headers[file] = json.loads(f.read(size))
        entry = headers[file][name]
        count = 1
        for dim in entry["shape"]:
            count *= dim
        floating = entry["dtype"] in ("F32", "F16", "BF16", "F64")
        total += count * (dtype.itemsize if floating else SAFETENSORS_BYTES[entry["dtype"]])
    return total


def refuse_unless_fits(need: int, free: int, what: str) -> None:
    if need > free:
        raise EncoderMemoryError(
            f"the encode worker does not fit: {what} needs {need / GiB:.2f} GiB and only {free / GiB:.2f} GiB "
            "is free on its GPU; free memory there (another process holds it), lower --gpu-memory-utilization "
            "of the prefill/decode worker, or give the encode worker another GPU")
