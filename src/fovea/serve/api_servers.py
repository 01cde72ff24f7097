"""``--api-server-count N``: N API processes on one port, all feeding one engine core.

The first API process (the one ``fovea serve`` runs) binds the port, starts the engine core and,
as soon as the core's process runs, N - 1 more API processes: they import and read the model
beside the core's load, then wait for the core to be ready, so all N are ready at about the same
time. Each binds a socket of its own to the port with ``SO_REUSEPORT``, and the
kernel spreads new connections over the listening ones by a hash of their addresses. (One
listening socket shared by all of them, which this module used before, let whichever process
woke first take nearly every connection: 240 of 240 in a test.) A process listens only once its
start-up is done, so no connection waits on a process that is still starting. Each further
process:

- reads the model's structure (no weights);
- connects its own client to the core;
- runs its own canary and its own uvicorn;
- watches the core's pid.

The engine's metrics come from the core, so every process reports the same ones. What each
process observes itself (``fovea_requests_total``, the latency histograms, the canary) is kept
in files in a directory of the first process's (``serve.metrics.share_between_processes``), so
whichever process answers a scrape shows the sums over all of them.

``/health`` says ``starting`` (503) until every API process has finished its start-up and
serves, so a client that waits for it sends its load to all of them; later, while one is being
replaced, it says ``degraded``.

- **A further API process that dies** loses its own connections only (those it had accepted, and
  those the kernel had queued for it). The core and the other API processes keep serving, and a
  new process takes its place.
- **The core dies:** every API process fails what it has in flight and stops.
- **SIGTERM to the first process** stops the others first (each finishes its streams), then the
  core.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fovea.config import ServerSettings
from fovea.errors import FoveaError
from fovea.serve.metrics import process_gone

log = logging.getLogger("fovea.serve")

RESTART_BACKOFF_S = 2.0
STOP_TIMEOUT_S = 120.0
METRICS_PREFIX = "fovea-metrics-"


def shared_metrics_dir() -> Path:
    """A new directory for this server's API processes' shared metric values (named by this
    process's pid), after removing those of servers that died without removing theirs."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{METRICS_PREFIX}*"):
        owner = old.name.removeprefix(METRICS_PREFIX).split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(old, ignore_errors=True)
    try:
        return Path(tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-", dir=root))
    except OSError as exc:
        raise FoveaError(f"--api-server-count needs a directory for its shared metrics in {root}, and making "
                         f"one failed: {exc.strerror}; set TMPDIR to a writable directory") from None


@dataclass
class ApiServerSpec:
    settings: ServerSettings
    address: str  # the engine core's (its info comes from the core once it is ready)
    index: int
    log_level: str
    log_format: str


def port_socket(host: str, port: int, first: bool = False) -> socket.socket:
    """This API process's socket on the server's port: bound with ``SO_REUSEPORT`` beside the other
    API processes' and not yet listening (uvicorn listens once the app's start-up is done).
    ``first``: the first process refuses a port that anything holds already, another fovea server
    with ``--api-server-count`` included, which would otherwise share it silently."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if first:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise FoveaError(f"cannot serve on {host}:{port}: {exc.strerror}") from None
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP, and
    # without it each stream's small SSE writes waited on the client's delayed ACK (+40 ms TTFT).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_api_server(spec: ApiServerSpec) -> None:
    """A further API process's entry (``multiprocessing`` spawn target)."""
    import uvicorn

    from fovea import logs
    from fovea.disagg.parent_watch import exit_with_parent
    from fovea.engine.process.client import wait_for_core
    from fovea.gil import set_switch_interval
    from fovea.serve.app import create_app_attached
    from fovea.serve.http_protocol import uvicorn_options

    logs.configure(spec.log_level, spec.log_format, f"api-{spec.index}")
    exit_with_parent()
    set_switch_interval()
    try:
        info = wait_for_core(spec.address)  # started beside the core's load: waits for it to be ready
        app = create_app_attached(spec.settings, spec.address, info)
    except FoveaError as exc:
        print(f"fovea: error: API process {spec.index}: {exc.message}", file=sys.stderr)
        sys.exit(2)
    server = uvicorn.Server(uvicorn.Config(app, log_level=spec.log_level.lower(), log_config=None,
                                           **uvicorn_options()))
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[port_socket(spec.settings.host, spec.settings.port)])
    sys.exit(getattr(app.state, "exit_code", 0))


class ApiServers:
    """The further API processes of one server: started, replaced when one dies, stopped."""

    def __init__(self, settings: ServerSettings, log_level: str, log_format: str,
                 metrics_dir: Path | None = None) -> None:
        """``metrics_dir``: the shared metric values' directory, removed once they have all stopped."""
        if not hasattr(os, "pidfd_open"):
            raise FoveaError("--api-server-count above 1 needs Linux 5.3 or later (its API processes watch the "
                             "engine core through a pidfd)")
        self.settings, self.address = settings, ""
        self.log_level, self.log_format, self.metrics_dir = log_level, log_format, metrics_dir
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def _start_one(self, index: int) -> None:
        spec = ApiServerSpec(self.settings, self.address, index, self.log_level, self.log_format)
        process = multiprocessing.get_context("spawn").Process(target=run_api_server, args=(spec,),
                                                                name=f"fovea-api-{index}")
        process.start()
        self.processes[index] = process

    def start(self, core_address: str) -> ApiServers:
        """Start them, fed by the core at ``core_address``, which may still be starting (each waits)."""
        self.address = core_address
        for index in range(1, self.settings.api_server_count):
            self._start_one(index)
        self._watcher = threading.Thread(target=self._watch, name="fovea-api-servers", daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        """Replace an API process that died; the core and the other processes go on serving."""
        while not self._stopping.wait(0.5):
            for index, process in list(self.processes.items()):
                if process.is_alive() or self._stopping.is_set():
                    continue
                code = process.exitcode
                if code == 1:  # it stopped because the engine core died: this process stops too
                    continue
                process_gone(process.pid)  # its canary's gauges leave the sums; its counts stay
                log.error("API process %d (pid %s) exited with status %s; its open connections are lost, the "
                          "others keep serving; starting another", index, process.pid, code)
                time.sleep(RESTART_BACKOFF_S)
                if not self._stopping.is_set():
                    self._start_one(index)

    def stop(self) -> None:
        """SIGTERM each (it finishes its streams), wait, then kill what is left."""
        self._stopping.set()
        for process in self.processes.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("API process %s did not stop within %.0f s: killing it", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.join(timeout=10)
        if self.metrics_dir is not None:  # this process only writes to the files it has open from now on
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
