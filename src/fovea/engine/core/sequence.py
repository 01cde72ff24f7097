"""One request's state inside the paged engine: its tokens, its blocks, its progress."""

from __future__ import annotations

import enum
import time

import torch

from fovea.engine.core.detokenize import IncrementalDetokenizer
from fovea.engine.core.request import EngineRequest, FinishEvent, TokenEvent, TokenLogprob
from fovea.engine.runner.staging import pending_token
from fovea.engine.sampling.params import make_generator
from fovea.engine.sampling.prompt_scores import PromptScores


def start_grammar(grammar):
    """A matcher for a structured request's grammar (xgrammar is imported only when one is used)."""
    if grammar is None:
        return None
    from fovea.engine.structured.matcher import GrammarState
    return GrammarState(grammar)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def image_index_per_position(input_ids: list[int], image_token_id: int, token_counts: list[int]) -> list[int]:
    """For each prompt position, which image fills it (-1: a text token).

    Image rows are scattered in order into the image-token positions, so the first
    ``token_counts[0]`` image tokens belong to image 0, the next ``token_counts[1]`` to image 1...
    """
    owners = [index for index, count in enumerate(token_counts) for _ in range(count)]
    out, seen = [], 0
    for token in input_ids:
        if token == image_token_id and seen < len(owners):
            out.append(owners[seen])
            seen += 1
        else:
            out.append(-1)
    return out


class Sequence:
    """Tokens are prompt + generated; ``num_computed`` of them have K/V in the cache.

    Each step computes tokens [num_computed, num_computed + n); when that reaches the end
    of ``token_ids`` the last position's logits give the next token. A preempted sequence
    keeps its generated tokens and is recomputed from scratch (or from cached blocks).
    """

    def __init__(self, seq_id: int, request: EngineRequest, image_token_id: int,
                 device: torch.device, tokenizer) -> None:
        prompt = request.prompt
        self.seq_id = seq_id
        self.request = request
        self.token_ids: list[int] = list(prompt.input_ids)
        self.prompt_len = len(self.token_ids)
        self.image_of_pos = image_index_per_position(self.token_ids, image_token_id, prompt.image_token_counts)
        # M-RoPE: the prompt's three position rows (None: 1-D), and the shift of every position past it.
        self.mrope = prompt.positions
        self.position_delta = prompt.position_delta
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of leading full blocks (see block_manager)
        self.status = SeqStatus.WAITING
        self.prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden] while prefilling
        self.generator = make_generator(request.params, device)
        # Read per row every step: plain attributes, so rows without these options cost a read.
        self.processed = request.params.processed  # logit bias, stop-token ids or penalties
        self.wants_logprobs = request.params.logprobs is not None
        self.detok = IncrementalDetokenizer(tokenizer, request.params.stop)
        self.produced = 0  # sampled tokens that reached the host
        # Row of the queued step's sampled tokens that holds this sequence's next token, while
        # that token is still on the device (its place in token_ids holds pending_token(row)).
        self.pending_row: int | None = None
        self.first_token_s: float | None = None
        self.scheduled_s: float | None = None  # seconds from arrival to the first step that took it
        self.grammar = start_grammar(request.params.grammar)  # structured outputs; None: free text
        # Teacher-forced scores of the prompt, filled by its prefill chunks (prompt_scores.py).
        self.scores = PromptScores(request.scoring, self.token_ids, self.prompt_len) \
            if request.scoring is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.remaining == 1 and self.num_computed >= self.prompt_len

    @property
    def ended(self) -> bool:
        """Finished, cancelled or failed: a row it still has in a queued step is read by nobody."""
        return self.status is SeqStatus.FINISHED

    @property
    def wants_more(self) -> bool:
        """False once the tokens produced and in flight reach max_tokens: no step past that."""
        return self.produced + (self.pending_row is not None) < self.request.params.max_tokens

    def block_extra(self, index: int, block_size: int) -> tuple[str, ...]:
        """Content hashes of the images whose token runs overlap block ``index``.

        Image tokens all share one id, so without this two different images would hash
        to the same blocks.
        """
        lo, hi = index * block_size, min((index + 1) * block_size, self.prompt_len)
        hashes = self.request.prompt.image_hashes
        seen: list[str] = []
        for image in self.image_of_pos[lo:hi] if lo < hi else ():
            if image >= 0 and (not seen or seen[-1] != hashes[image]):
                seen.append(hashes[image])
        return tuple(seen)

    # ---- events ----------------------------------------------------------------------
    def add_pending(self, row: int) -> None:
        """A queued step samples this sequence's next token into row ``row``: the sequence goes
        on with a placeholder, so the next step can be scheduled before the token is known."""
        assert self.pending_row is None, "one token in flight at a time"
        self.token_ids.append(pending_token(row))
        self.pending_row = row

    def resolve_token(self, token: int, eos: set[int], logprob: TokenLogprob | None = None) -> str | None:
        """The in-flight token arrived: record and emit it (with its log-probability, when asked);
        return a finish reason, or None to go on. An end-of-sequence or stop token that ends the
        answer is counted but not emitted: it is not part of the text."""
        assert self.pending_row is not None and self.token_ids[-1] == pending_token(self.pending_row)
        self.pending_row = None
        self.produced += 1
        params = self.request.params
        if self.grammar is not None:
            self.grammar.accept(token)  # raises StructuredOutputError for a token it refuses
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.request.arrival
        if (token in eos and params.ends_on_eos(self.produced)) or (
                params.stop_token_ids and token in params.stop_token_ids and params.stops_checked(self.produced)):
            self.token_ids.pop()
            return "stop"
        self.token_ids[-1] = token
        text = self.detok.push(token, check_stops=params.stops_checked(self.produced))
        self.request.emit(TokenEvent(text, token, logprob))
        if self.detok.stopped or (self.grammar is not None and self.grammar.terminated):
            return "stop"
        if self.produced >= params.max_tokens:
            return "length"
        return None

    @property
    def next_token_index(self) -> int:
        """Tokens generated before the one the next launched step samples (one may be in flight)."""
        return self.produced + (self.pending_row is not None)

    def emit_finish(self, reason: str) -> None:
        tail = self.detok.flush()
        if tail:
            self.request.emit(TokenEvent(tail, -1))
        req = self.request
        scored = self.scores is not None and reason != "cancelled"  # (a cancelled one may be partial)
        req.emit(FinishEvent(
            finish_reason=reason,
            text=self.detok.text,
            prompt_tokens=self.prompt_len,
            completion_tokens=self.produced,
            first_token_s=self.first_token_s,
            total_s=time.perf_counter() - req.arrival,
            first_logprobs=req.first_logprobs,
            prompt_logprobs=self.scores.logprobs() if scored else None,
            prompt_rows=self.scores.rows() if scored else None,
            queue_s=self.scheduled_s,
        ))
