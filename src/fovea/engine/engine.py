"""The serving engine: a bounded queue in front of one worker thread that runs batches.

Requests that are waiting when the worker becomes free are taken together (up to
``max_batch_size``) and run as one batch. The HTTP layer talks to the engine only through
``submit``, which returns an async stream of events for one request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.hf_runner import HFBatchRunner
from fovea.engine.image_encoder import start_worker
from fovea.engine.request import EngineRequest, ErrorEvent, Event, check_fits_context, submit_and_stream
from fovea.engine.sampling import SamplingParams
from fovea.model.loader import LoadedModel
from fovea.model.prompt import EncodedPrompt

log = logging.getLogger("fovea.engine")


@dataclass(slots=True)
class EngineConfig:
    max_batch_size: int = 16
    max_queue: int = 256  # waiting requests beyond this are refused with 429
    # CPU threads for the model on a CPU device. Default: all cores but one, which is left to
    # HTTP and image preprocessing; oversubscribed OpenMP threads spin and starve them
    # (measured on 2 cores: 8 clients got 7.9 req/s with 2 threads, 22 req/s with 1).
    cpu_threads: int | None = None
    encoder_cache_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be positive")


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 on_vision_seconds: Callable[[float], None] | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.encoder_cache = EncoderCache(self.config.encoder_cache_bytes)
        self.runner = HFBatchRunner(loaded, self.encoder_cache, on_vision_seconds)
        self._queue: queue.Queue[EngineRequest | None] = queue.Queue(maxsize=self.config.max_queue)
        self._thread: threading.Thread | None = None
        self.running_batch = 0

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = start_worker(self._loop, "fovea-engine", self.loaded.device, self.config.cpu_threads)

    def stop(self) -> None:
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=30)  # after the queued work; never forever
            except queue.Full:
                log.error("engine queue still full after 30 s; leaving the worker thread behind")
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # ---- requests -------------------------------------------------------------------
    def check_fits(self, prompt: EncodedPrompt, params: SamplingParams) -> None:
        check_fits_context(prompt, params, self.loaded.context_length)

    async def generate(self, prompt: EncodedPrompt, params: SamplingParams, request_id: str | None = None,
                       want_first_logprobs: bool = False) -> AsyncIterator[Event]:
        """Stream the events of one request; cancel it if the consumer stops early."""
        self.check_fits(prompt, params)
        async for event in submit_and_stream(self._queue, self.config.max_queue, prompt, params, request_id,
                                             want_first_logprobs):
            yield event

    # ---- worker ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.config.max_batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            batch = [r for r in batch if not r.cancelled.is_set()]
            if not batch:
                continue
            self.running_batch = len(batch)
            try:
                self.runner.run(batch)
            except Exception as exc:
                log.exception("batch of %d failed", len(batch))
                for r in batch:
                    r.emit(ErrorEvent(exc))
            finally:
                self.running_batch = 0
