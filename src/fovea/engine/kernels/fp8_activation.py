"""Activations handed to an FP8 product already quantised by the kernel that produced them.

An FP8 checkpoint with dynamic activations (compressed-tensors FP8_DYNAMIC, Qwen's fine-grained
FP8) quantises each product's input per token, or per token and group of ``bk`` columns, before
the product. In the fused forward that input comes from a kernel that holds each row whole:
RMSNorm (the inputs of q/k/v and of gate/up) and SiLU * up (the input of down). Quantising there
writes the e4m3 codes and scales in the same launch, instead of writing the row in the model
dtype and launching ``fp8_quantize``'s kernel to read it back: at one row a quantiser's launch
costs about as much as a small product's (5.5 us on the H200, 2026-12-03), three of the four a
layer. The codes and scales are bit for bit those that ``quantize_per_token_group`` makes from
the producer's output in the model dtype (the tests check this in the interpreter, and the
engine's start-up check on its device), so the products' results do not change.
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
