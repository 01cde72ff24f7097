"""Activations handed to an FP8 product already quantised by the kernels that produced them.

An FP8 checkpoint with dynamic activations (compressed-tensors FP8_DYNAMIC, Qwen's fine-grained
FP8) quantises each product's input per token, or per token and group of ``bk`` columns, before
the product: a launch of ``fp8_quantize``'s kernel, one program a row, four a layer. In the fused
forward three of those inputs come from kernels that can hand them on quantised instead:

- RMSNorm (the inputs of q/k/v and of gate/up) holds each row whole and writes the e4m3 codes and
  the scales in its own launch;
- SiLU * up (the input of down) takes a row in blocks of many programs: groups that fit a block
  are quantised there; one scale a row needs the whole row's maximum, so the blocks write their
  values and largest magnitudes and a second launch, as many programs again, quantises them.

On an H100 this took the 7B shape's FP8 decode from 3.95 to 3.74 ms/token (docs/benchmarks.md,
2026-12-07). The codes and scales are bit for bit those that ``quantize_per_token_group`` makes
from the producers' outputs in the model dtype (the tests check this in the interpreter and on
a GPU, the engine at start-up on its device), so the products' results do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovea.engine.kernels.triton_util import next_pow2


@dataclass(frozen=True, slots=True)
class Fp8Activation:
    """``q`` float8_e4m3fn [M, K] and ``scale`` float32 [M, cdiv(K, group)]: x[m, k] ~= q[m, k] *
    scale[m, k // group] (``group`` >= K: one scale a row). ``dtype`` is the model dtype of the values
    quantised, which the product's output takes."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def kernel_group(group: int, cols: int) -> int | None:
    """The group a producer kernel holding a row of ``cols`` columns in next_pow2(cols) lanes
    quantises by: all its lanes for one scale a row (``group`` >= ``cols``); ``group`` where it is a
    power of 2 (the row's lanes are then whole groups); None where it cannot (that product keeps its
    own quantiser)."""
    block = next_pow2(cols)
    if group >= cols:
        return block
    if group & (group - 1) == 0 and 1 <= group <= block:
        return group
    return None
