"""Logit bias, stop-token masks and penalties, applied on the device to a step's rows together.

vLLM's order: the logit bias is added, then tokens that may not come yet are masked (stop
token ids before ``min_tokens``), then the repetition, frequency and presence penalties. Rows
whose requests use none of these are not touched, and a step with no such row costs nothing:
``apply_`` returns at once.

Penalties need each sequence's counts of the tokens it generated: they live on the device in
``TokenCounts`` (one row per penalised sequence) and are updated there from the sampled tokens
(``Penalised.record``), so the next step can be launched before this one's tokens reach the
host. Every update is queued on the stream in step order, so a step's penalties always see
the tokens of every step before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovea.engine.core.sequence import Sequence
from fovea.engine.transfer import to_device


def penalty_slots(max_num_seqs: int) -> int:
    """The most sequences alive in the engine at once: ``max_num_seqs`` running and as many
    waiting (the worker takes no more from its queue)."""
    return 2 * max_num_seqs


def token_counts_bytes(slots: int, vocab: int) -> int:
    return slots * vocab * 5  # int32 counts + bool prompt mask


class TokenCounts:
    """Per-sequence generated-token counts ([slots, vocab] int32) and prompt-token masks
    ([slots, vocab] bool) for penalised sequences. A sequence takes a slot when it is first
    sampled and gives it back when it ends; the pool grows by doubling up to ``max_slots``
    (the memory plan's "penalty counts" line) and never shrinks. A server whose requests use
    no penalties allocates none of it."""

    def __init__(self, vocab: int, device: torch.device, max_slots: int) -> None:
        self.vocab, self.device, self.max_slots = vocab, device, max_slots
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.slot_of: dict[int, int] = {}  # seq_id -> slot
        self.free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    def slot(self, seq: Sequence) -> int:
        """``seq``'s slot, taken and initialised (queued on the stream, after everything that
        used the slot before) on first use."""
        slot = self.slot_of.get(seq.seq_id)
        if slot is not None:
            return slot
        if not self.free:
            self._grow()
        slot = self.slot_of[seq.seq_id] = self.free.pop()
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        ids = sorted({t for t in seq.token_ids[:seq.prompt_len] if 0 <= t < self.vocab})
        if ids:
            # index_fill_ takes the value as a kernel argument; `[...] = True` would copy it from the host and wait.
            self.in_prompt[slot].index_fill_(0, to_device(self.device, [(ids, torch.long)])[0], True)
        return slot

    def release(self, seq: Sequence) -> None:
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def _grow(self) -> None:
        old = self.capacity
        new = min(max(8, 2 * old), self.max_slots)
        if new <= old:
            raise RuntimeError(f"more than {self.max_slots} penalised sequences alive at once")
        counts = torch.zeros(new, self.vocab, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab, dtype=torch.bool, device=self.device)
        counts[:old].copy_(self.counts)
        in_prompt[:old].copy_(self.in_prompt)
        self.counts, self.in_prompt = counts, in_prompt
        self.free.extend(range(new - 1, old - 1, -1))


@dataclass(slots=True)
class Penalised:
    """The step's penalised rows and their slots, to record the sampled tokens into."""

    counts: TokenCounts
    rows: torch.Tensor  # [R] int64: rows of the step's logits
    slots: torch.Tensor  # [R] int64: their TokenCounts slots

    def record(self, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (``tokens``: [rows of the step], on the device)."""
        # One (slot, token) pair per row, so a gather and a plain scatter do it (no accumulate).
        at = (self.slots, tokens[self.rows])
        self.counts.counts.index_put_(at, self.counts.counts[at] + 1)


def apply_(logits: torch.Tensor, seqs: list[Sequence], counts: TokenCounts) -> Penalised | None:
    """Apply every row's logit bias, stop-token mask and penalties to ``logits`` ([rows, vocab]
    float32) in place; the penalised rows, whose sampled tokens must then be recorded."""
    # (A sequence that ended while its step was queued gave its slot back: it must not take another.)
    rows = [i for i, seq in enumerate(seqs) if seq.processed and not seq.ended]
    if not rows:
        return None
    vocab = logits.shape[-1]
    bias_rows, bias_ids, bias_values, mask_rows, mask_ids = [], [], [], [], []
    penalised: list[int] = []
    for i in rows:
        seq = seqs[i]
        params = seq.request.params
        for token, value in params.logit_bias.items():
            if 0 <= token < vocab:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(float(value))
        if params.stop_token_ids and params.eos_blocked(seq.next_token_index):
            for token in params.stop_token_ids:
                if 0 <= token < vocab:
                    mask_rows.append(i)
                    mask_ids.append(token)
        if params.penalised:
            penalised.append(i)
    device = logits.device
    if bias_rows:
        r, t, v = to_device(device, [(bias_rows, torch.long), (bias_ids, torch.long), (bias_values, torch.float32)])
        logits.index_put_((r, t), logits[r, t] + v)  # (row, id) pairs are distinct: a bias is one per id
    if mask_rows:
        r, t = to_device(device, [(mask_rows, torch.long), (mask_ids, torch.long)])
        # torch.full is a fill kernel: a torch.tensor(value, device=...) would copy from the host and wait.
        logits.index_put_((r, t), torch.full((len(mask_rows),), float("-inf"), device=device))
    if not penalised:
        return None
    chosen = [seqs[i].request.params for i in penalised]
    slots = [counts.slot(seqs[i]) for i in penalised]
    r, s, rep, freq, pres = to_device(device, [
        (penalised, torch.long), (slots, torch.long), ([p.repetition_penalty for p in chosen], torch.float32),
        ([p.frequency_penalty for p in chosen], torch.float32), ([p.presence_penalty for p in chosen], torch.float32)])
    logits.index_copy_(0, r, penalise(logits[r], counts.counts[s], counts.in_prompt[s],
                                      rep[:, None], freq[:, None], pres[:, None]))
    return Penalised(counts, r, s)


def penalise(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
             frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The penalised logits ([R, vocab]). Repetition (transformers' and vLLM's rule): a token
    seen in the prompt or the output has a positive logit divided by the penalty, a negative
    one multiplied. Frequency and presence (OpenAI's rule): minus ``frequency`` times the
    token's count in the output, minus ``presence`` if it occurs there at all."""
    generated = counts > 0
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(generated | in_prompt, repeated, logits)
    return logits - frequency * counts - presence * generated
