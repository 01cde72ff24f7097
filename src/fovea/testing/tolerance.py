"""Floating-point tolerances derived from the computation, not from one machine's observed error.

Two correct implementations of the same float computation (a Triton kernel and torch's op, an
AVX-512 kernel and a scalar one, one thread and many) differ only by rounding, and rounding
depends on the order of summation, which depends on the CPU, the thread count and the
library. A tolerance read off one machine's error is not a property of the code; one derived
from the dtype and the size of the computation is:

- Each addition in a sum rounds with relative error at most ``eps`` of its partial sum. For
  terms of random sign the partial sums and the result both grow like ``sqrt(n)``, and the n
  rounding errors add like a random walk, so the error of a length-``n`` sum or dot product is
  about ``eps · sqrt(n) · |result|`` whatever the order (pairwise or blocked orders only do
  better).
- A chain of such computations (a network's layers) adds their errors the same way: ``n`` is
  then the total reduction length along the path (``decoder_path_len``).
- Values stored in a narrower dtype than the one that accumulates (bf16 inputs, fp32
  accumulators) add one rounding of that dtype, ``eps(storage) · |result|``, which does not
  grow with ``n``.
- ``K = 8`` covers both sides (two implementations, each with its own error: ``sqrt(2)``) and
  the largest of up to ~10^7 compared elements, whose errors are roughly Gaussian
  (``sqrt(2 ln 1e7) ≈ 5.7``): ``sqrt(2) · 5.7 ≈ 8``.

The scale is the largest magnitude of the reference result, so a tensor of large values
gets a proportionally larger tolerance and a tensor of small values a small one. Results that
are exact by construction (integers, copies, a bit-exact kernel) are compared with
``torch.equal``, not with this.
"""

from __future__ import annotations

import math

import torch

K = 8.0


def eps(dtype: torch.dtype) -> float:
    """The gap between 1 and the next representable number of ``dtype``."""
    return torch.finfo(dtype).eps


def reduction_atol(dtype: torch.dtype, n: int, scale: float, *, storage: torch.dtype | None = None,
                   k: float = K) -> float:
    """The absolute tolerance for a result of magnitude up to ``scale`` computed by reductions of
    total length ``n`` accumulated in ``dtype`` (and stored in ``storage``, if narrower):
    ``k · (eps(dtype) · sqrt(n) + eps(storage)) · scale``."""
    stored = eps(storage) if storage is not None and eps(storage) > eps(dtype) else 0.0
    return k * (eps(dtype) * math.sqrt(max(n, 1)) + stored) * float(scale)


def decoder_path_len(hidden: int, intermediate: int, layers: int, context: int, heads: int = 1,
                     head_dim: int | None = None) -> int:
    """The total reduction length along a Llama-style decoder, embeddings to logits: per layer two
    RMS norms, the q/k/v projection, the attention scores, the softmax and its weighted sum over
    ``context`` tokens, the output projection, gate/up and down; then the final norm and the
    LM head."""
    head_dim = head_dim or hidden // max(heads, 1)
    per_layer = 2 * hidden + hidden + head_dim + 2 * context + heads * head_dim + hidden + intermediate
    return layers * per_layer + 2 * hidden


def decoder_path_len_of(text_config, context: int, layers: int | None = None) -> int:
    """``decoder_path_len`` from a transformers text config (Llama, Qwen2, Qwen3, Mistral...),
    through its first ``layers`` layers (all by default)."""
    heads = text_config.num_attention_heads
    return decoder_path_len(text_config.hidden_size, text_config.intermediate_size,
                            text_config.num_hidden_layers if layers is None else layers, context, heads,
                            getattr(text_config, "head_dim", None))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest absolute difference (NaN where either holds one, so that it fails any bound)."""
    diff = (actual.double() - expected.double()).abs()
    return float("nan") if diff.isnan().any() else float(diff.max()) if diff.numel() else 0.0


def assert_close_for(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, reduction_len: int, *,
                     storage: torch.dtype | None = None, scale: float | None = None, k: float = K,
                     what: str = "") -> None:
    """Assert ``actual`` equals ``expected`` up to ``reduction_atol``; the scale is ``max|expected|``
    unless given (give it where the result is a difference of larger values, as log-softmax is)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if scale is None:
        scale = float(expected.abs().max()) if expected.numel() else 0.0
    atol = reduction_atol(dtype, reduction_len, scale, storage=storage, k=k)
    err = max_error(actual, expected)
    stored = f" + eps({storage})" if storage is not None else ""
    assert err <= atol, (f"{what + ': ' if what else ''}max error {err:.3g} exceeds {atol:.3g} = "
                         f"{k:g}·(eps({dtype})·sqrt({reduction_len}){stored})·{scale:.3g}")
