"""``--api-server-count N``: N API processes on one port, all feeding one engine core.

The first API process (the one ``fovea serve`` runs) starts the engine core. It then listens,
and starts N - 1 more API processes that take the same listening socket. The kernel hands each
new connection to whichever of them accepts first. Each further process:

- reads the model's structure (no weights);
- connects its own client to the core;
- runs its own canary and its own uvicorn;
- watches the core's pid.

The engine's metrics come from the core, so every process reports the same ones. The HTTP
counters (``fovea_requests_total`` and the latency histograms) are each process's own.

- **A further API process that dies** loses its own connections only. The core and the other API
  processes keep serving, and a new process takes its place.
- **The core dies:** every API process fails what it has in flight and stops.
- **SIGTERM to the first process** stops the others first (each finishes its streams), then the
  core.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from fovea.config import ServerSettings
from fovea.errors import FoveaError

log = logging.getLogger("fovea.serve")

RESTART_BACKOFF_S = 2.0
STOP_TIMEOUT_S = 120.0


@dataclass
class ApiServerSpec:
    settings: ServerSettings
    address: str  # the engine core's
    info: Any  # its CoreInfo
    sock: socket.socket  # the shared listening socket (crosses to the child as a duplicated descriptor)
    index: int
    log_level: str
    log_format: str


def listening_socket(host: str, port: int) -> socket.socket:
    """The socket every API process accepts on (uvicorn's own options: reuse, non-blocking)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_api_server(spec: ApiServerSpec) -> None:
    """A further API process's entry (``multiprocessing`` spawn target)."""
    import uvicorn

    from fovea import logs
    from fovea.disagg.parent_watch import exit_with_parent
    from fovea.gil import set_switch_interval
    from fovea.serve.app import create_app_attached
    from fovea.serve.http_protocol import uvicorn_options

    logs.configure(spec.log_level, spec.log_format, f"api-{spec.index}")
    exit_with_parent()
    set_switch_interval()
    try:
        app = create_app_attached(spec.settings, spec.address, spec.info)
    except FoveaError as exc:
        print(f"fovea: error: API process {spec.index}: {exc.message}", file=sys.stderr)
        sys.exit(2)
    server = uvicorn.Server(uvicorn.Config(app, log_level=spec.log_level.lower(), log_config=None,
                                           **uvicorn_options()))
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[spec.sock])
    sys.exit(getattr(app.state, "exit_code", 0))


class ApiServers:
    """The further API processes of one server: started, replaced when one dies, stopped."""

    def __init__(self, settings: ServerSettings, core: tuple[str, Any], sock: socket.socket, log_level: str,
                 log_format: str) -> None:
        if not hasattr(os, "pidfd_open"):
            raise FoveaError("--api-server-count above 1 needs Linux 5.3 or later (its API processes watch the "
                             "engine core through a pidfd)")
        self.settings, (self.address, self.info), self.sock = settings, core, sock
        self.log_level, self.log_format = log_level, log_format
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def _start_one(self, index: int) -> None:
        spec = ApiServerSpec(self.settings, self.address, self.info, self.sock, index, self.log_level,
                             self.log_format)
        process = multiprocessing.get_context("spawn").Process(target=run_api_server, args=(spec,),
                                                                name=f"fovea-api-{index}")
        process.start()
        self.processes[index] = process

    def start(self) -> ApiServers:
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
