"""How the front starts its children (``LocalProcess``: on this machine), and how a PD worker
reads what the front handed it.

Secrets travel in the environment, not on command lines that any local user can list: the key
the PD workers' loopback ports require (only the front knows it, so the front's own API key
cannot be bypassed there) and the key the shared encode workers' sockets require.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fovea.disagg.parent_watch import PARENT_FD_ENV, lifeline
from fovea.errors import FoveaError
from fovea.front.ray_hosts import HOST, PORT, Placement

log = logging.getLogger("fovea.front")

INTERNAL_KEY_ENV = "FOVEA_INTERNAL_KEY"
ENCODE_KEY_ENV = "FOVEA_ENCODE_AUTHKEY"
WORKER_HEADER = "x-fovea-pd-worker"  # on every proxied response: which PD worker answered


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pd_worker_command(argv: list[str], index: int, sockets: list[str]) -> list[str]:
    """The front's own command line with the worker's overrides last (argparse keeps the last
    value of a flag): its address and port (``{host}`` and ``{port}``, filled in where it
    starts: loopback for a local front, the node's address on Ray), the shared encode workers'
    sockets (or, on Ray, their table entries)."""
    command = [sys.executable, "-m", "fovea.cli", *argv, "--host", HOST, "--port", PORT,
               "--internal-pd-worker", str(index)]
    for path in sockets:
        command += ["--internal-encode-socket", path]
    return command


def pd_worker_env(internal_key: str, encode_key: bytes) -> dict[str, str]:
    env = dict(os.environ)
    env[INTERNAL_KEY_ENV], env[ENCODE_KEY_ENV] = internal_key, encode_key.hex()
    # The same fovea as the front's (multiprocessing's spawn hands its children sys.path likewise).
    source = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [env.get("PYTHONPATH")])])
    return env


def pd_worker_secrets() -> tuple[str, bytes]:
    """(the key this PD worker's port requires, the encode workers' socket key)."""
    try:
        return os.environ[INTERNAL_KEY_ENV], bytes.fromhex(os.environ[ENCODE_KEY_ENV])
    except (KeyError, ValueError) as exc:
        raise FoveaError("a PD worker is started by the front of `fovea serve --pd-workers`, which hands it "
                           f"{INTERNAL_KEY_ENV} and {ENCODE_KEY_ENV}") from exc


class LocalProcess:
    """A child on this machine, as a fleet sees it (``ray_hosts.RayProcess`` is one on a Ray
    node): launched, placed at once (loopback, a free port), exited, stopped. It dies with the
    front (``parent_watch``), and has a session of its own: a Ctrl-C at the terminal reaches
    the front alone, which then stops its children in order instead of racing them."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.process: subprocess.Popen | None = None
        self.placement: Placement | None = None
        self.lifeline: int | None = None  # the pipe end whose closing kills it: held while it runs

    def launch(self, command: list[str], env: dict[str, str], files: dict[str, str] | None = None) -> None:
        self.release()  # its previous process has exited
        port = free_port()
        fill = lambda text: text.replace(HOST, "127.0.0.1").replace(PORT, str(port))
        child_end, self.lifeline = lifeline()
        try:
            self.process = subprocess.Popen([fill(a) for a in command],
                                            env={**{k: fill(v) for k, v in env.items()}, PARENT_FD_ENV: str(child_end)},
                                            pass_fds=(child_end,), start_new_session=True)
        finally:
            os.close(child_end)
        self.placement = Placement(node="local", host="127.0.0.1", port=port, pid=self.process.pid, dir="")

    def placed(self) -> Placement | None:
        return self.placement

    def exited(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def exit_code(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait(10)

    def terminate(self) -> None:
        if not self.exited():
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]

    def finish(self, deadline: float) -> None:
        """After ``terminate``: wait until ``deadline``, then SIGKILL."""
        if self.process is None:
            return
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time: killing it", self.label)
            self.process.kill()
            self.process.wait(5)
        self.release()

    def release(self) -> None:
        """Close its lifeline, once its process has exited."""
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
