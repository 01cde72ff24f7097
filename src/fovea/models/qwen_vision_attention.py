"""Qwen2.5-VL's vision attention over many windows and images in a few SDPA calls.

Without flash-attention, transformers runs the tower's attention once per ``cu_seqlens``
chunk: every 8x8-patch window of every image is its own SDPA call, 28 window layers of 64
windows per 896 px image, so a batch of 8 such images launches ~14,000 small attention
calls and the GPU waits on the host. Here chunks of equal length (all the inner windows,
and whole images of one size) go into one batched SDPA call each: a handful of calls per
layer. Same arithmetic per chunk: the rows a query attends to are exactly its chunk's.

``grouped`` swaps the forward of each block's attention module for the duration of a call.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import types
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def chunk_groups(cu_seqlens: list[int], device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """[(length, token indices [n_chunks * length])] for each chunk length present."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in itertools.pairwise(cu_seqlens):
        if end > start:
            by_length[end - start].append(start)
    groups = []
    for length, starts in by_length.items():
        index = (torch.tensor(starts).unsqueeze(1) + torch.arange(length).unsqueeze(0)).reshape(-1)
        groups.append((length, index.to(device)))
    return groups


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                      scale: float, cache: dict | None = None) -> torch.Tensor:
    """q, k, v: [heads, T, d] -> [T, heads, d], each token attending within its chunk."""
    key = tuple(cu_seqlens)
    groups = cache.get(key) if cache is not None else None
    if groups is None:
        groups = chunk_groups(cu_seqlens, q.device)
        if cache is not None:
            cache[key] = groups
    heads, tokens, dim = q.shape
    if len(groups) == 1 and groups[0][1].numel() == tokens and groups[0][0] == tokens:
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=scale)[0]
        return out.transpose(0, 1)
    out = q.new_empty((tokens, heads, dim))
    for length, index in groups:
        n = index.numel() // length
        qg, kg, vg = (t[:, index].view(heads, n, length, dim).transpose(0, 1) for t in (q, k, v))
        got = F.scaled_dot_product_attention(qg, kg, vg, scale=scale)  # [n, heads, L, d]
        out[index] = got.transpose(1, 2).reshape(n * length, heads, dim)
    return out


def _forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, max_seqlen: int | None = None,
             **kwargs) -> torch.Tensor:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    seq_length = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    bounds = cu_seqlens.tolist()  # one host read per layer: the chunk layout of this batch
    out = grouped_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), bounds, self.scaling,
                            self._fovea_groups)
    return self.proj(out.reshape(seq_length, -1))


MAX_LAYOUTS = 256  # chunk layouts remembered per tower (a layout per batch shape)
_LOCK = threading.Lock()


def _supported(visual: torch.nn.Module) -> bool:
    blocks = getattr(visual, "blocks", None)
    return bool(blocks) and all(hasattr(b, "attn") and all(hasattr(b.attn, n) for n in ("qkv", "proj", "num_heads",
                                                                                           "scaling"))
                                for b in blocks)


@contextlib.contextmanager
def grouped(visual: torch.nn.Module) -> Iterator[bool]:
    """Within the block, the tower's attention runs grouped (yields False, and changes nothing,
    for a tower whose blocks are not the attention this was written for). Outside it the
    modules are transformers' own again: the reference that tests compare against."""
    if not _supported(visual):
        yield False
        return
    with _LOCK:  # the engine's thread and a grounding request may encode at once
        layouts = visual.__dict__.setdefault("_fovea_layouts", {})
        if len(layouts) > MAX_LAYOUTS:
            layouts.clear()
        depth = visual.__dict__.get("_fovea_grouped_depth", 0)
        if depth == 0:
            for block in visual.blocks:
                block.attn._fovea_groups = layouts
                block.attn.forward = types.MethodType(_forward, block.attn)
        visual.__dict__["_fovea_grouped_depth"] = depth + 1
    try:
        yield True
    finally:
        with _LOCK:
            visual.__dict__["_fovea_grouped_depth"] -= 1
            if visual.__dict__["_fovea_grouped_depth"] == 0:
                for block in visual.blocks:
                    block.attn.__dict__.pop("forward", None)
