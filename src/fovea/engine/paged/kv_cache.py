"""The paged KV cache tensors and how many blocks of them fit in memory."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("fovea.engine.paged")


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
    source: str  # how the budget was found, for the log

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_num_blocks(shape: KVShape, *, device_type: str, fixed_blocks: int | None = None,
                    cap_bytes: int | None = None, cpu_budget_bytes: int = 256 * 1024 * 1024,
                    free_bytes: int | None = None, activation_peak_bytes: int = 0,
                    margin_bytes: int = 0, need_blocks: int | None = None) -> KVPlan:
    """Blocks for the KV cache.

    CUDA: measured free memory (after the weights are loaded) minus the profiled activation
    peak of a max-size step minus a margin, capped by ``cap_bytes``. CPU: a byte budget
    (``cap_bytes`` or ``cpu_budget_bytes``); the machine's RAM is shared with everything
    else, so it is never "whatever is free".
    """
    per_block = shape.bytes_per_block
    if fixed_blocks is not None:
        budget, source = fixed_blocks * per_block, f"fixed at {fixed_blocks} blocks"
    elif device_type == "cuda":
        if free_bytes is None:
            raise ValueError("sizing on CUDA needs the measured free memory")
        budget = free_bytes - activation_peak_bytes - margin_bytes
        source = (f"free {free_bytes / 2**30:.2f} GiB - activation peak {activation_peak_bytes / 2**30:.2f} GiB"
                  f" - margin {margin_bytes / 2**30:.2f} GiB")
        if cap_bytes is not None and cap_bytes < budget:
            budget, source = cap_bytes, source + f", capped at {cap_bytes / 2**30:.2f} GiB"
    else:
        budget = cap_bytes if cap_bytes is not None else cpu_budget_bytes
        source = f"CPU budget {budget / 2**20:.0f} MiB"
    num_blocks = budget // per_block
    if need_blocks is not None and fixed_blocks is None and need_blocks < num_blocks:
        # Never more than every sequence at full length needs (plus prefix-cache slack): a
        # small model on a big GPU leaves the rest of the card to its neighbours.
        num_blocks = need_blocks
        source += f", capped at the {need_blocks} blocks max_num_seqs x max_model_len can use"
    if num_blocks < 1:
        raise RuntimeError(f"no room for a KV cache: {source} leaves {budget} bytes, "
                           f"one block needs {per_block}")
    return KVPlan(int(num_blocks), shape.block_size, per_block, source)


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


def log_plan(plan: KVPlan) -> None:
    log.info("KV cache: %d blocks of %d tokens, %.1f KiB per block, %.2f GiB, %d tokens at most (%s)",
             plan.num_blocks, plan.block_size, plan.bytes_per_block / 1024, plan.total_bytes / 2**30,
             plan.max_tokens, plan.source)
