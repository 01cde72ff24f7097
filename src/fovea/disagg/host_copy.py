"""Copies between host tensors that keep the GIL.

The encoder pool's client thread writes each batch's pixels into shared memory while the
engine thread and the event loop run. Every torch call releases the GIL around its dispatch
and must retake it, and beside a thread that holds the GIL in one long C call (response
encoding, tokenizers, pydantic), retaking it waits for that whole call (bench/gil_releasing_calls.py
says which calls release it). A ``memmove`` called through ``ctypes.PYFUNCTYPE`` keeps the GIL
for the copy itself, about 0.08 ms for a 336 px bf16 image, far less than waiting to retake it:
beside a thread holding the GIL 24 ms per call, 21 images' pixels took 4,150 ms to write with
torch calls and 1.7 ms this way (bench/handoff_write_probe.py, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes

import torch

# PYFUNCTYPE: a foreign function called without releasing the GIL (CFUNCTYPE releases it).
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def copyable(src: torch.Tensor) -> bool:
    """A host tensor whose bytes lie in one run (numel, element_size, device and is_contiguous
    read attributes: none of them releases the GIL)."""
    return src.device.type == "cpu" and src.is_contiguous()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``src``'s bytes into ``dst`` (a flat uint8 host tensor of the same length), keeping the GIL."""
    n = nbytes(src)
    if not (copyable(src) and copyable(dst) and nbytes(dst) == n):
        raise ValueError(f"copy_bytes needs two contiguous host tensors of equal byte length "
                         f"({src.device}, {n} bytes into {dst.device}, {nbytes(dst)} bytes)")
    if n:
        _memmove(dst.data_ptr(), src.data_ptr(), n)
