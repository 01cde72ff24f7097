"""The engine as the API process sees it when the core runs in a process of its own.

``EngineClient`` has the surface of ``PagedEngine`` that the server uses (``submit``,
``generate``, the limits, the counters, ``memory_report``, ``start``/``stop``), so the routes,
the canary and grounding do not know which one they hold. Requests go to the core over a ZeroMQ
DEALER socket (``core_main`` explains the messages), pixels through shared memory
(``wire``). One reader task on the server's event loop takes the core's answers and hands each
request its events.

A request is accepted or refused by the core before its HTTP response starts: the routes call
``await submission.accepted()`` after ``submit``, so a 429 or a 400 from the core is still a
plain HTTP error, never a 200 whose stream breaks.

If the core dies, every request in flight ends with an ``engine_unavailable`` error event (503
before a stream starts), ``/health`` says why, and the server stops with exit status 1 so that its
supervisor starts it again. A core restarted under live connections would give their requests
to a model whose state they no longer hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import zmq
import zmq.asyncio

from fovea.engine.core.request import (
    ErrorEvent,
    Event,
    FinishEvent,
    PromptScoring,
    check_fits_context,
    check_token_ids,
    overloaded,
)
from fovea.engine.process.core_main import CoreInfo, CoreSpec
from fovea.engine.process.core_main import main as core_main
from fovea.engine.process.wire import dumps, loads, params_out, pixels_out, remove_orphans, remove_pixels
from fovea.engine.sampling.params import SamplingParams
from fovea.errors import FoveaError, InvalidRequest
from fovea.loading.prompt import EncodedPrompt

log = logging.getLogger("fovea.engine.client")

READY_TIMEOUT_S = 3600.0  # loading and profiling a large model over a slow disk


class EngineUnavailable(FoveaError):
    """The engine core is gone (it crashed or was stopped): nothing can be answered now."""

    status, code, type = 503, "engine_unavailable", "server_error"


class RemoteTimings:
    """``encoder_cache.timings``: each finished prompt's vision report, as the core sent it."""

    def __init__(self) -> None:
        self._by_prompt: dict[int, tuple[weakref.ref, dict | None]] = {}

    def put(self, prompt: EncodedPrompt, report: dict | None) -> None:
        key = id(prompt)
        self._by_prompt[key] = (weakref.ref(prompt, lambda _: self._by_prompt.pop(key, None)), report)

    def report(self, prompt: object) -> dict | None:
        held = self._by_prompt.get(id(prompt))
        return held[1] if held is not None and held[0]() is prompt else None


class RemoteEncodeWorkers:
    """e_pd's encode-worker pool as /health reads it (``status``, ``handoff_summary``), from the
    core's stats."""

    def __init__(self) -> None:
        self.last: dict = {"status": None, "handoff": None}

    def status(self):
        return self.last["status"]

    def handoff_summary(self):
        return self.last["handoff"]


class RemoteSubmission:
    """One request sent to the core (``Submission``'s surface): ``accepted`` waits for the core to
    queue or refuse it; ``events`` yields its events; leaving early cancels it in the core."""

    def __init__(self, client: EngineClient, sid: int, n: int, prompt: EncodedPrompt) -> None:
        self.client, self.sid, self.n, self.prompt = client, sid, n, prompt
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A refusal nobody awaits any more (the request was cancelled first) is not an error to log.
        self._accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._done = False

    def deliver(self, event: Event) -> None:
        self._events.put_nowait(event)

    def settle(self, error: BaseException | None) -> None:
        if not self._accepted.done():
            if error is None:
                self._accepted.set_result(None)
            else:
                self._accepted.set_exception(error)

    async def accepted(self) -> None:
        """Returns once the core has queued the request; raises its refusal (400, 429, 503)."""
        await self._accepted

    def cancel(self) -> None:
        """Drop the request: in the core too unless it has ended there already."""
        self.client._release(self.sid, tell_core=not self._done)
        self._done = True

    async def events(self) -> AsyncIterator[Event]:
        finished = 0
        try:
            try:
                await self._accepted
            except Exception as exc:  # noqa: BLE001 - a refusal is this request's one event
                self._done = True
                yield ErrorEvent(exc)
                return
            while True:
                event = await self._events.get()
                yield event
                if isinstance(event, ErrorEvent):
                    self._done = True
                    return
                if isinstance(event, FinishEvent):
                    finished += 1
                    if finished == self.n:
                        self._done = True
                        return
        finally:
            self.cancel()  # nothing when it ended: the core has dropped it already


class EngineClient:
    """PagedEngine's serving surface over the engine core's socket (see the module's docstring)."""

    def __init__(self, process: multiprocessing.process.BaseProcess | None, address: str, info: CoreInfo,
                 model_context: int, on_death: Callable[[], None] | None = None, api_servers: int = 1) -> None:
        """``process``: the core's process when this API process started it (and stops it);
        None for a further API process (``--api-server-count``), which watches the core's pid.
        ``model_context``: the model's own context length (the API process's config).
        ``api_servers``: how many API processes feed the core (``--api-server-count``)."""
        self.process, self.address, self.info, self.model_context = process, address, info, model_context
        self.before_stop: list[Callable[[], None]] = []  # run first in ``stop`` (the other API processes)
        self._watch: int | None = None
        self.owner = f"{os.getpid()}"  # this process's pixel files: fovea-pixels-<pid>-*
        self.on_death = on_death
        self.config = SimpleNamespace(max_model_len=info.max_model_len, block_size=info.block_size,
                                      max_queue=info.max_queue)
        self.block_manager = SimpleNamespace(num_blocks=info.num_blocks)
        self.runner = SimpleNamespace(kv_plan=SimpleNamespace(bytes_per_block=info.bytes_per_block),
                                      vision_label=info.vision_label)
        self.vocab_size = info.vocab_size
        self.max_context = info.max_context
        self.encoder_cache = SimpleNamespace(hits=0, misses=0, timings=RemoteTimings())
        self.queue_depth = 0
        self.oom_recoveries = 0
        self.steps = 0
        self.phase_seconds: dict[str, float] = {}
        self.on_vision_seconds: Callable[[float], None] = lambda s: None
        self.on_handoff: Callable[[float, int], None] = lambda s, n: None
        self.encode_workers = RemoteEncodeWorkers()  # e_pd: the core's pool, as its stats last said
        self.api_servers = api_servers
        self.api_serving = 0  # API processes serving, as the core's stats last said
        self.all_api_serving_seen = False  # every one of them was serving at least once
        self.dead: EngineUnavailable | None = None
        self._memory_report = info.memory_report
        self.memory_now: dict | None = info.memory_report.get("now")
        self._context: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._live: dict[int, RemoteSubmission] = {}
        self._pixels: dict[int, str] = {}  # pixel files the core has not taken yet
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Connect and start reading the core's answers (on the running loop: the app's lifespan)."""
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(self.address)
        self._reader = self._loop.create_task(self._read())
        # Readable when the core's process ends: its sentinel here, a pidfd in a further API process.
        self._watch = self.process.sentinel if self.process is not None else os.pidfd_open(self.info.pid)
        self._loop.add_reader(self._watch, self._core_exited)
        self._send(("hello", os.getpid()))  # the core drops this process's requests if it dies

    def stop(self) -> None:
        """Stop the core (when this process started it): it ends what is queued or running with
        error events, then exits. A further API process only disconnects."""
        for hook in self.before_stop:
            hook()
        self._unwatch()
        if self.process is None:
            self._close()
            return
        if self.process.is_alive():
            if self._sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send(dumps(("stop",)), zmq.NOBLOCK)
            else:  # never started (refused at start-up): a socket of its own for the one message
                context = zmq.Context()
                sock = context.socket(zmq.DEALER)
                sock.connect(self.address)
                sock.send(dumps(("stop",)))
                sock.close(linger=2000)
                context.term()
        self.process.join(timeout=60)
        if self.process.is_alive():
            log.warning("the engine core did not stop within 60 s: killing it")
            self.process.kill()
            self.process.join(timeout=10)
        self._close()

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._context.term()
            self._sock = None
        remove_orphans(self.owner)

    def _unwatch(self) -> None:
        if self._loop is not None and self._watch is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._watch)
            if self.process is None:
                with contextlib.suppress(OSError):
                    os.close(self._watch)
            self._watch = None

    def announce_serving(self) -> None:
        """Tell the core this process's start-up is done: it counts toward ``/health``'s readiness."""
        self._send(("serving",))

    # ---- requests -------------------------------------------------------------------
    def check_fits(self, prompt: EncodedPrompt, params: SamplingParams) -> None:
        """The engine's own up-front refusals (``PagedEngine.check_fits``), here before the send."""
        check_fits_context(prompt, params, self.model_context, self.max_context)
        check_token_ids(params, self.vocab_size)
        if self.info.max_queue is not None and params.n > self.info.max_queue:
            raise InvalidRequest(f"n={params.n} choices would not fit this server's queue of {self.info.max_queue} "
                                 "requests (--max-queue); ask for fewer.", param="n")

    def refuse_when_full(self) -> None:
        """A 429 now when the core last reported a full queue (``submit`` still lets the core decide)."""
        if self.dead is not None:
            raise self.dead
        if self.info.max_queue is not None and self.queue_depth >= self.info.max_queue:
            raise overloaded(self.info.max_queue)

    def submit(self, prompt: EncodedPrompt, params: SamplingParams, request_id: str | None = None,
               want_first_logprobs: bool = False, scoring: PromptScoring | None = None) -> RemoteSubmission:
        if self.dead is not None:
            raise self.dead
        self.check_fits(prompt, params)
        if scoring is not None and scoring.full_rows > len(prompt.input_ids) - 1:
            raise InvalidRequest(f"{scoring.full_rows} full rows asked of a prompt of {len(prompt.input_ids)} "
                                 "tokens: its first token has no distribution before it.")
        sid = next(self._ids)
        stub, pixel_path = pixels_out(prompt, self.owner)
        submission = RemoteSubmission(self, sid, params.n, prompt)
        self._live[sid] = submission
        if pixel_path is not None:
            self._pixels[sid] = pixel_path
        try:
            self._send(("submit", sid, stub, pixel_path, params_out(params), request_id or uuid.uuid4().hex,
                        want_first_logprobs, scoring))
        except BaseException:
            self._forget(sid)
            raise
        return submission

    async def generate(self, prompt: EncodedPrompt, params: SamplingParams, request_id: str | None = None,
                       want_first_logprobs: bool = False, scoring: PromptScoring | None = None
                       ) -> AsyncIterator[Event]:
        submission = self.submit(prompt, params, request_id, want_first_logprobs, scoring)
        async with contextlib.aclosing(submission.events()) as events:
            async for event in events:
                yield event

    def memory_report(self) -> dict:
        """The plan as the core reported it at start-up, what it holds now (its last stats) and its
        out-of-memory recoveries since."""
        report = {**self._memory_report, "oom_recoveries": self.oom_recoveries}
        if self.memory_now is not None:
            report["now"] = self.memory_now
        return report

    # ---- the socket -----------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        # SNDHWM 0: a DEALER send never blocks, so the future it returns is already done.
        self._sock.send(dumps(message), copy=False)

    def _release(self, sid: int, tell_core: bool) -> None:
        if sid in self._live:
            self._forget(sid)
            if tell_core and self.dead is None and self._sock is not None:
                self._send(("cancel", sid))

    def _forget(self, sid: int) -> None:
        self._live.pop(sid, None)
        remove_pixels(self._pixels.pop(sid, None))

    async def _read(self) -> None:
        while True:
            message = loads(await self._sock.recv())
            for one in message[1] if message[0] == "batch" else [message]:
                self._take(one)

    def _take(self, message: tuple) -> None:
        kind = message[0]
        if kind == "event":
            _, sid, event, vision = message
            submission = self._live.get(sid)
            if submission is not None:
                if isinstance(event, FinishEvent):
                    self.encoder_cache.timings.put(submission.prompt, vision)
                submission.deliver(event)
        elif kind == "accepted" or kind == "refused":
            sid = message[1]
            self._pixels.pop(sid, None)  # the core took the file (and removed it)
            submission = self._live.get(sid)
            if submission is not None:
                submission.settle(message[2] if kind == "refused" else None)
                if kind == "refused":
                    self._live.pop(sid, None)
        elif kind == "stats":
            self._take_stats(message[1])

    def _take_stats(self, stats: dict[str, Any]) -> None:
        self.queue_depth = stats["queue_depth"]
        self.encoder_cache.hits, self.encoder_cache.misses = stats["cache_hits"], stats["cache_misses"]
        self.oom_recoveries, self.steps = stats["oom_recoveries"], stats["steps"]
        self.phase_seconds = stats["phase_seconds"]
        self.memory_now = stats["memory_now"]
        self.block_manager.num_free = stats["kv_free_blocks"]
        for seconds in stats["vision_s"]:
            self.on_vision_seconds(seconds)
        for seconds, images in stats["handoff"]:
            self.on_handoff(seconds, images)
        if "encode_workers" in stats:
            self.encode_workers.last = stats["encode_workers"]
        self.api_serving = stats["api_serving"]
        if self.api_serving >= self.api_servers and not self.all_api_serving_seen:
            self.all_api_serving_seen = True
            if self.api_servers > 1 and self.process is not None:  # logged once, by the first API process
                log.info("all %d API processes are serving", self.api_servers)

    def _core_exited(self) -> None:
        """The core's process ended while serving: fail what is in flight, then stop the server."""
        self._unwatch()
        if self.process is not None:
            self.process.join(timeout=1)
            status = f"status {self.process.exitcode}"
        else:
            status = "its status is its parent's to read"
        self.dead = EngineUnavailable("the engine core exited; this server is restarting. Retry shortly.")
        log.error("the engine core (pid %s) exited (%s): failing %d request(s) in flight and stopping the server",
                  self.info.pid, status, len(self._live))
        for sid, submission in list(self._live.items()):
            submission.settle(self.dead)
            submission.deliver(ErrorEvent(self.dead))
            self._forget(sid)
        remove_orphans(self.owner)
        if self.on_death is not None:
            self.on_death()


def start_core(settings, log_level: str = "info", log_format: str = "text", timeout_s: float = READY_TIMEOUT_S,
               while_waiting: Callable[[], None] = lambda: None,
               on_address: Callable[[str], None] = lambda address: None,
               ) -> tuple[multiprocessing.process.BaseProcess, str, CoreInfo]:
    """Start the engine core's process and wait until it is ready: (process, address, its info).
    ``on_address`` is given the core's address as soon as its process starts (the further API
    processes start then, beside the core's load); ``while_waiting`` runs here meanwhile (the API
    process's own loading). Raises the core's own refusal (a ``FoveaError`` such as a model that
    cannot load) when it cannot start."""
    address = f"ipc://{tempfile.gettempdir()}/fovea-core-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    process = multiprocessing.get_context("spawn").Process(
        target=core_main, args=(CoreSpec(settings, address, log_level, log_format),), name="fovea-engine-core",
        daemon=False)
    process.start()
    try:
        on_address(address)
        return process, address, wait_for_core(address, timeout_s, process, while_waiting)
    except BaseException:
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
        raise


def wait_for_core(address: str, timeout_s: float = READY_TIMEOUT_S,
                  process: multiprocessing.process.BaseProcess | None = None,
                  while_waiting: Callable[[], None] = lambda: None) -> CoreInfo:
    """The core's info once it is ready: a hello from a socket of its own, then its answer (the core
    answers hellos that come while it starts once it is ready). ``process``: the core's, when this
    process started it (its exit is noticed); a further API process relies on its deadline."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(dumps(("hello",)))
        while_waiting()
        deadline = time.monotonic() + timeout_s
        while True:
            if sock.poll(200):
                message = loads(sock.recv())
                for one in message[1] if message[0] == "batch" else [message]:
                    if one[0] == "ready":
                        return one[1]
                    if one[0] == "failed":
                        if process is not None:
                            process.join(timeout=30)
                        raise one[1]
                continue  # stats before ready: none are sent; anything else is ignored
            if process is not None and not process.is_alive():
                raise EngineUnavailable(f"the engine core exited with status {process.exitcode} while starting; "
                                        "its log above says why")
            if time.monotonic() > deadline:
                if process is not None:
                    process.kill()
                raise EngineUnavailable(f"the engine core was not ready within {timeout_s:.0f} s")
    finally:
        sock.close(linger=0)
        context.term()


def stop_server_on_death(app_state: Any) -> Callable[[], None]:
    """What the client does when the core dies: mark the exit status, then, a moment later (the
    failed requests' error events are written meanwhile), call ``app_state.stop_server`` (set by
    whatever runs the server: the CLI stops uvicorn with SIGTERM)."""

    def on_death() -> None:
        app_state.exit_code = 1
        stop = getattr(app_state, "stop_server", None)
        if stop is not None:
            asyncio.get_running_loop().call_later(0.5, stop)

    return on_death
