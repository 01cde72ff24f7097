"""Weight-size estimates from safetensors headers, checked against the true tensor sizes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from fovea.errors import ModelLoadError
from fovea.guard.memory import estimate_serving_bytes, estimate_weight_bytes, read_safetensors_header


def tensors_a() -> dict[str, torch.Tensor]:
    return {
        "vision.proj.weight": torch.zeros(16, 8, dtype=torch.float32),
        "vision.proj.bias": torch.zeros(16, dtype=torch.float32),
        "lm.embed": torch.zeros(10, 4, dtype=torch.bfloat16),
    }


def tensors_b() -> dict[str, torch.Tensor]:
    return {
        "lm.head": torch.zeros(3, 5, 2, dtype=torch.float16),
        "position_ids": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(1.0, dtype=torch.float64),
    }


def true_bytes(*groups: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> int:
    total = 0
    for group in groups:
        for tensor in group.values():
            if cast is not None and tensor.is_floating_point():
                tensor = tensor.to(cast)
            total += tensor.numel() * tensor.element_size()
    return total


def test_single_file_matches_true_sum(tmp_path):
    save_file(tensors_a() | tensors_b(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert estimate_weight_bytes(tmp_path) == true_bytes(tensors_a(), tensors_b())
    assert estimate_weight_bytes(tmp_path) == (tmp_path / "model.safetensors").stat().st_size - 8 - len(
        read_header_bytes(tmp_path / "model.safetensors"))


def read_header_bytes(path) -> bytes:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data[8:8 + length]


def test_target_dtype_casts_floating_tensors_only(tmp_path):
    save_file(tensors_a() | tensors_b(), str(tmp_path / "model.safetensors"))
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert estimate_weight_bytes(tmp_path, dtype) == true_bytes(tensors_a(), tensors_b(), cast=dtype)
    by_name = estimate_weight_bytes(tmp_path, "bfloat16")
    assert by_name == true_bytes(tensors_a(), tensors_b(), cast=torch.bfloat16)


def test_sharded_index_matches_true_sum(tmp_path):
    save_file(tensors_a(), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(tensors_b(), str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors_a()}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in tensors_b()}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    # a stray file outside the index is not part of the model
    save_file({"junk": torch.zeros(1000)}, str(tmp_path / "optimizer.safetensors"))
    assert estimate_weight_bytes(tmp_path) == true_bytes(tensors_a(), tensors_b())
    as_f32 = estimate_weight_bytes(tmp_path, torch.float32)
    assert as_f32 == true_bytes(tensors_a(), tensors_b(), cast=torch.float32)


def test_missing_shard_raises(tmp_path):
    save_file(tensors_a(), str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        estimate_weight_bytes(tmp_path)


def test_no_safetensors_raises_model_load_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        estimate_weight_bytes(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        estimate_weight_bytes(tmp_path / "nowhere")


def test_corrupt_header_raises(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        estimate_weight_bytes(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ModelLoadError, match="corrupt"):
        estimate_weight_bytes(tmp_path)


def test_header_only_is_read(tmp_path):
    """A header whose data section is a lie still gives an estimate: no tensor byte is read."""
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "BF16", "shape": [1024, 1024], "data_offsets": [0, 2 * 1024 * 1024]},
                         "q": {"dtype": "F8_E4M3", "shape": [100], "data_offsets": [0, 100]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert set(read_safetensors_header(tmp_path / "model.safetensors")) == {"w", "q"}
    assert estimate_weight_bytes(tmp_path) == 2 * 1024 * 1024 + 100
    # fp8 (quantized) tensors keep their size when a dtype is asked for
    assert estimate_weight_bytes(tmp_path, torch.float32) == 4 * 1024 * 1024 + 100


def test_serving_bytes_adds_kv_and_margin(tmp_path):
    save_file(tensors_a(), str(tmp_path / "model.safetensors"))
    weights = true_bytes(tensors_a(), cast=torch.float16)
    assert estimate_serving_bytes(tmp_path, torch.float16) == weights + -(-weights * 2 // 10)
    assert estimate_serving_bytes(tmp_path, torch.float16, kv_cache_bytes=1000, activation_margin=0.0) == \
        weights + 1000
    with pytest.raises(ValueError):
        estimate_serving_bytes(tmp_path, None, kv_cache_bytes=-1)
