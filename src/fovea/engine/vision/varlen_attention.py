"""Bidirectional attention over packed variable-length chunks (a vision tower's windows and images).

q, k, v are [T, H, D]: the chunks' tokens one after another, ``cu_seqlens`` their boundaries
([n + 1] int32 on the device, starting at 0). Each token attends to its own chunk's tokens
only, and the [T, T] (or per-chunk) score matrix is never materialised.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from fovea.models.qwen_vision_attention import grouped_attention

log = logging.getLogger("fovea.engine")

VARLEN, FLASH, GROUPED = "varlen", "flash", "grouped"
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _varlen(q, k, v, cu, cu_host, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale)


def _flash(q, k, v, cu, cu_host, max_len, scale):
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, False, False, scale=scale)
    return out[0]


def _grouped(q, k, v, cu, cu_host, max_len, scale, cache=None):
    return grouped_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu_host, scale, cache)


def _runs(fn: Callable, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``fn`` runs and agrees with SDPA on two small chunks (its signature, the GPU's
    flash support for this head size and dtype)."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(24, 2, head_dim, generator=gen, device=device, dtype=dtype) for _ in range(3))
        cu_host = [0, 9, 24]
        cu = torch.tensor(cu_host, dtype=torch.int32, device=device)
        scale = head_dim ** -0.5
        got = fn(q, k, v, cu, cu_host, 15, scale)
        ref = _grouped(q, k, v, cu, cu_host, 15, scale)
        return bool(got.shape == ref.shape and torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2))
    except Exception as exc:  # noqa: BLE001 - any failure means: try the next backend
        log.debug("varlen attention backend %s does not run here: %s", getattr(fn, "__name__", fn), exc)
        return False


@functools.cache
def varlen_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Which attention runs the packed chunks on this device, dtype and head size:

    - ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10: FlashAttention-2
      over cu_seqlens; CUDA, float16/bfloat16, head_dim a multiple of 8 up to 256, as
      Qwen2.5-VL's 80 and Qwen3-VL's 72);
    - ``flash``: ``torch.ops.aten._flash_attention_forward`` with cu_seqlens, the same kernel,
      where torch has no ``varlen`` module;
    - ``grouped``: chunks of one length batched into one SDPA call each
      (``models.qwen_vision_attention``): off CUDA, in float32, or where flash does not run.
      SDPA picks its own memory-efficient kernel on CUDA, so scores are not materialised there
      either.

    Each candidate is tried once on a small input before it is chosen."""
    if device.type == "cuda" and dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256:
        for name, fn in ((VARLEN, _varlen), (FLASH, _flash)):
            if _runs(fn, device, dtype, head_dim):
                return name
    return GROUPED


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     cu_host: list[int], max_len: int, scale: float, backend: str,
                     cache: dict | None = None) -> torch.Tensor:
    """[T, H, D] q, k, v -> [T, H, D], each token attending within its chunk. ``cu_host`` is
    ``cu_seqlens`` on the host (the grouped backend's layout); ``cache`` keeps that backend's
    index tensors per layout."""
    if backend == VARLEN:
        return _varlen(q, k, v, cu_seqlens, cu_host, max_len, scale)
    if backend == FLASH:
        return _flash(q, k, v, cu_seqlens, cu_host, max_len, scale)
    return _grouped(q, k, v, cu_seqlens, cu_host, max_len, scale, cache)
