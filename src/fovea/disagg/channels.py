"""How the encoder pool reaches one encode worker: a local process on a pipe, a shared worker on
a Unix socket (``socket_channel``), or a Ray actor.

A channel starts (or reaches) its worker, waits for its ready frame, carries one batch at a time
(``wire`` items in, items out, within a timeout) and ends it. The local ones carry tensors in
shared memory they own (pixels out, embeddings back); the items they return may be views of it,
valid until the next round trip. ``WorkerLost`` means the worker died or hung: the
pool restarts it and sends the batch elsewhere.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.connection import Connection

from fovea.disagg import encode_worker, wire
from fovea.disagg.shared_segment import OwnedSegment

# Linux's pipe buffer is 64 KiB; one batch is in flight per worker, so the pipe is empty when
# a batch is sent and a message this small cannot block.
SMALL_MESSAGE_BYTES = 32 * 1024


class WorkerLost(Exception):
    pass


class FramedChannel:
    """Frames on a ``multiprocessing`` connection, tensors in two segments this side owns (or,
    to a worker on another node, inline in the frames: ``shared`` False)."""

    conn: Connection

    def __init__(self, pin: bool) -> None:
        """``pin``: register the segments with CUDA (this side copies them to or from a GPU)."""
        self.outgoing, self.incoming = OwnedSegment(pin), OwnedSegment(pin)
        self.shared = True
        self.last_timing: dict[str, float] = {}  # the last round trip: writing it, and send to reply

    def _hung(self) -> None:
        """Called when the worker holds a batch past its timeout, before ``WorkerLost`` is raised."""

    def round_trip(self, items: list[wire.Item], reply_bytes: int, timeout: float) -> list[wire.Item]:
        """``items`` (the first one the batch item) to the worker, its reply back. ``reply_bytes``
        sizes the reply segment: what the embeddings the batch expects take."""
        started = time.perf_counter()
        if self.shared:
            incoming = self.incoming.ensure(reply_bytes)
            items = [({**items[0][0], "reply": incoming.name}, None), *items[1:]]
            request = wire.encode(items, self.outgoing.ensure(wire.tensor_bytes(items)))
        else:  # no "reply" segment: the worker answers inline too
            request = wire.encode(items)
        sending = time.perf_counter()
        self._send(request, timeout)
        try:
            if not self.conn.poll(timeout):
                self._hung()
                raise WorkerLost(f"did not answer within {timeout:g} s (--encode-timeout)")
            reply = self.conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise WorkerLost(f"died ({type(exc).__name__})") from exc
        self.last_timing = {"write_s": sending - started, "exchange_s": time.perf_counter() - sending}
        return wire.decode(reply, self._segment if self.shared else None)

    def _segment(self, name: str):
        if self.incoming.segment is None or name != self.incoming.segment.name:
            raise ValueError(f"the worker wrote to segment {name!r}, not the one this batch gave it")
        return self.incoming.segment

    def _send(self, request: bytes, timeout: float) -> None:
        """Write the batch within the timeout: a frame larger than the pipe's buffer blocks
        until the worker reads it, and a hung worker never does. A message of headers only
        (the tensors are in shared memory) fits the empty pipe's buffer and is written here."""
        if len(request) <= SMALL_MESSAGE_BYTES:
            try:
                self.conn.send_bytes(request)
            except (OSError, ValueError) as exc:
                raise WorkerLost(f"died ({type(exc).__name__})") from exc
            return
        done, failed = threading.Event(), []

        def send() -> None:
            try:
                self.conn.send_bytes(request)
            except (OSError, ValueError) as exc:  # ValueError: closed while blocked
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=send, name="fovea-encode-send", daemon=True).start()
        if not done.wait(timeout):
            self._hung()
            raise WorkerLost(f"did not take a batch within {timeout:.1f} s")
        if failed:
            raise WorkerLost(f"died ({type(failed[0]).__name__})")


class PipeChannel(FramedChannel):
    """A spawned process on this machine (no CUDA state or threads inherited), frames on a pipe."""

    def __init__(self, index: int, model_dir: str, device: str, dtype: str, batch_images: int,
                 pin: bool = False, fused_vision: bool = False) -> None:
        super().__init__(pin)
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=encode_worker.worker_main, name=f"fovea-encode-{index}",
                                       args=(child, model_dir, device, dtype, batch_images, fused_vision), daemon=True)
        self.process.start()
        child.close()
        self.pid = self.process.pid

    def ready(self, timeout: float) -> bytes:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"did not start within {timeout:.0f} s")
        return self.conn.recv_bytes()

    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()
        self.outgoing.close()
        self.incoming.close()
