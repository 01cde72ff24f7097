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
  then the total reduction length along the path (``transformer_path_len``).
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


def attention_path_len(head_dim: int, context: int) -> int:
    """Attention's reductions: the scores (``head_dim``), then the softmax's sum and the weighted
    sum of values, each over ``context`` keys."""
    return head_dim + 2 * context


def transformer_path_len(hidden: int, intermediate: int, layers: int, context: int, heads: int = 1,
                         head_dim: int | None = None) -> int:
    """The total reduction length along a transformer (a Llama-style decoder, a ViT): per layer two
    norms, the q/k/v projection, the attention scores, the softmax and its weighted sum over
    ``context`` tokens, the output projection, the MLP's first and second projections; then a
    final norm and one projection (an LM head, a projector's first linear)."""
    head_dim = head_dim or hidden // max(heads, 1)
    norms, qkv, out, mlp = 2 * hidden, hidden, heads * head_dim, hidden + intermediate
    per_layer = norms + qkv + attention_path_len(head_dim, context) + out + mlp
    return layers * per_layer + 2 * hidden


def path_len_of(config, context: int, layers: int | None = None) -> int:
    """``transformer_path_len`` from a transformers config (a text config: Llama, Qwen2, Qwen3,
    Mistral; a vision config: CLIP, SigLIP, Qwen's ``depth``/``num_heads``), through its first
    ``layers`` layers (all by default)."""
    depth = getattr(config, "num_hidden_layers", None) or config.depth
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    layers = depth if layers is None else layers
    return transformer_path_len(config.hidden_size, config.intermediate_size, layers, context, heads,
                                getattr(config, "head_dim", None))


def tower_path_len(vision_config, tokens: int, layers: int | None = None) -> int:
    """A vision tower (CLIP, SigLIP, Qwen's): the patch embedding, then its layers over ``tokens``."""
    channels = getattr(vision_config, "num_channels", None) or getattr(vision_config, "in_channels", 3)
    embed = channels * getattr(vision_config, "temporal_patch_size", 1) * vision_config.patch_size ** 2
    return embed + path_len_of(vision_config, tokens, layers)


def vision_path_len(config, tokens: int | None = None, layers: int | None = None) -> int:
    """A VLM's vision stage, from the model's config: the tower over ``tokens`` patches (by default
    the one image size's, as LLaVA-1.5 has), through its first ``layers`` layers, or all of them
    and then the projector."""
    vision = config.vision_config
    if tokens is None:
        tokens = (vision.image_size // vision.patch_size) ** 2 + 1
    projector = config.text_config.hidden_size if layers is None else 0
    return tower_path_len(vision, tokens, layers) + projector


def model_path_len(config, context: int) -> int:
    """A whole VLM, pixels to logits, for a prompt of ``context`` tokens: the vision stage (over up
    to four patches per prompt token, as a 2x2 merge makes: an upper estimate is safe, the bound
    grows as its square root) and the decoder."""
    text = getattr(config, "text_config", config)
    seen = vision_path_len(config, 4 * context) if getattr(config, "vision_config", None) is not None else 0
    return seen + path_len_of(text, context)


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


def assert_close_to_model(actual: torch.Tensor, expected: torch.Tensor, config, context: int, *,
                          scale: float | None = None, what: str = "") -> None:
    """``assert_close_for`` for a whole float32 VLM forward (``model_path_len``): an engine's logits
    or log-probabilities against transformers' own. Pass the whole distribution's ``scale`` when
    comparing a few of its log-probabilities: their error is the logits', whatever their own size."""
    assert_close_for(actual, expected, torch.float32, model_path_len(config, context), scale=scale, what=what)


def api_logprobs_atol(config, context: int, values: list[float]) -> float:
    """The tolerance for float32 log-probabilities read from the API, where the logits are not seen:
    their error is the logits' (``model_path_len``), whose scale the largest returned magnitude
    stands for, and at least one nat (a confident answer's log-probabilities are all near 0 while
    its logits are not)."""
    scale = max([1.0, *(abs(v) for v in values)])
    return reduction_atol(torch.float32, model_path_len(config, context), scale)
