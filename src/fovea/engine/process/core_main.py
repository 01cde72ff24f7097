"""The engine core's process: the model, the scheduler, the KV cache, the vision stage, the
sampler and the grammar masks, with nothing of HTTP in it.

The API process starts it (``client.start_core``) with the server's settings and a ZeroMQ
address. The core binds a ROUTER socket there first, then loads the model, checks its contract,
starts the encode workers (e_pd) and builds and profiles the engine, all as a server in one
process does. An API process connects a DEALER socket and says hello (``("hello", pid)``: the
core watches that pid and drops the process's requests in flight when it exits). It then gets
``("ready", CoreInfo)`` or ``("failed", error)``. After that:

- ``("serving",)`` says its start-up (the canary) is done and it takes requests; the count of
  such processes goes out with the stats, for ``/health`` under ``--api-server-count``.
- ``("submit", sid, prompt, pixel_path, params, rid, want_first_logprobs, scoring)`` queues a
  request and is answered at once with ``("accepted", sid)``, or with ``("refused", sid, error)``
  (a 400 or a 429: before the API process starts the HTTP response). The request's events then
  come as ``("event", sid, event, vision_report)``.
- Everything the core sends goes in ``("batch", [message, ...])``: one frame per loop turn and
  API process.
- ``("cancel", sid)`` drops a request whose client left.
- ``("stop",)`` stops the engine. Queued and running requests end with error events, and the
  process exits.

Every ``STATS_INTERVAL_S`` the core sends ``("stats", dict)``: the queue depth, the cache and
step counters, what the GPU holds now, and the vision and hand-off observations since the last
one. The API process's
``/metrics`` reads them. The core's main thread runs this loop (asyncio); the engine's worker
thread runs the steps. Nothing else in the process takes the GIL: no HTTP, no JSON, no
tokenizer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from fovea import logs
from fovea.config import ServerSettings, engine_config
from fovea.engine.core.request import ErrorEvent, FinishEvent
from fovea.engine.process.wire import GrammarReader, dumps, loads, pixels_in, remove_pixels
from fovea.errors import FoveaError
from fovea.gil import set_switch_interval
from fovea.startup_clock import STARTUP

log = logging.getLogger("fovea.engine.core")

STATS_INTERVAL_S = 0.25


@dataclass(frozen=True)
class CoreSpec:
    """What the API process hands the core at its start."""

    settings: ServerSettings
    address: str  # ZeroMQ endpoint (ipc://...) the core binds
    log_level: str = "info"
    log_format: str = "text"


@dataclass
class CoreInfo:
    """What the API process learns from a ready core: the engine's limits and plan, the model's
    contract, and the start-up phases the core ran."""

    contract: Any  # loading.contract.ModelContract
    max_context: int
    max_model_len: int
    block_size: int
    num_blocks: int
    bytes_per_block: int
    max_queue: int | None
    vocab_size: int
    vision_label: str
    memory_report: dict
    startup_seconds: dict[str, float] = field(default_factory=dict)
    startup_depth: dict[str, int] = field(default_factory=dict)
    pid: int = 0


def safe_error(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError that says what it was."""
    try:
        pickle.dumps(exc, protocol=5)
        return exc
    except Exception:  # noqa: BLE001 - any exception type may refuse to pickle
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class Observations:
    """Vision and hand-off observations made in the engine's threads, sent with the next stats."""

    def __init__(self) -> None:
        self.vision_s: list[float] = []
        self.handoff: list[tuple[float, int]] = []

    def observe_vision(self, seconds: float) -> None:  # the engine's on_vision_seconds
        self.vision_s.append(seconds)

    def observe_handoff(self, seconds_per_image: float, images: int) -> None:  # the encode pool's callback
        self.handoff.append((seconds_per_image, images))

    def take(self) -> tuple[list[float], list[tuple[float, int]]]:
        vision, self.vision_s = self.vision_s, []  # list swaps are atomic under the GIL
        handoff, self.handoff = self.handoff, []
        return vision, handoff


def build_engine(settings: ServerSettings, observed: Observations):
    """The model (loaded and checked), the encode workers (e_pd) and the engine, as ``create_app``
    builds them in one process."""
    from fovea.engine import PagedEngine
    from fovea.serve.app import load_and_check, start_encode_workers

    loaded, contract = load_and_check(settings, None)
    config = engine_config(settings)
    pool = None
    if settings.topology == "e_pd":
        pool = start_encode_workers(settings, loaded, contract, observed, config)
    try:
        with STARTUP.phase("engine"):
            engine = PagedEngine(loaded, config, on_vision_seconds=observed.observe_vision, remote_encoder=pool)
    except BaseException:
        if pool is not None:
            pool.stop()
        raise
    return loaded, contract, engine, pool


def core_info(engine, contract) -> CoreInfo:
    runner = engine.runner
    return CoreInfo(
        contract=contract, max_context=engine.max_context, max_model_len=engine.config.max_model_len,
        block_size=engine.config.block_size, num_blocks=engine.block_manager.num_blocks,
        bytes_per_block=runner.kv_plan.bytes_per_block, max_queue=engine.config.max_queue,
        vocab_size=engine.vocab_size, vision_label=runner.vision_label, memory_report=engine.memory_report(),
        startup_seconds=dict(STARTUP.seconds), startup_depth=dict(STARTUP.depth), pid=os.getpid())


@dataclass
class Held:
    """A request in flight in the core: whose it is, and how many of its choices are still open."""

    peer: bytes
    sid: int
    prompt: Any
    cancelled: threading.Event | None = None
    open_choices: int = 1


class CoreServer:
    """The core's loop: requests from the API process(es) into the engine, events back. It
    serves from its start: a hello while the engine is being built waits for ``ready``.

    The engine's thread hands each event to ``post`` (a deque and, once per burst, one wake-up of
    this loop), and one callback on the loop sends everything pending, one message per API
    process. No task per request and no queue between: a token is one loop turn from the socket."""

    def __init__(self, sock: zmq.asyncio.Socket, observed: Observations) -> None:
        self.sock, self.observed = sock, observed
        self.engine = self.loaded = self.info = self.grammars = self.pool = None
        self.held: dict[tuple[bytes, int], Held] = {}
        self.peers: set[bytes] = set()
        self.serving: set[bytes] = set()  # API processes done with their start-up (``/health``: ready)
        self._watched: dict[bytes, int] = {}  # an API process's socket identity -> a pidfd on it
        self._pending: collections.deque[tuple[bytes, tuple]] = collections.deque()
        self._scheduled = False
        self._loop = asyncio.get_running_loop()  # built in the loop it serves (``run``)
        self._stopping = False

    def started(self, loaded, engine, info: CoreInfo, pool=None) -> None:
        self.loaded, self.engine, self.info, self.pool = loaded, engine, info, pool
        eos = sorted(t for t in loaded.eos_token_ids if isinstance(t, int) and t >= 0)
        self.grammars = GrammarReader(loaded.tokenizer, eos)
        for peer in self.peers:
            self.post(peer, ("ready", info))

    # ---- out ------------------------------------------------------------------------
    def post(self, peer: bytes, message: tuple) -> None:
        """From any thread: ``message`` goes to ``peer`` at the loop's next turn, in order."""
        self._pending.append((peer, message))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._send_pending)

    def _send_pending(self) -> None:
        # Cleared first: a message posted from now on is sent below or schedules a send of its own.
        self._scheduled = False
        batches: dict[bytes, list[tuple]] = {}
        while self._pending:
            peer, message = self._pending.popleft()
            batches.setdefault(peer, []).append(message)
            if message[0] == "event" and message[4]:  # the request's last event: it is no longer held
                self.held.pop((peer, message[1]), None)
        for peer, messages in batches.items():
            sent = self.sock.send_multipart([peer, dumps(("batch", [m[:4] for m in messages]))])
            sent.add_done_callback(_log_send_error)  # SNDHWM 0: done at once unless the socket broke

    def _emitter(self, held: Held):
        """The engine thread's callback for one request's events."""
        key = (held.peer, held.sid)

        def emit(event) -> None:
            vision, last = None, False
            if isinstance(event, FinishEvent):
                vision = self.engine.encoder_cache.timings.report(held.prompt)
                held.open_choices -= 1
                last = held.open_choices <= 0
            elif isinstance(event, ErrorEvent):
                event.error = safe_error(event.error)
                last = True  # the API process ends the request at its first error
            if key in self.held or last:
                self.post(held.peer, ("event", held.sid, event, vision, last))

        return emit

    async def _stats(self) -> None:
        while not self._stopping:
            await asyncio.sleep(STATS_INTERVAL_S)
            if self.engine is None:
                continue
            vision, handoff = self.observed.take()
            engine = self.engine
            stats = {"queue_depth": engine.queue_depth, "cache_hits": engine.encoder_cache.hits,
                     "cache_misses": engine.encoder_cache.misses, "oom_recoveries": engine.oom_recoveries,
                     "steps": engine.steps, "phase_seconds": dict(engine.phase_seconds), "vision_s": vision,
                     "handoff": handoff, "memory_now": engine.memory_now(),
                     "kv_free_blocks": engine.block_manager.num_free,  # for /health's kv_free_share
                     "api_serving": len(self.serving)}
            if self.pool is not None:  # e_pd: the encode workers, for /health
                stats["encode_workers"] = {"status": self.pool.status(), "handoff": self.pool.handoff_summary()}
            for peer in self.peers:
                self.post(peer, ("stats", stats))

    # ---- in -------------------------------------------------------------------------
    def submit(self, peer: bytes, sid: int, prompt, pixel_path: str | None, params, rid: str,
               want_first_logprobs: bool, scoring) -> None:
        try:
            prompt = pixels_in(prompt, pixel_path)
            params = self.grammars.params_in(params)
            held = Held(peer, sid, prompt, open_choices=params.n)
            self.held[(peer, sid)] = held
            held.cancelled = self.engine.submit_to(self._emitter(held), prompt, params, rid, want_first_logprobs,
                                                   scoring)
        except BaseException as exc:  # noqa: BLE001 - a refusal goes back to the request, not up
            self.held.pop((peer, sid), None)
            remove_pixels(pixel_path)
            self.post(peer, ("refused", sid, safe_error(exc)))
            return
        self.post(peer, ("accepted", sid))

    def cancel(self, peer: bytes, sid: int) -> None:
        held = self.held.pop((peer, sid), None)
        if held is not None and held.cancelled is not None:
            held.cancelled.set()  # the worker drops it, or frees its blocks, at its next step

    def watch(self, peer: bytes, pid: int) -> None:
        """When the API process ``pid`` exits, its requests are dropped (``peer_gone``): nobody
        reads their tokens any more, and the other API processes' requests need the room."""
        if peer in self._watched:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:  # already gone, or no pidfd here: its requests finish unread
            log.warning("cannot watch API process %d (%s)", pid, exc)
            return
        self._watched[peer] = fd
        self._loop.add_reader(fd, self.peer_gone, peer, pid)

    def peer_gone(self, peer: bytes, pid: int) -> None:
        fd = self._watched.pop(peer, None)
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)
        self.peers.discard(peer)
        self.serving.discard(peer)
        dropped = [key for key in self.held if key[0] == peer]
        for key in dropped:
            self.cancel(*key)
        log.warning("API process %d exited: dropped its %d request(s) in flight", pid, len(dropped))

    async def serve(self) -> None:
        """Until ``stop``: the first messages are hellos, answered once the engine is ready."""
        stats = self._loop.create_task(self._stats())
        try:
            while True:
                peer, frame = await self.sock.recv_multipart()
                message = loads(frame)
                kind = message[0]
                if kind == "hello":
                    self.peers.add(peer)
                    if len(message) > 1:
                        self.watch(peer, message[1])
                    if self.info is not None:
                        self.post(peer, ("ready", self.info))
                elif kind == "serving":
                    self.serving.add(peer)
                elif kind == "submit":
                    self.submit(peer, *message[1:])
                elif kind == "cancel":
                    self.cancel(peer, message[1])
                elif kind == "stop":
                    await self.stop()
                    return
        finally:
            self._stopping = True
            stats.cancel()

    async def refuse_start(self, exc: BaseException, wait_s: float = 30.0) -> None:
        """Tell the API process(es) why the core cannot start (after their hello, which may come
        after the failure), then return."""
        deadline = time.monotonic() + wait_s
        while not self.peers and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                peer, frame = await asyncio.wait_for(self.sock.recv_multipart(), 0.2)
                if loads(frame)[0] == "hello":
                    self.peers.add(peer)
        for peer in self.peers:
            await self.sock.send_multipart([peer, dumps(("failed", safe_error(exc)))])

    async def stop(self) -> None:
        """Stop the engine: what is queued or running ends with error events, sent before exit."""
        self._stopping = True
        await asyncio.to_thread(self.engine.stop)  # its last error events are posted meanwhile
        self._send_pending()
        for peer in self.peers:
            await self.sock.send_multipart([peer, dumps(("stopped",))])


def _log_send_error(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.error("a message to an API process was lost: %s", sent.exception())


async def run(spec: CoreSpec) -> int:
    """Bind, build the engine in a thread while the loop answers, serve until stopped; the exit code."""
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block an event: the API reads them all
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(spec.address)
    observed = Observations()
    server = CoreServer(sock, observed)
    serving = asyncio.get_running_loop().create_task(server.serve())
    engine = pool = None
    try:
        try:
            loaded, contract, engine, pool = await asyncio.to_thread(build_engine, spec.settings, observed)
            engine.start()
            server.started(loaded, engine, core_info(engine, contract), pool)
        except Exception as exc:
            if not isinstance(exc, FoveaError):  # a refusal is one line in the API process; anything else
                log.exception("the engine core could not start")  # is a bug, with its traceback here
            serving.cancel()
            await server.refuse_start(exc)
            return 1
        await serving
        return 0
    finally:
        if engine is not None:
            engine.stop()
        if pool is not None:
            pool.stop()
        sock.close()
        context.term()


def main(spec: CoreSpec) -> None:
    """The process's entry (``multiprocessing`` spawn target)."""
    from fovea.disagg.parent_watch import exit_with_parent

    logs.configure(spec.log_level, spec.log_format, "engine-core")
    exit_with_parent()
    set_switch_interval()  # the engine's worker thread and this loop, which sends its events
    sys.exit(asyncio.run(run(spec)))
