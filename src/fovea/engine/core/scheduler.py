"""Continuous batching: which tokens of which sequences the next step computes.

Each step takes, in order and within ``max_num_batched_tokens``:
1. one token for every running sequence that is decoding (oldest first), preempting the
   most recently admitted running sequence when no block is free for one;
2. the next chunk of every running sequence still prefilling (chunked prefill);
3. the first chunk of waiting sequences, while fewer than ``max_num_seqs`` run.
A request that arrives while others decode joins at the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from fovea.engine.core.block_manager import BlockManager
from fovea.engine.core.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int  # first position computed this step
    length: int
    sample: bool  # the chunk reaches the last token: its logits give the next token

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(slots=True)
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)  # decodes first, then prefill chunks
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # can never fit the whole cache

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    """``max_prefill_tokens``: the prompt tokens whose input embeddings may be held at once (a
    sequence holds its whole prompt's from admission until its prefill is done); it bounds the
    memory plan's "prompt embeddings in flight" line. None: no bound (CPU, tests).

    After an out-of-memory error the engine calls ``shrink``: the step's token and sequence
    limits halve, and ``recovered`` grows them back after steps that succeed."""

    RECOVERY_STEPS = 32  # successful steps before a shrunk limit doubles again

    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_prefill_tokens: int | None = None) -> None:
        self.blocks = blocks
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.token_limit = max_num_batched_tokens  # <= max_tokens: lowered after an out-of-memory error
        self.seq_limit = max_num_seqs
        self._good_steps = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def remove(self, seq: Sequence) -> None:
        """Take a finished, cancelled or failed sequence out and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.prompt_embeds = None
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        """Back to the front of the queue; generated tokens are kept and recomputed later."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.prompt_embeds = None  # recomputed (through the encoder cache) on readmission
        if seq.scores is not None:
            seq.scores.reset()  # its prompt is computed, and scored, again from the start
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- out-of-memory recovery ------------------------------------------------------
    @property
    def at_minimum(self) -> bool:
        """Limits cannot shrink further: one sequence, one block of tokens."""
        return self.seq_limit == 1 and self.token_limit <= self.blocks.block_size

    def shrink(self, plan: StepPlan) -> list[Sequence]:
        """After ``plan``'s step ran out of memory: halve the limits below what that step used,
        send its prefilling sequences and the youngest sequences over the new sequence limit
        back to waiting (their generated tokens are kept), and return those preempted."""
        self.token_limit = max(self.blocks.block_size, min(self.token_limit, plan.num_tokens) // 2)
        self.seq_limit = max(1, min(self.seq_limit, len(plan.chunks)) // 2)
        self._good_steps = 0
        victims = [c.seq for c in plan.chunks if c.seq.status is SeqStatus.RUNNING and not c.seq.is_decode]
        while len(self.running) - len(victims) > self.seq_limit:
            extra = next(s for s in reversed(self.running) if s not in victims)
            victims.append(extra)
        for seq in victims:
            self._preempt(seq)
        return victims

    def recovered(self) -> None:
        """A step succeeded: after RECOVERY_STEPS of them, a shrunk limit doubles."""
        if self.token_limit == self.max_tokens and self.seq_limit == self.max_seqs:
            return
        self._good_steps += 1
        if self._good_steps >= self.RECOVERY_STEPS:
            self._good_steps = 0
            self.token_limit = min(self.max_tokens, 2 * self.token_limit)
            self.seq_limit = min(self.max_seqs, 2 * self.seq_limit)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        while True:
            self._schedule_into(plan)
            if plan.chunks or not self.running:
                return plan
            # Every running sequence is mid-prefill with no block to grow into: make room.
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)

    def _schedule_into(self, plan: StepPlan) -> None:
        budget = self.token_limit
        blocks, bs = self.blocks, self.blocks.block_size
        held = sum(s.prompt_len for s in self.running if s.num_computed < s.prompt_len)
        # 1. decodes
        for seq in list(self.running):
            if budget == 0 or len(plan.chunks) >= self.seq_limit:
                break
            if seq.status is not SeqStatus.RUNNING or not seq.is_decode or not seq.wants_more:
                continue  # (a sequence whose last token is in flight and will end it waits for it)
            while not blocks.ensure(seq, seq.num_computed + 1):
                victim = self.running[-1]  # never one already scheduled: those are older than seq
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                plan.chunks.append(Chunk(seq, seq.num_computed, 1, True))
                budget -= 1
        plan.num_decodes = len(plan.chunks)
        # 2. running sequences still prefilling
        for seq in self.running:
            if budget == 0 or len(plan.chunks) >= self.seq_limit:
                break
            if seq.is_decode:
                continue
            n = min(seq.remaining, budget, blocks.capacity(seq))
            if n <= 0:
                continue  # no block to grow into; another may still have room in its last block
            blocks.ensure(seq, seq.num_computed + n)
            plan.chunks.append(Chunk(seq, seq.num_computed, n, n == seq.remaining))
            budget -= n
        # 3. admissions, first come first served; none in a step that had to preempt, or
        # the victim would come straight back and take the blocks it just gave up.
        while (self.waiting and budget > 0 and len(self.running) < min(self.max_seqs, self.seq_limit)
               and not plan.preempted):
            seq = next((s for s in self.waiting if not self._waits_for_sibling(s)), None)
            if seq is None:
                break
            if blocks.blocks_for(seq.num_tokens) > blocks.num_blocks:
                self.waiting.remove(seq)
                plan.rejected.append(seq)
                continue
            if self.max_prefill_tokens is not None and held and held + seq.prompt_len > self.max_prefill_tokens:
                break  # its prompt embeddings would pass the plan's bound: wait for a prefill to finish
            # A sequence that scores its prompt computes every prompt position: a cached block
            # holds K/V, not the hidden states its rows are read from. (Its own blocks still go
            # into the prefix cache for those after it: an n > 1 request's other choices.)
            hits = blocks.lookup(seq) if seq.scores is None else []
            start = len(hits) * bs
            room = (len(hits) + blocks.num_free - blocks.admit_cost(hits)) * bs - start
            n = min(seq.num_tokens - start, budget, room)
            if n <= 0:
                break
            self.waiting.remove(seq)
            blocks.admit(seq, hits)
            blocks.ensure(seq, start + n)
            seq.status = SeqStatus.RUNNING
            if seq.scheduled_s is None:  # (a preempted sequence's second admission is not its wait)
                seq.scheduled_s = time.perf_counter() - seq.request.arrival
            self.running.append(seq)
            plan.chunks.append(Chunk(seq, start, n, n == seq.num_tokens - start))
            budget -= n
            held += seq.prompt_len

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """A choice of an n > 1 request waits while a sibling choice prefills the same prompt:
        admitted after that prefill, it takes the prompt's full blocks from the prefix cache
        instead of computing them again (only its last, partial block is its own)."""
        group = seq.request.group
        if group is None or not self.blocks.prefix_caching or (seq.prompt_len - 1) // self.blocks.block_size == 0:
            return False
        return any(s.request.group is group and s.num_computed < s.prompt_len for s in self.running)

    def on_computed(self, plan: StepPlan) -> None:
        """After the forward: advance progress and name newly filled blocks (not for sequences
        that finished while the step ran: their blocks are gone)."""
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed = chunk.end
            if seq.num_computed >= seq.prompt_len:
                seq.prompt_embeds = None  # the image rows are in the KV cache now
            self.blocks.register(seq)
