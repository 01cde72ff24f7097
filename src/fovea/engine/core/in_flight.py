"""A launched step whose sampled tokens are still on their way to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovea.engine.core.scheduler import StepPlan
from fovea.engine.core.sequence import Sequence
from fovea.engine.sampling.logprobs import StepLogprobs


@dataclass(slots=True)
class InFlight:
    plan: StepPlan
    seqs: list[Sequence]  # the sampling rows, in order
    tokens: torch.Tensor  # [len(seqs)] int64 on the device: what the next step's decodes read
    logprobs: dict[int, torch.Tensor]  # row -> first-token log-probabilities, for requests that asked
    host: torch.Tensor  # the tokens' copy on the host (pinned; filled asynchronously on CUDA)
    ready: torch.cuda.Event | None  # recorded after that copy
    token_logprobs: StepLogprobs | None = None  # rows that asked for logprobs (host copies on CUDA)

    @staticmethod
    def start(plan: StepPlan, seqs: list[Sequence], tokens: torch.Tensor,
              logprobs: dict[int, torch.Tensor], token_logprobs: StepLogprobs | None = None) -> InFlight:
        """Queue the copy of ``tokens`` (and of the asked log-probabilities) to the host behind
        the step's kernels."""
        if tokens.device.type != "cuda":
            return InFlight(plan, seqs, tokens, logprobs, tokens, None, token_logprobs)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        token_logprobs = token_logprobs.to_host_async() if token_logprobs is not None else None
        ready = torch.cuda.Event()
        ready.record()
        return InFlight(plan, seqs, tokens, logprobs, host, ready, token_logprobs)

    def tokens_on_host(self) -> list[int]:
        """Wait for the step (only for it: later queued work keeps running) and read its tokens."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
