"""The PD workers, as the front runs them: M ``fovea serve`` processes, on loopback ports (or on Ray nodes).

A worker is "starting" until its ``/health`` answers (uvicorn listens only once the model is
loaded and the canary has run), then it gets the images uploaded so far (``on_join``) and is
"ready". One that exits is "dead" at once (its in-flight requests have already failed) and is
started again on a fresh port, after a backoff when it keeps dying before it is ready. A ready
one whose ``/health`` goes unanswered for ``hung_after_s`` (``--pd-timeout``: stopped,
deadlocked, swapping) is killed, so its requests fail with ``pd_worker_lost`` instead of
waiting for ever, and it is restarted the same way. A ready one that a connection failed to
(a request lost, a connection or its /health refused) but whose process is not known to be gone
is "doubted": passed over by routing until a /health asked after the failure answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from fovea.front import routing
from fovea.front.children import LocalProcess, pd_worker_command, pd_worker_env
from fovea.front.encoders import backoff_s
from fovea.front.ray_hosts import Placement

if TYPE_CHECKING:
    from fovea.front.ray_hosts import RayProcess

log = logging.getLogger("fovea.front")

WATCH_S = 0.25  # how often a worker's process and, while it starts, its /health are looked at
PROBE_TIMEOUT_S = 2.0
HEALTH_EVERY_S = 1.0  # how often a ready worker's /health is asked (a live one answers at once)
HUNG_AFTER_S = 30.0  # --pd-timeout's default
STOP_GRACE_S = 20.0


@dataclass
class PdWorker:
    index: int
    child: LocalProcess | RayProcess | None = None
    state: str = "starting"  # starting | ready | dead | stopped
    restarts: int = 0
    failures: int = 0  # starts in a row that died before they were ready
    died_at: float = 0.0
    launched_at: float = 0.0
    in_flight: int = 0
    answered_at: float = 0.0  # when its /health last answered (ready workers)
    failed_at: float = 0.0  # when a connection to it last failed: a request lost or refused, or its /health refused
    asked_at: float = 0.0
    routed: int = 0  # requests sent to it, over all its restarts (the tie-break between idle workers)
    waiting: int = 0  # its engine's waiting requests, as its /health last said (routing.py)
    kv_free: float | None = None  # its KV cache's free share, likewise; None: not reported

    @property
    def doubted(self) -> bool:
        """A connection to it failed since its /health last answered: its process may be going
        (a Ray node's removal is seen by Ray seconds after the connections break), so requests go
        to the others until its /health answers again or it is found dead."""
        return self.failed_at > self.answered_at

    @property
    def placement(self) -> Placement | None:
        return self.child.placed() if self.child is not None else None

    @property
    def port(self) -> int:
        placement = self.placement
        return placement.port if placement is not None else 0

    @property
    def url(self) -> str:
        placement = self.placement
        return f"http://{placement.host}:{placement.port}" if placement is not None else ""

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None

    def exited(self) -> bool:
        return self.child is None or self.child.exited()

    def status(self) -> dict:
        placement = self.placement
        state = self.state if placement is not None or self.state != "starting" else "placing"
        return {"index": self.index, "pid": self.pid, "port": self.port, "state": state,
                "node": placement.node if placement is not None else None,
                "host": placement.host if placement is not None else None,
                "restarts": self.restarts, "in_flight": self.in_flight, "routed": self.routed,
                "doubted": self.state == "ready" and self.doubted}


class PdFleet:
    def __init__(self, workers: int, argv: list[str], sockets: list[str], internal_key: str,
                 encode_key: bytes, hung_after_s: float = HUNG_AFTER_S,
                 make_child: Callable[[int], LocalProcess | RayProcess] | None = None) -> None:
        """``argv``: the front's command line, which each worker runs with its own overrides.
        ``make_child``: where worker i runs (default: a process on this machine; on Ray, an actor).
        ``sockets``: each shared encode worker's entry (a socket path, or on Ray a table entry)."""
        self.hung_after_s = hung_after_s
        self.workers = [PdWorker(i) for i in range(workers)]
        self.argv, self.sockets = argv, sockets
        self.env = pd_worker_env(internal_key, encode_key)
        self.headers = {"authorization": f"Bearer {internal_key}"}
        self.on_restart: Callable[[PdWorker], None] = lambda worker: None
        # What a (re)started worker is given beside its command: files written on its node first.
        self.files: Callable[[PdWorker], tuple[dict[str, str], dict[str, str]]] = lambda worker: ({}, {})
        self.make_child = make_child or (lambda index: LocalProcess(f"PD worker {index}"))
        self._stopping = False

    def start(self) -> None:
        for worker in self.workers:
            worker.child = self.make_child(worker.index)
            self._spawn(worker)

    def _spawn(self, worker: PdWorker) -> None:
        worker.state, worker.launched_at = "starting", time.monotonic()
        env, files = self.files(worker)
        worker.child.launch(pd_worker_command(self.argv, worker.index, self.sockets),  # type: ignore[union-attr]
                            {**self.env, **env}, files)
        self._log_placed(worker)

    def _log_placed(self, worker: PdWorker) -> None:
        placement = worker.placement
        if placement is not None:
            log.info("PD worker %d starting (pid %d, %s:%d, node %s)", worker.index, placement.pid,
                     placement.host, placement.port, placement.node)

    # ---- routing --------------------------------------------------------------------------
    def ready(self) -> list[PdWorker]:
        return [w for w in self.workers if w.state == "ready"]

    def choose(self, exclude: set[int] = frozenset(), keys: tuple[bytes, ...] = (),  # type: ignore[assignment]
               affinity: routing.AffinityTable | None = None) -> tuple[PdWorker | None, str]:
        """The ready worker not in ``exclude`` that the request goes to, by load and by the
        affinity of its image ``keys`` (routing.py), and the affinity outcome. A doubted worker
        only when every other is doubted too: better a try than a refusal."""
        candidates = [w for w in self.ready() if w.index not in exclude]
        return routing.choose([w for w in candidates if not w.doubted] or candidates, keys, affinity)

    def suspect(self, worker: PdWorker) -> bool:
        """After a connection failed: mark it dead now if its process is gone (no request
        waits for the watcher to notice), else doubted until its /health answers. True if dead."""
        if worker.state in ("ready", "starting") and worker.exited():
            self._mark_dead(worker)
            return True
        worker.failed_at = time.monotonic()
        return worker.state == "dead"

    def _mark_dead(self, worker: PdWorker) -> None:
        code = worker.child.exit_code() if worker.child is not None else None
        log.warning("PD worker %d (pid %s) exited with code %s", worker.index, worker.pid, code)
        worker.failures += worker.state == "starting"
        worker.state, worker.died_at = "dead", time.monotonic()

    # ---- supervision ----------------------------------------------------------------------
    async def probe(self, client: httpx.AsyncClient, worker: PdWorker) -> bool:
        """Whether its /health answers (any status: a --strict worker answers 503 while degraded);
        what it says of its engine's load is kept for routing. Refused or cut off, it is doubted."""
        try:
            reply = await client.get(worker.url + "/health", headers=self.headers, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            if not isinstance(exc, httpx.TimeoutException):  # refused or cut: doubted (a slow one is not)
                worker.failed_at = time.monotonic()
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
            if worker.state == "starting" and worker.placement is None:  # Ray places its actor
                await asyncio.sleep(WATCH_S)
                if worker.placement is not None:
                    self._log_placed(worker)
                continue
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
            worker.answered_at = now  # when asked: an answer to a question asked before a failure clears no doubt
        elif now - worker.answered_at > self.hung_after_s and not worker.exited():
            log.warning("PD worker %d (pid %s) has not answered /health for %.0f s (--pd-timeout): killing it; "
                        "its requests fail with pd_worker_lost and it is restarted", worker.index, worker.pid,
                        now - worker.answered_at)
            worker.child.kill()  # type: ignore[union-attr]
            self._mark_dead(worker)

    def stop(self) -> None:
        """SIGTERM (each worker's uvicorn shuts down: its encoder pool closes its shared
        memory), then SIGKILL for any that is still there after the grace period; on Ray, the
        actors killed for good."""
        self._stopping = True
        for worker in self.workers:
            worker.state = "stopped"
            if worker.child is not None:
                worker.child.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in self.workers:
            if worker.child is not None:
                worker.child.finish(deadline)
