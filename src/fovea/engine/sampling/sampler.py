"""Next tokens for a step's sampling rows, with ``sample_next``'s semantics, left on the device.

Nothing here reads a value back: the engine queues the next step before the tokens reach
the host (see ``PagedEngine.step``). Row indices cross through ``transfer.to_device`` (pinned,
asynchronous): a plain ``torch.tensor(..., device="cuda")`` would wait for the running step.
"""

from __future__ import annotations

import torch

from fovea.engine.core.sequence import Sequence
from fovea.engine.sampling import logits_processors
from fovea.engine.sampling.logits_processors import TokenCounts
from fovea.engine.sampling.params import sample_next_on_device
from fovea.engine.transfer import to_device


def block_eos_(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> None:
    """Rows of sequences still below their ``min_tokens`` cannot sample an end-of-sequence token."""
    flags = [seq.request.params.eos_blocked(seq.next_token_index) for seq in seqs]
    ids = [t for t in eos_ids if 0 <= t < logits.shape[-1]]
    if not any(flags) or not ids:
        return
    mask = None if all(flags) else to_device(logits.device, [(flags, torch.bool)])[0]
    for token in ids:
        column = logits[:, token]
        if mask is None:
            column.fill_(float("-inf"))
        else:
            column.masked_fill_(mask, float("-inf"))


@torch.inference_mode()  # the logits are inference tensors: masking them in place needs the mode
def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int] | None = None,
                     counts: TokenCounts | None = None) -> torch.Tensor:
    """logits: [len(seqs), vocab] float32 -> [len(seqs)] int64 on the same device. Greedy rows
    share one batched argmax; the others draw from their own seeded generator. With ``counts``,
    rows that ask for a logit bias, stop-token ids or penalties get them first."""
    if eos_ids:
        block_eos_(logits, seqs, eos_ids)
    penalised = logits_processors.apply_(logits, seqs, counts) if counts is not None else None
    if any(seq.grammar is not None for seq in seqs):  # last: nothing after it may unmask a token
        from fovea.engine.structured.bitmask import apply_grammar_masks_  # imports xgrammar
        apply_grammar_masks_(logits, seqs)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, seq in enumerate(seqs) if not seq.request.params.greedy]
    if drawn:
        picks = [sample_next_on_device(logits[i], seqs[i].request.params, seqs[i].generator) for i in drawn]
        tokens[to_device(logits.device, [(drawn, torch.long)])[0]] = torch.stack(picks)
    if penalised is not None:
        penalised.record(tokens)  # on the device: the next step's penalties see these tokens
    return tokens
