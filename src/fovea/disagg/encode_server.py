"""A shared encode worker: one process that encodes images for several prefill/decode workers.

The front (``fovea serve --pd-workers M``) starts it with ``serve``; every PD worker's encoder
pool connects to its Unix socket (``socket_channel.SocketChannel``, authenticated with a key
the front made). It loads the vision part once (``EncodeService``, as a piped worker does),
then answers each connection's batches one at a time, taking the connections in turn. Each
client owns its own shared-memory segments, so each connection has its own ``Attachments``.
Frames are bytes (``send_bytes``/``recv_bytes``); nothing is pickled.

The socket appears once the vision part is loaded, so its presence means "ready"; the process
removes it when it stops (SIGTERM), and the front removes a killed worker's. On Ray (``main``,
run by the actor that hosts it) it listens on a TCP port of its node's address too, for PD
workers on other nodes: the same key, the tensors inline in the frames.

This module imports no torch at the top: the front that spawns it stays light.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import sys
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fovea.disagg.wire import Attachments

log = logging.getLogger("fovea.disagg")


def serve(path: str, authkey: bytes, model_dir: str | None, device: str, dtype: str, batch_images: int | None,
          fused_vision: bool | None, log_level: str = "info", tcp: tuple[str, int] | None = None) -> None:
    """The process's body (a ``multiprocessing`` spawn target). ``model_dir`` None: the demo
    model; ``batch_images`` None: the engine's vision batch; ``fused_vision`` None: decide as
    the PD workers' engines do (on a GPU, for models of 1 B parameters or more). Those defaults
    are read here, not in the front, which does not import torch."""
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s encode-worker[{os.getpid()}] "
                                                        "%(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the front stops its workers in order, with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    from fovea.disagg.parent_watch import exit_with_parent

    exit_with_parent()
    _attach_untracked()
    import torch

    from fovea.disagg.encode_worker import EncodeService
    from fovea.engine.config import VISION_BATCH
    from fovea.loading.loader import default_model_dir

    torch.set_num_threads(1)
    model_dir = model_dir or str(default_model_dir())
    try:
        service = EncodeService(model_dir, device, dtype, batch_images or VISION_BATCH,
                                _fused(fused_vision, model_dir, device))
    except Exception as exc:  # noqa: BLE001 - the front sees the exit; the log says why
        log.error("the encode worker could not start: %s: %s", type(exc).__name__, exc)
        sys.exit(2)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a killed predecessor's socket
    # TCP first: the Unix socket's appearance says "ready" for both.
    listeners = [Listener(address=tcp, family="AF_INET", authkey=authkey)] if tcp is not None else []
    listeners.append(Listener(address=path, family="AF_UNIX", authkey=authkey))
    try:
        Server(service, listeners).run()
    except SystemExit:
        pass
    finally:
        for listener in listeners:
            listener.close()  # removes the socket file


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(0)


def _fused(switch: bool | None, model_dir: str, device: str) -> bool:
    if switch is not None:
        return switch
    from fovea.engine.config import GPU_MODEL_MIN_PARAMETERS
    from fovea.guard.memory import read_safetensors_header, safetensors_files
    from fovea.loading.loader import resolve_device

    if resolve_device(device).type != "cuda":
        return False
    parameters = 0
    for file in safetensors_files(model_dir):
        for info in read_safetensors_header(file).values():
            count = 1
            for n in info["shape"]:
                count *= int(n)
            parameters += count
    return parameters >= GPU_MODEL_MIN_PARAMETERS


class Server:
    """Connections accepted on a thread (the key's handshake happens there), batches answered
    on this one."""

    def __init__(self, service, listeners: list[Listener]) -> None:
        self.service, self.listeners = service, listeners
        self.pin = service.part.device.type == "cuda"
        self.clients: dict[Connection, Attachments] = {}
        self.arrived: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.wake_reader, self.wake_writer = socket.socketpair()

    def run(self) -> None:
        for listener in self.listeners:
            threading.Thread(target=self._accept, args=(listener,), name="fovea-encode-accept", daemon=True).start()
        log.info("serving on %s", ", ".join(str(listener.address) for listener in self.listeners))
        while True:
            for ready in wait([*self.clients, self.wake_reader]):
                if ready is self.wake_reader:
                    self._take_arrivals()
                else:
                    self._answer(ready)  # type: ignore[arg-type]

    def _accept(self, listener: Listener) -> None:
        while True:
            try:
                conn = listener.accept()
            except AuthenticationError as exc:
                log.warning("refused a connection without the right key: %s", exc)
                continue
            except OSError:
                return  # the listener was closed
            try:
                conn.send_bytes(self.service.ready_frame())
            except OSError:
                conn.close()
                continue
            self.arrived.put(conn)
            self.wake_writer.send(b"x")

    def _take_arrivals(self) -> None:
        self.wake_reader.recv(4096)
        while not self.arrived.empty():
            from fovea.disagg.wire import Attachments

            conn = self.arrived.get()
            self.clients[conn] = Attachments(self.pin)
            log.info("a client connected (%d now)", len(self.clients))

    def _answer(self, conn: Connection) -> None:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            self._drop(conn)
            return
        reply = self.service.handle(request, self.clients[conn])
        try:
            conn.send_bytes(reply)
        except OSError:
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        self.clients.pop(conn).close()
        conn.close()
        log.info("a client went away (%d left)", len(self.clients))


def _attach_untracked() -> None:
    """Leave the clients' segments out of the resource tracker this process shares with the front.

    Python 3.11's ``SharedMemory`` registers a segment it merely attaches (bpo-39959; 3.13 has
    ``track=False``), and a tracker unlinks what is still registered once the processes it
    serves are gone, or warns of leaks. The segments belong to the PD workers, whose own
    trackers clean up after them, and this process owns none: it registers nothing."""
    from multiprocessing import resource_tracker

    register = resource_tracker.register

    def register_owned(name: str, rtype: str) -> None:
        if rtype != "shared_memory":
            register(name, rtype)

    resource_tracker.register = register_owned


def main(argv: list[str] | None = None) -> None:
    """A shared encode worker as its own program (Ray's actor runs it on its node); the key comes
    in the environment, never on the command line."""
    import argparse

    from fovea.front.children import ENCODE_KEY_ENV

    parser = argparse.ArgumentParser(prog="python -m fovea.disagg.encode_server")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--tcp", default=None, help="HOST:PORT to listen on as well")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-images", type=int, default=None)
    parser.add_argument("--fused-vision", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    tcp = None
    if args.tcp:
        host, _, port = args.tcp.rpartition(":")
        tcp = (host, int(port))
    from fovea.config import SWITCH

    fused = SWITCH[args.fused_vision]
    serve(args.socket, bytes.fromhex(os.environ[ENCODE_KEY_ENV]), args.model, args.device, args.dtype,
          args.batch_images, fused, args.log_level, tcp)


if __name__ == "__main__":
    main()
