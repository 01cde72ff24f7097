"""The shared encode workers, as the front runs them: N spawned processes, each on a Unix socket.

A worker is ready when its socket exists (``encode_server`` listens only once its vision part
is loaded). One that dies is started again, its stale socket removed first; the PD workers'
pools reconnect on their own. All sockets live in one private directory that the front removes
when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from fovea.disagg import encode_server

log = logging.getLogger("fovea.front")

MAX_SOCKET_PATH = 100  # AF_UNIX paths are limited to 107 bytes on Linux
STOP_GRACE_S = 10.0


def backoff_s(failures: int) -> float:
    """How long a worker that keeps failing to start waits before the next try."""
    return 0.0 if failures == 0 else min(30.0, 2.0 ** failures)


@dataclass
class EncodeProcess:
    index: int
    socket: str
    process: multiprocessing.process.BaseProcess | None = None
    state: str = "starting"  # starting | ready | dead | stopped
    restarts: int = 0
    failures: int = 0  # starts in a row that died before their socket appeared
    died_at: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exit_code(self) -> int | None:
        return self.process.exitcode if self.process is not None else None

    def status(self) -> dict:
        return {"index": self.index, "pid": self.pid, "state": self.state, "restarts": self.restarts,
                "socket": self.socket}


@dataclass
class EncodeFleet:
    """``args``: what ``encode_server.serve`` takes after the socket and the key."""

    workers: int
    authkey: bytes
    args: tuple
    directory: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="fovea-encode-"))

    def __post_init__(self) -> None:
        self.procs = [EncodeProcess(i, os.path.join(self.directory, f"encode-{i}.sock")) for i in range(self.workers)]
        if self.procs and len(self.procs[-1].socket) > MAX_SOCKET_PATH:
            raise RuntimeError(f"the encode workers' socket path {self.procs[-1].socket} is too long for a Unix "
                               "socket; set TMPDIR to a shorter directory")
        self.context = multiprocessing.get_context("spawn")

    @property
    def sockets(self) -> list[str]:
        return [p.socket for p in self.procs]

    def start(self) -> None:
        for proc in self.procs:
            self._spawn(proc)

    def _spawn(self, proc: EncodeProcess) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(proc.socket)  # a killed worker's: its successor must not look ready
        proc.process = self.context.Process(target=encode_server.serve, name=f"fovea-encode-{proc.index}",
                                            args=(proc.socket, self.authkey, *self.args), daemon=True)
        proc.process.start()
        proc.state = "starting"

    def check(self) -> None:
        """Mark each worker's state; start again those that died (after their backoff)."""
        for proc in self.procs:
            if proc.state == "stopped" or proc.process is None:
                continue
            if proc.process.is_alive():
                if proc.state == "starting" and os.path.exists(proc.socket):
                    proc.state, proc.failures = "ready", 0
                    log.info("encode worker %d (pid %s) is ready on %s", proc.index, proc.pid, proc.socket)
                continue
            if proc.state != "dead":
                log.warning("encode worker %d (pid %s) exited with code %s", proc.index, proc.pid,
                            proc.process.exitcode)
                proc.failures += proc.state == "starting"
                proc.state, proc.died_at = "dead", time.monotonic()
            if time.monotonic() - proc.died_at >= backoff_s(proc.failures):
                proc.restarts += 1
                self._spawn(proc)

    def failed_to_start(self) -> EncodeProcess | None:
        """A worker that exited before it was ever ready (start-up only: the front gives up)."""
        return next((p for p in self.procs if p.process is not None and not p.process.is_alive()
                     and p.state == "starting"), None)

    def status(self) -> list[dict]:
        return [p.status() for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            proc.state = "stopped"
            if proc.process is not None and proc.process.is_alive():
                proc.process.terminate()  # SIGTERM: it closes its socket
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            if proc.process is not None:
                proc.process.join(max(0.0, deadline - time.monotonic()))
                if proc.process.is_alive():
                    proc.process.kill()
                    proc.process.join(5)
        shutil.rmtree(self.directory, ignore_errors=True)
