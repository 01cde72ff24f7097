"""Next tokens for a step's sampling rows, with ``sample_next``'s semantics, left on the device.

Nothing here reads a value back: the engine queues the next step before the tokens reach
the host (see ``PagedEngine.step``).
"""

from __future__ import annotations

import torch

from fovea.engine.paged.sequence import Sequence
from fovea.engine.sampling import sample_next_on_device


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [len(seqs), vocab] float32 -> [len(seqs)] int64 on the same device. Greedy rows
    share one batched argmax; the others draw from their own seeded generator."""
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, seq in enumerate(seqs) if not seq.request.params.greedy]
    if drawn:
        picks = [sample_next_on_device(logits[i], seqs[i].request.params, seqs[i].generator) for i in drawn]
        tokens[torch.tensor(drawn, device=logits.device)] = torch.stack(picks)
    return tokens
