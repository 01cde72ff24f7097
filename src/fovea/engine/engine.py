"""PagedEngine: the Engine interface over continuous batching and a paged KV cache.

``submit`` puts a request on the queue (429 at once when ``max_queue`` is set and reached) and
``generate`` streams its events.
One worker thread runs the step loop: take new requests, schedule, embed newly admitted
prompts, launch one forward and its sampling, then emit the previous step's tokens while the
GPU runs this one. It blocks on the queue only when it has nothing to do.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from fovea.engine.config import PagedEngineConfig
from fovea.engine.core.block_manager import BlockManager
from fovea.engine.core.in_flight import InFlight
from fovea.engine.core.request import (
    EngineRequest,
    ErrorEvent,
    Event,
    PromptScoring,
    Submission,
    check_fits_context,
    check_token_ids,
    enqueue,
    overloaded,
)
from fovea.engine.core.scheduler import Scheduler, StepPlan
from fovea.engine.core.sequence import SeqStatus, Sequence
from fovea.engine.runner.model_runner import ModelRunner
from fovea.engine.sampling import logprobs as token_logprobs
from fovea.engine.sampling.logits_processors import TokenCounts, penalty_slots
from fovea.engine.sampling.params import SamplingParams
from fovea.engine.sampling.sampler import sample_on_device
from fovea.engine.structured.spec import StructuredOutputError
from fovea.engine.vision.encoder_cache import EncoderCache
from fovea.engine.vision.image_encoder import start_worker
from fovea.errors import FoveaError, InvalidRequest
from fovea.loading.loader import LoadedModel
from fovea.loading.prompt import EncodedPrompt, PlaceholderMismatch

log = logging.getLogger("fovea.engine.paged")


class EngineStopped(RuntimeError):
    pass


class OutOfMemory(FoveaError):
    """A request that ran out of device memory even alone, at the smallest step: it can never fit."""

    status, code, type = 503, "out_of_memory", "server_error"


class PagedEngine:
    def __init__(self, loaded: LoadedModel, config: PagedEngineConfig | None = None,
                 on_vision_seconds: Callable[[float], None] | None = None,
                 remote_encoder=None) -> None:
        """``remote_encoder``: an encoder pool (``fovea.disagg.encoder_pool``) whose workers run
        the vision stage; None: this process runs it."""
        self.loaded = loaded
        self.config = (config or PagedEngineConfig()).resolved(
            loaded.device, loaded.context_length, sum(p.numel() for p in loaded.model.parameters()))
        self.encoder_cache = EncoderCache(self.config.encoder_cache_bytes)
        # Triton launches on the current CUDA device: make it the model's (cuda:1 included).
        with torch.cuda.device(loaded.device) if loaded.device.type == "cuda" else contextlib.nullcontext():
            self.runner = ModelRunner(loaded, self.config, self.encoder_cache, on_vision_seconds, remote_encoder)
        self.block_manager = BlockManager(self.runner.kv_plan.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_batched_tokens,
                                   self.config.max_num_seqs, self.runner.max_prefill_tokens)
        self._queue: queue.Queue[EngineRequest | None] = queue.Queue(maxsize=self.config.max_queue or 0)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._next_id = 0
        self._eos_ids = sorted(t for t in loaded.eos_token_ids if isinstance(t, int) and t >= 0)
        self.vocab_size = int(self.runner.llama.lm_head.shape[0])
        # Generated-token counts of penalised sequences, on the device (logits_processors.py).
        self.token_counts = TokenCounts(self.vocab_size, loaded.device, penalty_slots(self.config.max_num_seqs))
        self._dead: BaseException | None = None  # set when the worker thread dies
        self._in_flight: InFlight | None = None  # the launched step whose tokens are not read yet
        self.steps = 0
        self.oom_recoveries = 0  # steps that ran out of memory and were retried smaller
        self.steps_queued_ahead = 0  # steps launched while the previous one's tokens were unread
        # Steps whose sampling waited for the step before them, their forward already queued: a
        # structured row's mask needs its in-flight token (docs/structured-outputs.md).
        self.structured_waits = 0
        self._waited_s = 0.0  # of this step's launch, seconds spent in that wait
        # Wall seconds of the worker's step phases, summed (where a step's time goes: CPU
        # scheduling, vision, launching the forward, waiting for the GPU, emitting tokens).
        self.phase_seconds = dict.fromkeys(("schedule", "embed", "forward", "sample_wait", "emit"), 0.0)
        self.queued_seconds = 0.0  # summed time from arrival until the worker took each request
        self.prompts_scored = 0  # requests that scored their prompt (PromptScoring)
        # When a list: one (launch seconds, decodes, prefill tokens, prefill chunks) per step,
        # for benchmarks that look for slow steps. None (the default) records nothing.
        self.step_trace: list[tuple[float, int, int, int]] | None = None

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = start_worker(self._loop, "fovea-paged-engine", self.loaded.device, self.config.cpu_threads)

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping.set()
            try:
                self._queue.put_nowait(None)  # wakes an idle worker; a busy one sees the flag
            except queue.Full:
                pass
            self._thread.join(timeout=30)
            self._thread = None
            self._stopping.clear()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self.scheduler.waiting)

    def memory_report(self) -> dict:
        """The memory plan, and on CUDA what the process holds now and has held at most."""
        report = self.runner.memory_plan.to_dict()
        now = self.memory_now()
        if now is not None:
            report["now"] = now
        report["oom_recoveries"] = self.oom_recoveries
        return report

    def memory_now(self) -> dict | None:
        """On CUDA: what torch holds now and has held at most, and what the device has in use."""
        if self.loaded.device.type != "cuda":
            return None
        device = self.loaded.device
        free, total = torch.cuda.mem_get_info(device)
        return {"torch_reserved_bytes": torch.cuda.memory_reserved(device),
                "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "device_used_bytes": total - free}

    @property
    def max_context(self) -> int:
        """The per-sequence token limit (prompt and answer together): --max-model-len (at most
        the model's context) or what the KV cache holds for one sequence, whichever is smaller."""
        return min(self.config.max_model_len, self.block_manager.num_blocks * self.config.block_size)

    # ---- requests -------------------------------------------------------------------
    def check_fits(self, prompt: EncodedPrompt, params: SamplingParams) -> None:
        check_fits_context(prompt, params, self.loaded.context_length, self.max_context)
        check_token_ids(params, self.vocab_size)
        if self.config.max_queue is not None and params.n > self.config.max_queue:
            raise InvalidRequest(f"n={params.n} choices would not fit this server's queue of {self.config.max_queue} "
                                 "requests (--max-queue); ask for fewer.", param="n")

    def submit(self, prompt: EncodedPrompt, params: SamplingParams, request_id: str | None = None,
               want_first_logprobs: bool = False, scoring: PromptScoring | None = None) -> Submission:
        """Queue one request now, or refuse it now (400 for one that cannot fit, 429 when the
        queue is full); its events come from the returned ``Submission.events()``. ``scoring``:
        score the prompt from its own prefill (its answers come in the ``FinishEvent``)."""
        self._check_submission(prompt, params, scoring)
        return Submission(self._queue, self.config.max_queue, prompt, params, request_id, want_first_logprobs,
                          scoring)

    def submit_to(self, emit: Callable[[Event], None], prompt: EncodedPrompt, params: SamplingParams,
                  request_id: str | None = None, want_first_logprobs: bool = False,
                  scoring: PromptScoring | None = None) -> threading.Event:
        """``submit`` for a caller without an event loop of its own on the path (the engine core's
        process): ``emit`` is called on the engine's thread with each event (it must not block).
        Returns the flag that cancels the request."""
        self._check_submission(prompt, params, scoring)
        return enqueue(self._queue, self.config.max_queue, prompt, params, request_id, want_first_logprobs, scoring,
                       emit)

    def _check_submission(self, prompt: EncodedPrompt, params: SamplingParams, scoring: PromptScoring | None) -> None:
        if self._dead is not None:
            raise EngineStopped(f"the engine worker died: {type(self._dead).__name__}: {self._dead}")
        self.check_fits(prompt, params)
        if scoring is not None and scoring.full_rows > len(prompt.input_ids) - 1:
            raise InvalidRequest(f"{scoring.full_rows} full rows asked of a prompt of {len(prompt.input_ids)} "
                                 "tokens: its first token has no distribution before it.")

    def refuse_when_full(self) -> None:
        """A 429 now when --max-queue is reached: the routes ask before fetching and decoding a
        request's images, which a flood would otherwise pay for in every refusal. ``submit``
        still decides (the queue may fill while the images decode)."""
        if self.config.max_queue is not None and self._queue.full():
            raise overloaded(self.config.max_queue)

    async def generate(self, prompt: EncodedPrompt, params: SamplingParams, request_id: str | None = None,
                       want_first_logprobs: bool = False, scoring: PromptScoring | None = None
                       ) -> AsyncIterator[Event]:
        """Stream the events of one request (submitted at the first ``__anext__``); cancel it if
        the consumer stops early."""
        submission = self.submit(prompt, params, request_id, want_first_logprobs, scoring)
        async with contextlib.aclosing(submission.events()) as events:
            async for event in events:
                yield event

    # ---- worker ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            if self.loaded.device.type == "cuda":  # per thread; see __init__
                index = self.loaded.device.index
                torch.cuda.set_device(index if index is not None else torch.cuda.current_device())
            self._serve()
        except BaseException as exc:
            log.exception("the engine worker died")
            self._dead = exc
            self._fail_all(exc)
            self._answer_queued(exc)  # then stay dead

    def _serve(self) -> None:
        while True:
            idle = not self.scheduler.has_work()
            if idle:
                self._complete_in_flight()  # its sequences were cancelled: nothing waits for it
            if self._stopping.is_set() or not self._intake(block=idle):
                self._drain_on_stop()
                return
            if not self.scheduler.has_work():
                continue
            try:
                self.step()
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_all(exc)

    def _intake(self, block: bool) -> bool:
        """Move queued requests into the scheduler; False when asked to stop. Only as many
        as could start soon are taken, so the bounded queue is what a burst fills."""
        while len(self.scheduler.waiting) < self.config.max_num_seqs:
            try:
                request = self._queue.get() if block else self._queue.get_nowait()
            except queue.Empty:
                return True
            block = False
            if request is None:
                return False
            if request.cancelled.is_set():
                continue
            prompt = request.prompt
            images = sum(1 for t in prompt.input_ids if t == self.loaded.image_token_id)
            if images != sum(prompt.image_token_counts):
                request.emit(ErrorEvent(PlaceholderMismatch(
                    f"request {request.request_id}: {images} image-token positions for "
                    f"{prompt.num_images} image(s) of {prompt.image_token_counts} tokens", status=500)))
                continue
            if self.runner.llama.mrope_section is None and prompt.positions is not None:
                request.emit(ErrorEvent(PlaceholderMismatch(
                    f"request {request.request_id}: the prompt carries M-RoPE positions but this model's "
                    "language model uses 1-D positions", status=500)))
                continue
            if self.runner.llama.mrope_section is not None and prompt.images and prompt.positions is None:
                request.emit(ErrorEvent(PlaceholderMismatch(
                    f"request {request.request_id}: this model needs M-RoPE positions for its images and the "
                    "prompt carries none (it was not built by this model's codec)", status=500)))
                continue
            self._next_id += 1
            self.prompts_scored += request.scoring is not None
            self.queued_seconds += time.perf_counter() - request.arrival
            self.scheduler.add(Sequence(self._next_id, request, self.loaded.image_token_id,
                                        self.loaded.device, self.loaded.tokenizer))
            self.runner.embedder.images.prefetch(prompt)  # remote encoders start on its images now
        return True

    def _drain_on_stop(self) -> None:
        """Answer everything still in flight or queued, so no consumer waits forever."""
        stopped = EngineStopped("the engine was stopped")
        self._fail_all(stopped)
        self._in_flight = None
        self._answer_queued(stopped)

    def _answer_queued(self, exc: BaseException) -> None:
        """Fail every request still on the queue with ``exc``."""
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                request.emit(ErrorEvent(exc))

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.token_counts.release(seq)
        seq.emit_finish(reason)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self.scheduler.remove(seq)
        self.token_counts.release(seq)
        seq.request.emit(ErrorEvent(exc))

    def _fail_all(self, exc: BaseException) -> None:
        for seq in self.scheduler.all_sequences():
            self._fail(seq, exc)

    def step(self) -> None:
        """One scheduling step: at most one forward.

        With ``overlap_steps`` the step is queued one ahead: its forward and sampling are
        launched, then the previous step's tokens are read back and emitted while the GPU runs
        this one. Decodes whose input token is still on the device read it there
        (``staging.pending_token``). A sequence that the previous step finished has one wasted
        row in this step. A step with a structured row reads the previous step's tokens between
        its forward and its sampling instead (``_complete_before_sampling``). Without the
        overlap, each step's tokens are read right after its launch.
        """
        phases, t0 = self.phase_seconds, time.perf_counter()
        for seq in self.scheduler.all_sequences():
            if seq.request.cancelled.is_set():
                self._finish(seq, "cancelled")
        plan = self.scheduler.schedule()
        for seq in plan.rejected:
            self._fail(seq, InvalidRequest("the sequence does not fit in the KV cache",
                                           code="context_length_exceeded", param="max_tokens"))
        t1 = time.perf_counter()
        try:
            if plan.chunks:
                self._embed_admitted(plan)
            t2 = time.perf_counter()
            launched = self._launch(plan) if plan.chunks else None
        except torch.OutOfMemoryError as exc:
            self._recover_from_oom(plan, exc)
            return
        phases["schedule"] += t1 - t0
        phases["embed"] += t2 - t1
        t3 = time.perf_counter()
        phases["forward"] += t3 - t2 - self._waited_s  # (the wait is sample_wait and emit)
        self._waited_s = 0.0
        if self.step_trace is not None and plan.chunks:
            prefill = plan.chunks[plan.num_decodes:]
            self.step_trace.append((t3 - t2, plan.num_decodes, sum(c.length for c in prefill), len(prefill)))
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self.steps_queued_ahead += launched is not None
            self._complete(previous)
        if launched is None:
            return
        self.scheduler.on_computed(launched.plan)
        for row, seq in enumerate(launched.seqs):
            if seq.status is not SeqStatus.FINISHED:
                seq.add_pending(row)
        self.steps += 1
        self.scheduler.recovered()
        if self.config.overlap_steps:
            self._in_flight = launched
        else:
            self._complete(launched)

    def _launch(self, plan: StepPlan) -> InFlight | None:
        """Queue the forward and the sampling; None if the forward could not be launched."""
        previous = self._in_flight.tokens if self._in_flight is not None else None
        try:
            logits = self.runner.execute(plan, previous)
            sampling = [c.seq for c in plan.chunks if c.sample]
            if previous is not None and any(s.grammar is not None and s.pending_row is not None for s in sampling):
                self._complete_before_sampling()
            asked = token_logprobs.asked(logits, sampling)  # raw: before sampling changes the logits
            tokens = sample_on_device(logits, sampling, self._eos_ids, self.token_counts)
            logprobs = {row: torch.log_softmax(logits[row], dim=-1) for row, seq in enumerate(sampling)
                        if seq.request.want_first_logprobs and seq.produced == 0 and seq.pending_row is None}
            return InFlight.start(plan, sampling, tokens, logprobs, asked.gather(tokens) if asked else None)
        except torch.OutOfMemoryError:
            raise  # the step is retried smaller (_recover_from_oom); nobody fails
        except Exception as exc:
            log.exception("engine step over %d sequence(s) failed", len(plan.chunks))
            for chunk in plan.chunks:
                self._fail(chunk.seq, exc)
            return None

    def _complete(self, step: InFlight) -> None:
        """Wait for a launched step's tokens, then record and emit them."""
        phases, t0 = self.phase_seconds, time.perf_counter()
        try:
            tokens = step.tokens_on_host()
        except Exception as exc:  # an asynchronous error of that step's kernels surfaces here
            log.exception("engine step over %d sequence(s) failed", len(step.plan.chunks))
            for chunk in step.plan.chunks:
                if chunk.seq.status is not SeqStatus.FINISHED:
                    self._fail(chunk.seq, exc)
            return
        t1 = time.perf_counter()
        eos = self.loaded.eos_token_ids
        asked = step.token_logprobs.by_row(tokens) if step.token_logprobs is not None else {}
        for row, (seq, token) in enumerate(zip(step.seqs, tokens)):
            if seq.status is SeqStatus.FINISHED:
                continue  # cancelled or failed while the step ran
            if row in step.logprobs:
                seq.request.first_logprobs = step.logprobs[row].cpu()
            try:
                reason = seq.resolve_token(token, eos, asked.get(row))
            except StructuredOutputError as exc:  # this sequence's grammar refused it: only it fails
                self._fail(seq, exc)
                continue
            if reason is not None:
                self._finish(seq, reason)
        phases["sample_wait"] += t1 - t0
        phases["emit"] += time.perf_counter() - t1

    def _complete_before_sampling(self) -> None:
        """A structured row's next mask needs the token still in flight, and its matcher must have
        accepted it: wait for the step before (only for it: this step's forward, queued behind it,
        keeps the device busy meanwhile), emit its tokens, then the masks are filled and the
        sampling queued. The host's mask work hides behind the forward instead of a structured
        row sitting a step out."""
        t0 = time.perf_counter()
        self.steps_queued_ahead += 1
        self.structured_waits += 1
        self._complete_in_flight()
        self._waited_s += time.perf_counter() - t0

    def _complete_in_flight(self) -> None:
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._complete(step)

    def _embed_admitted(self, plan: StepPlan) -> None:
        """Fill the prompt embeddings of sequences whose prefill (re)starts this step."""
        need = [c.seq for c in plan.chunks if c.start < c.seq.prompt_len and c.seq.prompt_embeds is None]
        if not need:
            return
        try:
            undelivered = self.runner.embedder.fill(need)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            log.exception("prompt embedding failed for %d request(s)", len(need))
            failed = {id(s) for s in need}
            for seq in need:
                self._fail(seq, exc)
            # Decodes never need prompt embeddings, so plan.num_decodes stays right.
            plan.chunks = [c for c in plan.chunks if id(c.seq) not in failed]
            return
        if undelivered:  # only the requests whose images the encode workers did not deliver
            log.warning("%d request(s) failed: their images were not encoded (%s)", len(undelivered),
                        undelivered[0][1])
            for seq, why in undelivered:
                self._fail(seq, why)
            gone = {id(seq) for seq, _ in undelivered}
            plan.chunks = [c for c in plan.chunks if id(c.seq) not in gone]

    def _recover_from_oom(self, plan: StepPlan, exc: torch.OutOfMemoryError) -> None:
        """A step ran out of device memory before anything of it was read back: nothing is lost.

        The step before it is completed first (its tokens are the inputs of decodes here), then
        the scheduler halves its limits and sends the step's prefilling sequences (and the
        youngest beyond the new limit) back to waiting, the encoder cache lets go of its
        embeddings and the allocator of its cached blocks, and the next step is smaller. Only a
        sequence that runs out of memory alone, at the smallest step, fails: it can never fit.
        """
        self.oom_recoveries += 1
        self._complete_in_flight()
        alive = [c.seq for c in plan.chunks if c.seq.status is SeqStatus.RUNNING]
        if len(alive) == 1 and self.scheduler.at_minimum:
            seq = alive[0]
            log.error("request %s ran out of device memory alone in the smallest step (%d tokens): failing it",
                      seq.request.request_id, plan.num_tokens)
            self._fail(seq, OutOfMemory(
                f"the request needs more GPU memory than this server can give it, even alone in the smallest "
                f"step ({seq.prompt_len} prompt tokens, {len(seq.request.prompt.image_hashes)} image(s)); shorten "
                "the prompt, send fewer or smaller images, or lower max_tokens."))
            victims: list[Sequence] = []
        else:
            victims = self.scheduler.shrink(plan)
        self.encoder_cache.clear()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("step of %d sequence(s), %d tokens ran out of device memory (%s); %d sent back to waiting, "
                    "next steps at most %d tokens and %d sequences", len(plan.chunks), plan.num_tokens,
                    str(exc).splitlines()[0][:200], len(victims), self.scheduler.token_limit,
                    self.scheduler.seq_limit)
