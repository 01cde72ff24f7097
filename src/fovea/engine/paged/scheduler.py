"""Continuous batching: which tokens of which sequences the next step computes.

Each step takes, in order and within ``max_num_batched_tokens``:
1. one token for every running sequence that is decoding (oldest first), preempting the
   most recently admitted running sequence when no block is free for one;
2. the next chunk of every running sequence still prefilling (chunked prefill);
3. the first chunk of waiting sequences, while fewer than ``max_num_seqs`` run.
A request that arrives while others decode joins at the next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fovea.engine.paged.block_manager import BlockManager
from fovea.engine.paged.sequence import SeqStatus, Sequence


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
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.blocks = blocks
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
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
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

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
        budget = self.max_tokens
        blocks, bs = self.blocks, self.blocks.block_size
        # 1. decodes
        for seq in list(self.running):
            if budget == 0:
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
            if budget == 0:
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
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not plan.preempted:
            seq = self.waiting[0]
            if blocks.blocks_for(seq.num_tokens) > blocks.num_blocks:
                self.waiting.popleft()
                plan.rejected.append(seq)
                continue
            hits = blocks.lookup(seq)
            start = len(hits) * bs
            room = (len(hits) + blocks.num_free - blocks.admit_cost(hits)) * bs - start
            n = min(seq.num_tokens - start, budget, room)
            if n <= 0:
                break
            self.waiting.popleft()
            blocks.admit(seq, hits)
            blocks.ensure(seq, start + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.chunks.append(Chunk(seq, start, n, n == seq.num_tokens - start))
            budget -= n

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
