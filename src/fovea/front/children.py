"""How the front starts its children, and how a PD worker reads what the front handed it.

Secrets travel in the environment, not on command lines that any local user can list: the key
the PD workers' loopback ports require (only the front knows it, so the front's own API key
cannot be bypassed there) and the key the shared encode workers' sockets require.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from fovea.errors import FoveaError

INTERNAL_KEY_ENV = "FOVEA_INTERNAL_KEY"
ENCODE_KEY_ENV = "FOVEA_ENCODE_AUTHKEY"
WORKER_HEADER = "x-fovea-pd-worker"  # on every proxied response: which PD worker answered


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pd_worker_command(argv: list[str], index: int, port: int, sockets: list[str]) -> list[str]:
    """The front's own command line with the worker's overrides last (argparse keeps the last
    value of a flag): loopback, its port, the shared encode workers' sockets."""
    command = [sys.executable, "-m", "fovea.cli", *argv, "--host", "127.0.0.1", "--port", str(port),
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
