"""How much memory a model directory needs, read from safetensors headers alone.

A safetensors file starts with an 8-byte little-endian header length and a JSON header that
gives every tensor's dtype and shape, so the weight size is known without reading a tensor.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from fovea.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

# bits per element of each safetensors dtype
_BITS = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16,
    "I64": 64, "I32": 32, "I16": 16, "I8": 8,
    "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
    "C64": 64,
}
# stored dtypes a load-time ``torch_dtype`` casts; quantized (fp8/fp6/fp4) and integer tensors keep theirs
_CASTABLE = {"F64", "F32", "F16", "BF16"}
_MAX_HEADER = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor entries of one file's header (``__metadata__`` left out), reading no tensor data."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise ModelLoadError(f"{path} is not a safetensors file: it is shorter than 8 bytes")
            (length,) = struct.unpack("<Q", prefix)
            size = path.stat().st_size
            if length > _MAX_HEADER or 8 + length > size:
                raise ModelLoadError(f"{path} is not a safetensors file: header length {length} "
                                     f"does not fit a {size}-byte file")
            raw = handle.read(length)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} has a corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} has a corrupt safetensors header: not a JSON object")
    return {name: info for name, info in header.items() if name != "__metadata__"}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by ``model.safetensors.index.json``, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    index = model_dir / INDEX_NAME
    indexes = [index] if index.is_file() else sorted(model_dir.glob("*.safetensors.index.json"))
    if indexes:
        files: dict[str, None] = {}
        for path in indexes:
            try:
                weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelLoadError(f"{path} is not a valid safetensors index: {exc}") from exc
            files.update(dict.fromkeys(weight_map.values()))
        paths = [model_dir / name for name in files]
        missing = [str(p.name) for p in paths if not p.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shard(s) named in the index are missing: "
                                 f"{', '.join(missing)}")
        return paths
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"no safetensors weights in {model_dir}: fovea needs model.safetensors "
                             f"or shards listed in {INDEX_NAME}")
    return paths


def _target_bits(dtype: torch.dtype | str | None) -> int | None:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        import torch

        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype!r}")
        dtype = resolved
    return dtype.itemsize * 8


def estimate_weight_bytes(model_dir: Path, dtype: torch.dtype | None = None) -> int:
    """Bytes the weights take once loaded: stored sizes, or ``dtype``'s for floating-point tensors.

    With ``dtype`` set, F64/F32/F16/BF16 tensors count at that dtype's size (as a load with
    ``torch_dtype`` casts them); integer and fp8/fp6/fp4 (quantized) tensors keep their stored size.
    """
    target = _target_bits(dtype)
    total = 0
    for path in safetensors_files(Path(model_dir)):
        for name, info in read_safetensors_header(path).items():
            try:
                stored, shape = info["dtype"], info["shape"]
                numel = math.prod(int(n) for n in shape)
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelLoadError(f"{path}: tensor {name!r} has a malformed header entry") from exc
            if stored not in _BITS:
                raise ModelLoadError(f"{path}: tensor {name!r} has unknown dtype {stored!r}")
            bits = target if target is not None and stored in _CASTABLE else _BITS[stored]
            total += (numel * bits + 7) // 8
    return total


def estimate_serving_bytes(model_dir: Path, dtype: torch.dtype | None, kv_cache_bytes: int = 0,
                           activation_margin: float = 0.2) -> int:
    """Weights + the KV-cache budget + ``activation_margin`` × weights for activations and workspace."""
    if kv_cache_bytes < 0:
        raise ValueError("kv_cache_bytes must be >= 0")
    if activation_margin < 0:
        raise ValueError("activation_margin must be >= 0")
    weights = estimate_weight_bytes(model_dir, dtype)
    return weights + int(kv_cache_bytes) + math.ceil(weights * activation_margin)
