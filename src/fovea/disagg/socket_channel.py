"""How a prefill/decode worker's encoder pool reaches a shared encode worker: its Unix socket,
or its TCP port when it runs on another node (``encoder_directory``).

The worker (``encode_server``) is already running, started by the front (``fovea serve
--pd-workers M``) and serving several pools at once; this channel connects to it instead of
spawning one. On a Unix socket, like ``PipeChannel``, it owns the shared-memory segments its
batches use; over TCP the tensors travel inline in the frames. Frames are bytes only
(``send_bytes``/``recv_bytes``). The pool does not own the process: "restarting" a channel
means connecting again (the front restarts a worker that died, and tells this side where it
now is), and a same-node worker that holds a batch past the timeout is killed by its pid (the
ready frame carries it) so that the front replaces it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

from fovea.disagg.channels import FramedChannel, WorkerLost
from fovea.disagg.encoder_directory import Endpoint
from fovea.disagg.handoff import HandoffMismatch, unpack

log = logging.getLogger("fovea.disagg")

RECONNECT_S = 0.2  # between attempts while the worker is (re)starting


class SocketChannel(FramedChannel):
    def __init__(self, index: int, address: str | Callable[[], Endpoint], authkey: bytes, pin: bool = False) -> None:
        """``address``: a Unix socket's path, or what gives the worker's current endpoint (read
        again on every connection attempt: a worker Ray moved has a new one)."""
        super().__init__(pin)
        self.resolve = (lambda: Endpoint("AF_UNIX", address)) if isinstance(address, str) else address
        self.index, self.authkey = index, authkey
        self.endpoint: Endpoint | None = None
        self.conn: Connection | None = None  # type: ignore[assignment]
        self.pid: int | None = None  # from the ready frame
        self._busy = threading.Lock()  # held for a round trip: alive() must not read its reply as EOF

    def ready(self, timeout: float) -> bytes:
        """Connect (retrying while the socket is missing or refuses: the worker is still loading
        or being restarted), then read the worker's ready frame, all within ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            self.conn = self._connect(deadline)
        except AuthenticationError as exc:
            raise WorkerLost(f"refused this side's key on {self.address} ({exc})") from exc
        self.shared = self.endpoint is not None and self.endpoint.shared
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"sent no ready frame within {timeout:.0f} s")
        frame = self.conn.recv_bytes()
        with contextlib.suppress(HandoffMismatch, TypeError, ValueError):  # the pool reports a malformed frame
            pid = unpack(frame)[0].get("pid")
            # Another node's pid is not this machine's to signal (``_hung``).
            self.pid = int(pid) if pid is not None and self.shared else None
        return frame

    @property
    def address(self) -> str | tuple[str, int] | None:
        return self.endpoint.address if self.endpoint is not None else None

    def _connect(self, deadline: float) -> Connection:
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                self.endpoint = self.resolve()
                return _client_within(self.endpoint, self.authkey, deadline - time.monotonic())
            except (OSError, EOFError, ValueError) as exc:
                # Not listening yet (or a dead one's socket), it died during the handshake, or the
                # front has not yet said where a moved worker is.
                last = exc
            time.sleep(RECONNECT_S)
        raise TimeoutError(f"did not accept a connection on {self.address} in time"
                           + (f" ({type(last).__name__}: {last})" if last else ""))

    def alive(self) -> bool:
        if self.conn is None:
            return False
        if not self._busy.acquire(blocking=False):
            return True  # a batch is in flight: its round trip finds out
        try:
            # Between batches nothing is due: anything readable is the end of the stream (or a
            # stray late reply, which makes the connection unusable all the same).
            return not self.conn.poll(0)
        except (OSError, ValueError):
            return False
        finally:
            self._busy.release()

    def round_trip(self, items, reply_bytes, timeout):  # type: ignore[override]
        with self._busy:
            if self.conn is None:
                raise WorkerLost("is not connected")
            return super().round_trip(items, reply_bytes, timeout)

    def _hung(self) -> None:
        if self.pid is None:
            return
        log.warning("encode worker %d (pid %d, %s) held a batch past its timeout: killing it", self.index,
                    self.pid, self.address)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.outgoing.close()
        self.incoming.close()


def _client_within(endpoint: Endpoint, authkey: bytes, timeout: float) -> Connection:
    """``Client`` with a deadline: its authentication handshake blocks on a worker that has
    accepted but hangs (stopped, say). On time-out the attempt is left to finish on its own
    thread, and a connection it makes after all is closed."""
    outcome: dict = {}
    lock = threading.Lock()

    def attempt() -> None:
        try:
            conn = Client(endpoint.address, family=endpoint.family, authkey=authkey)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc
            return
        with lock:
            if outcome.get("abandoned"):
                conn.close()
            else:
                outcome["conn"] = conn

    thread = threading.Thread(target=attempt, name="fovea-encode-connect", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout))
    with lock:
        if "conn" in outcome:
            return outcome["conn"]
        if "error" in outcome:
            raise outcome["error"]
        outcome["abandoned"] = True
    raise TimeoutError(f"the handshake on {endpoint.address} did not finish within {timeout:.0f} s")
