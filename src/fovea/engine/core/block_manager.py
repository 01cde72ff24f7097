"""KV-cache blocks: a free list, reference counts and a content-addressed prefix cache.

A full block is named by a hash chained from the previous block's hash, its token ids
and the hashes of the images whose token runs overlap it. A sequence whose leading
blocks hash to blocks already in the cache takes them (reference count + 1) instead of
recomputing them. Freed blocks keep their contents and name and go to the tail of the
free list; allocation takes from the head, so cached blocks are evicted least recently
freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from fovea.engine.core.sequence import Sequence


def block_hash(prev: bytes | None, token_ids: list[int], extra: tuple[str, ...]) -> bytes:
    """A collision-resistant name for a block's contents given everything before it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev or b"root")
    h.update(len(token_ids).to_bytes(4, "little"))
    for token in token_ids:
        h.update(token.to_bytes(8, "little", signed=True))
    for key in extra:
        h.update(b"|img:" + key.encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hit_tokens = 0  # prompt tokens served from the prefix cache
        self.queried_tokens = 0  # tokens of admitted sequences (the hit-rate denominator)
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks with no user: empty ones and cached ones that may be evicted."""
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------
    def _hash_upto(self, seq: Sequence, num_full: int) -> None:
        """Extend ``seq.block_hashes`` to cover its first ``num_full`` full blocks."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full):
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(prev, seq.token_ids[i * bs:(i + 1) * bs], seq.block_extra(i, bs)))

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading tokens; at least one token is left to compute
        so that the last position's logits exist."""
        if not self.prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        self._hash_upto(seq, num_full)
        hits = []
        for h in seq.block_hashes[:num_full]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit_cost(self, hits: list[int]) -> int:
        """Free blocks that taking ``hits`` would use up (hits nobody else holds sit in the free list)."""
        return sum(1 for b in hits if self.ref_counts[b] == 0)

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give ``seq`` its cached prefix; its computation starts after it."""
        assert not seq.block_table, "sequence already holds blocks"
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        self.hit_tokens += seq.num_computed
        self.queried_tokens += seq.num_tokens

    def register(self, seq: Sequence) -> None:
        """Name the sequence's full, computed blocks so that later sequences can share them."""
        if not self.prefix_caching:
            return
        num_full = seq.num_computed // self.block_size
        self._hash_upto(seq, num_full)
        for i in range(num_full):
            block = seq.block_table[i]
            if self.hash_of[block] is not None:
                continue
            h = seq.block_hashes[i]
            if h in self.cached:
                continue  # computed twice (admitted together); the first copy keeps the name
            self.hash_of[block] = h
            self.cached[h] = block

    # ---- allocation -------------------------------------------------------------------
    def capacity(self, seq: Sequence) -> int:
        """Most tokens ``seq`` could add now: room in its blocks plus every free block."""
        return (len(seq.block_table) + self.num_free) * self.block_size - seq.num_computed

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens; False (and no change) if
        there are not enough free blocks."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:  # evict the least recently freed cached block
            del self.cached[old]
            self.hash_of[block] = None
            self.evictions += 1
        self.ref_counts[block] = 1
        return block

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks. Tail blocks are freed first so that they are
        evicted before the shared prefix they extend."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hash_of[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # unnamed: reuse first
                else:
                    self.free[block] = None
        seq.block_table = []
        seq.num_computed = 0
