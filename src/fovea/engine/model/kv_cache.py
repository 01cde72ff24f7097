"""The paged KV cache: its shape, its tensors and the block count chosen for it (see memory.planner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True, slots=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str  # how the block count was chosen

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


class KVCache:
    """Per layer, K and V as [num_blocks + 1, block_size, kv_heads, head_dim].

    The extra last block is scratch: padded rows of a CUDA-graph batch write there, so
    they never touch a block the block manager handed out.
    """

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (num_blocks + 1, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.shape.block_size
