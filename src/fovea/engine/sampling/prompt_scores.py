"""Teacher-forced scores of a prompt, read from its own prefill (``PromptScoring``).

Prompt position ``p``'s final hidden state gives the distribution of token ``p + 1``: a sequence
that scores its prompt has the forward return the final-normed hidden states of its chunk's
positions (``PagedLlama.forward(score_rows=...)``) beside the sampled rows' logits. Those rows go
through the LM head here, on the device, in slices of at most ``slice_rows`` rows, the rows of
logits the memory profile already holds for a step (``max_num_seqs``, less the step's sampled
rows), and each slice is reduced at once to what was asked: the next prompt token's
log-probability and rank, the top-k, and whole [vocab] rows only for the few positions that
asked for them (grounding's answer positions). A long prompt never has [prompt_len, vocab]
logits. The values are the model's raw distribution (``log_softmax`` of the logits), as the
generated tokens' ``logprobs.py``.

The reduced values cross to the host once per step (pinned and asynchronous on CUDA, complete
by the time the step's tokens are read) and wait on the sequence until it finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fovea.engine.core.request import PromptScoring, TokenLogprob


class PromptScores:
    """One sequence's scores as its prefill chunks produce them.

    Row ``p`` (the distribution at position ``p``, predicting prompt token ``p + 1``) is wanted for
    every ``p < prompt_len - 1`` when ``top`` is asked, and for the last ``full_rows`` such rows
    for full rows. A preempted sequence recomputes its prompt from the start (it takes no blocks
    from the prefix cache) and its scores are taken again (``reset``)."""

    def __init__(self, spec: PromptScoring, token_ids: list[int], prompt_len: int) -> None:
        if spec.full_rows > prompt_len - 1:
            raise ValueError(f"{spec.full_rows} full rows asked of a prompt of {prompt_len} tokens")
        self.spec = spec
        self.targets = token_ids[1:prompt_len]  # row p scores token p + 1
        self.last = prompt_len - 1  # rows [0, last) exist
        self.full_from = self.last - spec.full_rows
        self.first = 0 if spec.top is not None else self.full_from
        self.reset()

    def reset(self) -> None:
        self.pieces: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.full: list[tuple[int, torch.Tensor]] = []

    def wanted(self, start: int, end: int) -> tuple[int, int]:
        """The rows [lo, hi) a chunk computing positions [start, end) scores (hi <= lo: none)."""
        return max(start, self.first), min(end, self.last)

    def add(self, lo: int, chosen: torch.Tensor, ranks: torch.Tensor, values: torch.Tensor | None,
            ids: torch.Tensor | None, full: torch.Tensor | None, full_lo: int) -> None:
        self.pieces.append((lo, chosen, ranks, values, ids))
        if full is not None:
            self.full.append((full_lo, full))

    @property
    def rows_scored(self) -> int:
        return sum(piece[1].shape[0] for piece in self.pieces)

    def logprobs(self) -> list[TokenLogprob] | None:
        """One entry per prompt token from the second on (``top`` asked), else None."""
        k = self.spec.top
        if k is None:
            return None
        out: list[TokenLogprob | None] = [None] * self.last
        for lo, chosen, ranks, values, ids in self.pieces:
            tops = list(zip(ids[:, :k].tolist(), values[:, :k].tolist())) if k and ids is not None else None
            for j, (lp, rank) in enumerate(zip(chosen.tolist(), ranks.tolist())):
                top = list(zip(*tops[j])) if tops is not None else []
                out[lo + j] = TokenLogprob(self.targets[lo + j], lp, top, int(rank))
        missing = [p for p, entry in enumerate(out) if entry is None]
        assert not missing, f"prompt rows {missing[:5]}... were never scored"
        return out  # type: ignore[return-value]

    def rows(self) -> torch.Tensor | None:
        """[full_rows, vocab] float32 on the host (asked), else None."""
        if not self.spec.full_rows:
            return None
        parts = sorted(self.full, key=lambda piece: piece[0])
        rows = torch.cat([rows for _, rows in parts]).cpu()
        assert rows.shape[0] == self.spec.full_rows and parts[0][0] == self.full_from, "full rows were not all scored"
        return rows


@dataclass(slots=True)
class Scored:
    """A step's scored rows, reduced, before they are handed to their sequences."""

    chosen: torch.Tensor  # [S] float32: the next prompt token's log-probability
    ranks: torch.Tensor  # [S] int64
    values: torch.Tensor | None  # [S, k] float32 (k: the most any row asked for)
    ids: torch.Tensor | None  # [S, k] int64
    full: list[torch.Tensor]  # the asked whole rows, one [n, vocab] per sequence that asked, in order


def _pinned(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def score_step(lm_logits: Callable[[torch.Tensor], torch.Tensor], normed: torch.Tensor, targets: torch.Tensor,
               scored: list[tuple[PromptScores, int, int]], slice_rows: int) -> None:
    """Reduce a step's scored rows and hand each sequence its part.

    ``normed``: [S] final-normed hidden states, the rows of ``scored`` in order; ``scored``: per
    sequence, (its scores, first row position, row count); ``targets``: [S] the token each row
    scores; ``lm_logits``: the LM head. Slices of at most ``slice_rows`` rows are materialised as
    logits, one at a time."""
    k = max((s.spec.top or 0) for s, _, _ in scored)
    # Rows (in S) whose whole distribution is asked: per sequence, one contiguous run.
    full_runs: list[tuple[int, int]] = []
    at = 0
    for scores, lo, count in scored:
        a, b = max(lo, scores.full_from), lo + count
        full_runs.append((at + a - lo, at + b - lo) if scores.spec.full_rows and b > a else (0, 0))
        at += count
    chosen, ranks, values, ids = [], [], [], []
    full_parts: list[list[torch.Tensor]] = [[] for _ in scored]
    total = normed.shape[0]
    for lo in range(0, total, slice_rows):
        hi = min(total, lo + slice_rows)
        logprobs = torch.log_softmax(lm_logits(normed[lo:hi]).float(), dim=-1)
        own = logprobs.gather(1, targets[lo:hi, None])
        chosen.append(own[:, 0])
        ranks.append((logprobs > own).sum(dim=1) + 1)
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
        for parts, (a, b) in zip(full_parts, full_runs):
            if max(a, lo) < min(b, hi):
                parts.append(logprobs[max(a, lo) - lo:min(b, hi) - lo].clone())
        del logprobs
    out = Scored(torch.cat(chosen), torch.cat(ranks), torch.cat(values) if k else None,
                 torch.cat(ids) if k else None, [torch.cat(p) if p else None for p in full_parts])
    # One host copy for the step; each sequence keeps views into it.
    chosen_h, ranks_h, values_h, ids_h = (_pinned(t) for t in (out.chosen, out.ranks, out.values, out.ids))
    at = 0
    for (scores, lo, count), full, (a, _) in zip(scored, out.full, full_runs):
        part = slice(at, at + count)
        scores.add(lo, chosen_h[part], ranks_h[part], values_h[part] if values_h is not None else None,
                   ids_h[part] if ids_h is not None else None, _pinned(full), lo + a - at)
        at += count
