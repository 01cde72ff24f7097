"""Next tokens for a step's sampling rows, with ``sample_next``'s semantics."""

from __future__ import annotations

import torch

from fovea.engine.paged.sequence import Sequence
from fovea.engine.sampling import sample_next


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [len(seqs), vocab] float32. Greedy rows share one batched argmax (one
    device sync for the whole batch); the others draw from their own seeded generator."""
    greedy = [seq.request.params.greedy for seq in seqs]
    argmax = logits.argmax(dim=-1).tolist() if any(greedy) else []
    if all(greedy):
        return argmax
    return [argmax[i] if greedy[i] else sample_next(logits[i], seq.request.params, seq.generator)
            for i, seq in enumerate(seqs)]
