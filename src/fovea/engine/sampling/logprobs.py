"""Log-probabilities of the sampled tokens and of the most likely ones, computed on the device.

They are the model's raw distribution, ``log_softmax`` of the logits before logit bias,
penalties, temperature, top-k/top-p/min-p and the ``min_tokens`` mask, as vLLM returns them
by default (``logprobs_mode="raw_logprobs"``): what the model thinks of each token, whatever
the request did to sample it. Only the rows that asked are computed; their values cross to
the host with the step's tokens (``InFlight``), so asking costs no extra wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovea.engine.core.request import TokenLogprob
from fovea.engine.core.sequence import Sequence
from fovea.engine.transfer import to_device


@dataclass(slots=True)
class AskedLogprobs:
    """The raw log-probabilities of the rows that asked, before sampling changes the logits."""

    rows: list[int]  # rows of the step's sampling logits
    tops: list[int]  # how many top tokens each row wants
    device_rows: torch.Tensor
    logprobs: torch.Tensor  # [len(rows), vocab] float32

    def gather(self, tokens: torch.Tensor) -> StepLogprobs:
        """After sampling: the sampled tokens' log-probabilities and the top ones, on the device."""
        chosen = self.logprobs.gather(1, tokens[self.device_rows][:, None])[:, 0]
        k = max(self.tops)
        top = torch.topk(self.logprobs, k, dim=-1) if k else None
        return StepLogprobs(self.rows, self.tops, chosen,
                            top.values if top is not None else None, top.indices if top is not None else None)


def asked(logits: torch.Tensor, seqs: list[Sequence]) -> AskedLogprobs | None:
    """None when no row of the step asked for log-probabilities (nothing is computed)."""
    rows = [i for i, seq in enumerate(seqs) if seq.wants_logprobs]
    if not rows:
        return None
    device_rows = to_device(logits.device, [(rows, torch.long)])[0]
    logprobs = torch.log_softmax(logits[device_rows].float(), dim=-1)
    return AskedLogprobs(rows, [seqs[i].request.params.logprobs for i in rows], device_rows, logprobs)


@dataclass(slots=True)
class StepLogprobs:
    rows: list[int]
    tops: list[int]
    chosen: torch.Tensor  # [R] float32
    top_values: torch.Tensor | None  # [R, k] float32 (k: the most any row asked for), or None
    top_ids: torch.Tensor | None  # [R, k] int64

    def to_host_async(self) -> StepLogprobs:
        """Copies into pinned host memory, queued behind the step's kernels (CUDA only); they are
        complete once the step's ``ready`` event is."""
        if self.chosen.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host

        return StepLogprobs(self.rows, self.tops, pinned(self.chosen), pinned(self.top_values), pinned(self.top_ids))

    def by_row(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """On the host (after the step's tokens arrived): row -> the sampled token's entry."""
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out = {}
        for j, (row, k) in enumerate(zip(self.rows, self.tops)):
            top = list(zip(ids[j][:k], values[j][:k])) if k and ids is not None and values is not None else []
            out[row] = TokenLogprob(tokens[row], chosen[j], top)
        return out
