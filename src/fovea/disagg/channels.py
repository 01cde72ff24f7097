"""How the encoder pool reaches one encode worker: a local process on a pipe, or a Ray actor.

A channel starts its worker, waits for its ready frame, carries one batch at a time (bytes in,
bytes out, within a timeout) and ends it. ``WorkerLost`` means the worker died or hung: the
pool restarts it and sends the batch elsewhere.
"""

from __future__ import annotations

import multiprocessing
import threading

from fovea.disagg import encode_worker


class WorkerLost(Exception):
    pass


class PipeChannel:
    """A spawned process on this machine (no CUDA state or threads inherited), frames on a pipe."""

    def __init__(self, index: int, model_dir: str, device: str, dtype: str, batch_images: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=encode_worker.worker_main, name=f"fovea-encode-{index}",
                                       args=(child, model_dir, device, dtype, batch_images), daemon=True)
        self.process.start()
        child.close()
        self.pid = self.process.pid

    def ready(self, timeout: float) -> bytes:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"did not start within {timeout:.0f} s")
        return self.conn.recv_bytes()

    def alive(self) -> bool:
        return self.process.is_alive()

    def round_trip(self, request: bytes, timeout: float) -> bytes:
        self._send(request, timeout)
        try:
            if not self.conn.poll(timeout):
                raise WorkerLost(f"did not answer within {timeout:.1f} s")
            return self.conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise WorkerLost(f"died ({type(exc).__name__})") from exc

    def _send(self, request: bytes, timeout: float) -> None:
        """Write the batch within the timeout: a frame larger than the pipe's buffer blocks
        until the worker reads it, and a hung worker never does."""
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
            raise WorkerLost(f"did not take a batch within {timeout:.1f} s")
        if failed:
            raise WorkerLost(f"died ({type(failed[0]).__name__})")

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()
