"""CUDA graphs for decode steps: one graph per batch size of a ladder, one memory pool.

A decode step of n sequences is padded to the smallest captured size >= n and replayed.
Padded rows decode a dummy token in the KV cache's scratch block (context length 1), so
they neither read nor write any sequence's blocks. The ladder and the padding are plain
functions, tested on CPU; capture and replay need CUDA.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fovea.engine.runner.staging import resolve_pending
from fovea.engine.transfer import to_device

log = logging.getLogger("fovea.engine.paged")

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int, max_graph_batch: int = 256) -> list[int]:
    """The ladder up to min(max_num_seqs, max_graph_batch), ending exactly at that cap so
    every decode batch the scheduler can form has a graph."""
    cap = min(max_num_seqs, max_graph_batch)
    if cap < 1:
        return []
    return sorted({s for s in LADDER if s < cap} | {cap})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows; None when n is 0 or above the ladder."""
    if n < 1:
        return None
    at = bisect.bisect_left(sizes, n)
    return sizes[at] if at < len(sizes) else None


@dataclass(slots=True)
class DecodeBatch:
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]  # rows of equal width
    context_lens: list[int]

    def __len__(self) -> int:
        return len(self.token_ids)


def pad_decode_batch(batch: DecodeBatch, size: int, pad_slot: int, pad_block: int) -> DecodeBatch:
    """``batch`` grown to ``size`` rows of dummy decodes in the scratch block."""
    extra = size - len(batch)
    if extra < 0:
        raise ValueError(f"cannot pad {len(batch)} rows down to {size}")
    width = len(batch.block_tables[0]) if batch.block_tables else 1
    return DecodeBatch(
        batch.token_ids + [0] * extra,
        batch.positions + [0] * extra,
        batch.slots + [pad_slot] * extra,
        batch.block_tables + [[pad_block] * width for _ in range(extra)],
        batch.context_lens + [1] * extra,
    )


DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GraphedDecode:
    """Static input buffers sized for the largest rung; each graph reads a prefix of them."""

    def __init__(self, forward: DecodeFn, sizes: list[int], max_blocks_per_seq: int,
                 pad_slot: int, pad_block: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = sizes
        self.pad_slot, self.pad_block = pad_slot, pad_block
        top = sizes[-1]
        self.token_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), pad_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((top, max_blocks_per_seq), pad_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replayed = 0  # decode steps served by a graph

    def _inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        return (self.token_ids[:size], self.positions[:size], self.slots[:size],
                self.block_tables[:size], self.context_lens[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so smaller graphs reuse the pool's blocks."""
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            inputs = self._inputs(size)
            self.forward(*inputs)  # warm-up: compiles kernels and settles allocations outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.forward(*inputs)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, n: int) -> bool:
        return bucket_for(n, self.sizes) is not None

    def run(self, batch: DecodeBatch, previous: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(batch), vocab] in float32. Token ids may be ``pending_token``s, read
        from ``previous`` (the last step's sampled tokens) on the device."""
        n = len(batch)
        size = bucket_for(n, self.sizes)
        assert size is not None
        padded = pad_decode_batch(batch, size, self.pad_slot, self.pad_block)
        width = len(padded.block_tables[0])
        ids, positions, slots, context_lens, tables = to_device(self.token_ids.device, [
            (padded.token_ids, torch.long), (padded.positions, torch.long), (padded.slots, torch.long),
            (padded.context_lens, torch.int32), (padded.block_tables, torch.int32)])
        self.token_ids[:size].copy_(resolve_pending(ids, previous))
        self.positions[:size].copy_(positions)
        self.slots[:size].copy_(slots)
        self.context_lens[:size].copy_(context_lens)
        # Only the first `width` table columns are rewritten: columns past a row's context
        # length are never read.
        self.block_tables[:size, :width].copy_(tables)
        graph, out = self.graphs[size]
        graph.replay()
        self.replayed += 1
        return out[:n].float()
