"""Attention over the paged KV cache, through a backend chosen once at start-up
(``attention_backend``): ``triton`` (fovea's kernels, CUDA) or ``torch`` (SDPA, anywhere)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fovea.engine.transfer import to_device


@dataclass(slots=True)
class PrefillSpan:
    offset: int  # where the chunk's tokens sit in the step's flat token list
    length: int
    start: int  # position of the chunk's first token in its sequence
    # [blocks covering positions 0 .. start + length) long, on device; None where the Triton
    # prefill kernel reads the step's PrefillBatch instead.
    block_ids: torch.Tensor | None


@dataclass(slots=True)
class AttnMeta:
    """One step's layout: ``num_decodes`` single-token decodes first, then prefill spans."""

    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) per token
    num_decodes: int = 0
    block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [num_decodes] int32, the new token included
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The prefill spans as one batch for the Triton prefill kernel (None: per-span SDPA).
    prefill_batch: PrefillBatch | None = None


@dataclass(slots=True)
class PrefillBatch:
    """All prefill spans of a step in the layout of ``triton_prefill.paged_prefill``; their
    query rows are contiguous, right after the decodes."""

    cu_q_lens: torch.Tensor  # [S + 1] int32, relative to the first prefill row
    q_starts: torch.Tensor  # [S] int32: position of each span's first token
    block_tables: torch.Tensor  # [S, W] int32
    max_q_len: int

    @staticmethod
    def arrays(spans: list[PrefillSpan], tables: list[list[int]]) -> list[tuple[list, torch.dtype]]:
        """The batch's host lists (cumulative lengths, starts, padded tables) for ``to_device``."""
        cu = [0]
        for span in spans:
            cu.append(cu[-1] + span.length)
        width = max(len(t) for t in tables)
        padded = [t + [t[0]] * (width - len(t)) for t in tables]  # padding is never read
        return [(cu, torch.int32), ([s.start for s in spans], torch.int32), (padded, torch.int32)]

    @staticmethod
    def from_tensors(spans: list[PrefillSpan], cu_q_lens: torch.Tensor, q_starts: torch.Tensor,
                     block_tables: torch.Tensor) -> PrefillBatch:
        return PrefillBatch(cu_q_lens, q_starts, block_tables, max(s.length for s in spans))

    @staticmethod
    def build(spans: list[PrefillSpan], tables: list[list[int]], device: torch.device) -> PrefillBatch:
        return PrefillBatch.from_tensors(spans, *to_device(device, PrefillBatch.arrays(spans, tables)))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new K/V rows ([T, kv_heads, head_dim]) at their slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def _group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, H, D] -> [kv_heads, group * n, D]: each KV head's query heads as one long query
    axis, so GQA needs no copies of K and V."""
    n, heads, dim = q.shape
    group = heads // num_kv_heads
    return q.permute(1, 0, 2).reshape(num_kv_heads, group * n, dim)


def _ungroup(out: torch.Tensor, n: int) -> torch.Tensor:
    kv_heads, gn, dim = out.shape
    return out.reshape(kv_heads * (gn // n), n, dim).permute(1, 0, 2)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan,
                      scale: float) -> torch.Tensor:
    """One sequence's chunk: causal within the chunk, full over its earlier context.

    Inputs to SDPA are 4-D ([1, heads, len, dim]): CUDA's fused (flash / memory-efficient)
    kernels take only 4-D tensors and would otherwise fall back to the math kernel, which
    materialises the whole attention matrix.
    """
    n, kv_heads = span.length, k_new.shape[1]
    group = q.shape[1] // kv_heads
    if span.start == 0:
        # Nothing earlier: the chunk's own K/V are the whole context, and plain causal SDPA
        # (flash on CUDA) applies once K/V are repeated to every query head.
        k = k_new.repeat_interleave(group, dim=1) if group > 1 else k_new
        v = v_new.repeat_interleave(group, dim=1) if group > 1 else v_new
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=n > 1, scale=scale)
        return out[0].transpose(0, 1)
    total = span.start + n
    k = k_cache[span.block_ids].flatten(0, 1)[:total].transpose(0, 1)  # [KVH, total, D]
    v = v_cache[span.block_ids].flatten(0, 1)[:total].transpose(0, 1)
    positions = torch.arange(n, device=q.device).repeat(group).unsqueeze(1) + span.start
    mask = torch.arange(total, device=q.device).unsqueeze(0) <= positions  # [group * n, total]
    out = F.scaled_dot_product_attention(_group_queries(q, kv_heads)[None], k[None], v[None],
                                         attn_mask=mask[None, None], scale=scale)
    return _ungroup(out[0], n)


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference paged decode. q: [B, H, D]; returns [B, H, D].

    Gathers each sequence's blocks by its table, masks positions past its context length.
    """
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    width = block_tables.shape[1] * block_size
    tables = block_tables.long()
    k = k_cache[tables].view(batch, width, kv_heads, dim).transpose(1, 2)  # [B, KVH, S, D]
    v = v_cache[tables].view(batch, width, kv_heads, dim).transpose(1, 2)
    mask = torch.arange(width, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1).long()
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)  # a KV head's query heads as a query axis
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, dim)


class AttentionBackend(ABC):
    """How a step's attention runs over the paged cache: decodes, and prefill chunks.

    ``batched_prefill``: the backend takes the step's prefill spans as one ``PrefillBatch``
    (its kernel reads the block tables itself); otherwise each span brings its block ids.
    """

    name: str
    batched_prefill: bool

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float) -> torch.Tensor: ...

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttnMeta, scale: float, out: torch.Tensor) -> None:
        """Write the prefill rows of ``q`` (those after the decodes) into ``out``."""


class TorchAttention(AttentionBackend):
    """SDPA per prefill span, a gather-by-block-table decode: any device, transformers' numerics."""

    name, batched_prefill = "torch", False

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
        return paged_decode_torch(q, k_cache, v_cache, block_tables, context_lens, scale)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, out) -> None:
        for span in meta.prefills:
            rows = slice(span.offset, span.offset + span.length)
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale)


class TritonAttention(AttentionBackend):
    """fovea's Triton paged-decode and paged-prefill kernels (CUDA, checked at start-up)."""

    name, batched_prefill = "triton", True

    def __init__(self) -> None:
        from fovea.engine.kernels import triton_decode, triton_prefill

        self._decode = triton_decode.paged_decode
        self._prefill = triton_prefill.paged_prefill

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, block_tables, context_lens, scale)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, out) -> None:
        batch, nd = meta.prefill_batch, meta.num_decodes
        assert batch is not None, "the Triton backend takes the step's prefill spans as one PrefillBatch"
        self._prefill(q[nd:], k_cache, v_cache, batch.cu_q_lens, batch.q_starts, batch.block_tables, scale,
                      batch.max_q_len, out=out[nd:])


BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention, "triton": TritonAttention}


def attention_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; one of {', '.join(BACKENDS)}")
    return BACKENDS[name]()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttnMeta, scale: float, backend: AttentionBackend) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (already written to the cache) -> [T, H, D]."""
    if not meta.prefills:
        return backend.decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        out[:nd] = backend.decode(q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    backend.prefill(q, k, v, k_cache, v_cache, meta, scale, out)
    return out
