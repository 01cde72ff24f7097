"""The PD workers, as the front runs them: M ``fovea serve`` processes on loopback ports.

A worker is "starting" until its ``/health`` answers (uvicorn listens only once the model is
loaded and the canary has run), then it gets the images uploaded so far (``on_join``) and is
"ready". One that exits is "dead" at once (its in-flight requests have already failed) and is
started again on a fresh port, after a backoff when it keeps dying before it is ready. A ready
one whose ``/health`` goes unanswered for ``hung_after_s`` (``--pd-timeout``: stopped,
deadlocked, swapping) is killed, so its requests fail with ``pd_worker_lost`` instead of
waiting for ever, and it is restarted the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from fovea.disagg.parent_watch import PARENT_FD_ENV, lifeline
from fovea.front import routing
from fovea.front.children import free_port, pd_worker_command, pd_worker_env
from fovea.front.encoders import backoff_s

log = logging.getLogger("fovea.front")

WATCH_S = 0.25  # how often a worker's process and, while it starts, its /health are looked at
PROBE_TIMEOUT_S = 2.0
HEALTH_EVERY_S = 1.0  # how often a ready worker's /health is asked (a live one answers at once)
HUNG_AFTER_S = 30.0  # --pd-timeout's default
STOP_GRACE_S = 20.0


@dataclass
class PdWorker:
    index: int
    port: int = 0
    process: subprocess.Popen | None = None
    state: str = "starting"  # starting | ready | dead | stopped
    restarts: int = 0
    failures: int = 0  # starts in a row that died before they were ready
    died_at: float = 0.0
    in_flight: int = 0
    answered_at: float = 0.0  # when its /health last answered (ready workers)
    asked_at: float = 0.0
    routed: int = 0  # requests sent to it, over all its restarts (the tie-break between idle workers)
    lifeline: int | None = None  # the pipe end whose closing kills it (parent_watch): held while it runs
    waiting: int = 0  # its engine's waiting requests, as its /health last said (routing.py)
    kv_free: float | None = None  # its KV cache's free share, likewise; None: not reported

    def release(self) -> None:
        """Close its lifeline, once its process has exited."""
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exited(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def status(self) -> dict:
        return {"index": self.index, "pid": self.pid, "port": self.port, "state": self.state,
                "restarts": self.restarts, "in_flight": self.in_flight, "routed": self.routed}


class PdFleet:
    def __init__(self, workers: int, argv: list[str], sockets: list[str], internal_key: str,
                 encode_key: bytes, hung_after_s: float = HUNG_AFTER_S) -> None:
        """``argv``: the front's command line, which each worker runs with its own overrides."""
        self.hung_after_s = hung_after_s
        self.workers = [PdWorker(i) for i in range(workers)]
        self.argv, self.sockets = argv, sockets
        self.env = pd_worker_env(internal_key, encode_key)
        self.headers = {"authorization": f"Bearer {internal_key}"}
        self.on_restart: Callable[[PdWorker], None] = lambda worker: None
        self._stopping = False

    def start(self) -> None:
        for worker in self.workers:
            self._spawn(worker)

    def _spawn(self, worker: PdWorker) -> None:
        worker.port, worker.state = free_port(), "starting"
        worker.release()  # its previous process has exited
        child_end, worker.lifeline = lifeline()
        # A session of its own: a Ctrl-C at the terminal reaches the front alone, which then
        # stops its workers in order instead of racing them.
        try:
            worker.process = subprocess.Popen(pd_worker_command(self.argv, worker.index, worker.port, self.sockets),
                                              env={**self.env, PARENT_FD_ENV: str(child_end)},
                                              pass_fds=(child_end,), start_new_session=True)
        finally:
            os.close(child_end)
        log.info("PD worker %d starting (pid %d, port %d)", worker.index, worker.pid, worker.port)

    # ---- routing --------------------------------------------------------------------------
    def ready(self) -> list[PdWorker]:
        return [w for w in self.workers if w.state == "ready"]

    def choose(self, exclude: set[int] = frozenset(), keys: tuple[bytes, ...] = (),  # type: ignore[assignment]
               affinity: routing.AffinityTable | None = None) -> tuple[PdWorker | None, str]:
        """The ready worker not in ``exclude`` that the request goes to, by load and by the
        affinity of its image ``keys`` (routing.py), and the affinity outcome."""
        return routing.choose([w for w in self.ready() if w.index not in exclude], keys, affinity)

    def suspect(self, worker: PdWorker) -> bool:
        """After a connection failed: mark it dead now if its process is gone (no request
        waits for the watcher to notice). True if it is."""
        if worker.state in ("ready", "starting") and worker.exited():
            self._mark_dead(worker)
            return True
        return worker.state == "dead"

    def _mark_dead(self, worker: PdWorker) -> None:
        code = worker.process.poll() if worker.process is not None else None
        log.warning("PD worker %d (pid %s) exited with code %s", worker.index, worker.pid, code)
        worker.failures += worker.state == "starting"
        worker.state, worker.died_at = "dead", time.monotonic()

    # ---- supervision ----------------------------------------------------------------------
    async def probe(self, client: httpx.AsyncClient, worker: PdWorker) -> bool:
        """Whether its /health answers (any status: a --strict worker answers 503 while degraded);
        what it says of its engine's load is kept for routing."""
        try:
            reply = await client.get(worker.url + "/health", headers=self.headers, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        routing.take_health(worker, reply.content)
        return True

    async def watch(self, client: httpx.AsyncClient, on_join: Callable[[PdWorker], Awaitable[None]]) -> None:
        """Runs for the front's life: each worker watched on its own, so one slow probe or
        replay holds up no other."""
        await asyncio.gather(*(self._watch(client, worker, on_join) for worker in self.workers))

    async def _watch(self, client: httpx.AsyncClient, worker: PdWorker,
                     on_join: Callable[[PdWorker], Awaitable[None]]) -> None:
        while not self._stopping:
            if worker.state in ("ready", "starting") and worker.exited():
                self._mark_dead(worker)
            if worker.state == "dead" and time.monotonic() - worker.died_at >= backoff_s(worker.failures):
                worker.restarts += 1
                self.on_restart(worker)
                self._spawn(worker)
            if worker.state == "starting" and await self.probe(client, worker):
                try:
                    await on_join(worker)
                except httpx.HTTPError as exc:
                    log.warning("PD worker %d could not be given the uploaded images (%s); trying again",
                                worker.index, exc)
                else:
                    if worker.state == "starting" and not worker.exited():
                        worker.state, worker.failures = "ready", 0
                        worker.answered_at = time.monotonic()
                        log.info("PD worker %d (pid %s, port %d) is ready", worker.index, worker.pid, worker.port)
            if worker.state == "ready" and time.monotonic() - worker.asked_at >= HEALTH_EVERY_S:
                await self._check_alive(client, worker)
            await asyncio.sleep(WATCH_S)

    async def _check_alive(self, client: httpx.AsyncClient, worker: PdWorker) -> None:
        worker.asked_at = now = time.monotonic()
        if await self.probe(client, worker):
            worker.answered_at = time.monotonic()
        elif now - worker.answered_at > self.hung_after_s and not worker.exited():
            log.warning("PD worker %d (pid %s) has not answered /health for %.0f s (--pd-timeout): killing it; "
                        "its requests fail with pd_worker_lost and it is restarted", worker.index, worker.pid,
                        now - worker.answered_at)
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()  # type: ignore[union-attr]
            worker.process.wait(10)  # type: ignore[union-attr]
            self._mark_dead(worker)

    def stop(self) -> None:
        """SIGTERM (each worker's uvicorn shuts down: its encoder pool closes its shared
        memory), then SIGKILL for any that is still there after the grace period."""
        self._stopping = True
        for worker in self.workers:
            worker.state = "stopped"
            if not worker.exited():
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in self.workers:
            if worker.process is None:
                continue
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("PD worker %d did not stop within %.0f s: killing it", worker.index, STOP_GRACE_S)
                worker.process.kill()
                worker.process.wait(5)
            worker.release()
