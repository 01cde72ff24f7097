"""Quantized test checkpoints, made by the formats' own tools from the tiny random directories.

``quantized_dir(family, scheme)`` returns a directory, written on first use and kept for the
session: the family's tiny bf16 directory (``write_model_dir(arch="tiny")``) quantized by
``fovea.testing.quantized``: with compressed-tensors (``fp8-dynamic``, ``w4a16``, ``w4a16-asym``,
as llmcompressor's QuantizationModifier writes them; llmcompressor itself is not a dependency) or
transformers' own FP8 op (``fp8-block``). The tiny models are 32-256 wide, so W4A16's groups are
32 columns and the FP8 blocks 32 x 32 (the released checkpoints' 128 would leave one group or
block per row). Each takes a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fovea.testing import quantized, random_llava, random_qwen2_5_vl, random_qwen3_vl

FAMILIES = {"llava": random_llava, "qwen2_5_vl": random_qwen2_5_vl, "qwen3_vl": random_qwen3_vl}
SCHEMES = quantized.SCHEMES  # fp8-dynamic, w4a16, w4a16-asym (compressed-tensors), fp8-block (Qwen's FP8)
GROUP_SIZE = quantized.TINY_GROUP_SIZE
BLOCK = quantized.TINY_BLOCK


@pytest.fixture(scope="session")
def source_dir(tmp_path_factory) -> Callable[[str], Path]:
    """``source_dir(family)``: the family's tiny random bf16 directory (seed 0), written once."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = FAMILIES[family].write_model_dir(tmp_path_factory.mktemp(family), arch="tiny", seed=0)
        return made[family]

    return get


@pytest.fixture(scope="session")
def quantized_dir(tmp_path_factory, source_dir) -> Callable[[str, str], Path]:
    """``quantized_dir(family, scheme)``: that family's directory quantized in that scheme, written once."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, scheme: str) -> Path:
        if (family, scheme) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{scheme}")
            made[family, scheme] = quantized.write_quantized(source_dir(family), out, scheme, GROUP_SIZE, BLOCK)
        return made[family, scheme]

    return get
