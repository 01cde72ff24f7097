"""Encode workers on this machine, supervised, behind the engine's image encoder.

``EncoderPool`` starts ``workers`` encode-worker processes (``encode_worker.worker_main``),
sends each vision batch to the least-loaded live one, verifies every embedding that comes
back against what the batch needs (``handoff.open_rows``: batch id, content hash, model,
vision weights, recipe, dtype, shape, tokens, grid, checksum), and supervises them:

- a worker that dies is restarted, and the batch it held is sent to another worker once;
- a worker that does not answer within ``timeout_s`` is killed and restarted, and its batch
  is retried once the same way;
- when no worker can take a batch, the batch's requests fail with 503 ``encoder_unavailable``
  (never a silent re-encode in the prefill/decode process, never a text-only answer).

With ``encoder_addresses`` the workers are shared ones that already run (``encode_server``,
started by the front of ``--pd-workers``) and the pool connects to their sockets
(``SocketChannel``; over TCP to one on another Ray node, ``encoder_directory``): it does not
own those processes, so restarting one means connecting again, and a hung one on this node is
killed by its pid for the front to replace.

``status()`` is what ``/health`` lists: each worker's pid, state, restarts and batches.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fovea.disagg import encode_worker
from fovea.disagg.channels import PipeChannel, WorkerLost
from fovea.disagg.handoff import (
    DTYPES,
    Expectation,
    HandoffMismatch,
    check_header,
    header_from,
    land_each,
    unpack,
)
from fovea.disagg.shared_segment import aligned
from fovea.errors import FoveaError
from fovea.models.base import ImageInput

if TYPE_CHECKING:
    from fovea.disagg.ray_workers import RayChannel
    from fovea.disagg.socket_channel import SocketChannel

log = logging.getLogger("fovea.disagg")


SUPERVISE_S = 0.5  # how often the pool looks for workers that died between batches
RETRY_FAILED_S = 5.0  # how long a worker whose restart failed waits before the next try


class EncoderUnavailable(FoveaError):
    status, code, type = 503, "encoder_unavailable", "server_error"


class EncoderFailed(FoveaError):
    """The encode worker took the batch and could not encode it (its error is in the message)."""

    status, code, type = 500, "encoder_failed", "server_error"


@dataclass
class WorkerHandle:
    index: int
    channel: PipeChannel | SocketChannel | RayChannel | None = None
    state: str = "starting"  # starting | ready | busy | dead | failed
    pid: int | None = None
    restarts: int = 0
    batches: int = 0
    vision_fingerprint: str = ""
    plan: dict | None = None  # its memory plan (encoder_plan.EncoderPlan), as it reported it
    peak_reserved_bytes: int | None = None  # torch's peak reserved bytes there, after its last batch (CUDA)
    lock: threading.Lock = field(default_factory=threading.Lock)
    restarting: bool = False
    restart_thread: threading.Thread | None = None
    failed_at: float = 0.0

    def status(self) -> dict:
        return {"index": self.index, "pid": self.pid, "state": self.state, "restarts": self.restarts,
                "batches": self.batches, "plan": self.plan, "peak_reserved_bytes": self.peak_reserved_bytes}


class EncoderPool:
    def __init__(self, model_dir: str | Path, *, workers: int, device: str, dtype: str, model_id: str,
                 recipe_fingerprint: str, hidden: int, timeout_s: float = 60.0, start_timeout_s: float = 300.0,
                 batch_images: int = 8, ray_address: str | None = None, pd_device: str = "cpu",
                 fused_vision: bool = False,
                 on_handoff: Callable[[float, int], None] | None = None,
                 encoder_addresses: list[str] | None = None, authkey: bytes | None = None) -> None:
        """``pd_device``: where the verified rows land (the prefill/decode model's device).
        ``on_handoff(seconds per image, images)``: each batch's hand-off cost. ``fused_vision``:
        the workers run fovea's fused vision stage where it passes its start-up check.
        ``encoder_addresses``: the Unix sockets of shared workers to connect to (one worker
        each, ``workers`` is then their count), with the ``authkey`` they expect."""
        if encoder_addresses:
            if ray_address is not None:
                raise ValueError("an encoder pool reaches its workers on sockets or through Ray, not both")
            workers = len(encoder_addresses)
        if workers < 1:
            raise ValueError("an encoder pool needs at least one worker")
        self.model_dir = str(model_dir)
        self.model_id, self.recipe_fingerprint, self.hidden = model_id, recipe_fingerprint, hidden
        # The rows come back in the model's dtype, whatever the pixels' (Qwen's resized images are uint8).
        self.rows_dtype = dtype
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._last_lost: str | None = None  # why a worker was last lost in a batch (the refusal says it)
        self.batch_images = batch_images  # the engine's vision batch: what each worker plans its peak for
        if encoder_addresses:
            from fovea.disagg.encoder_directory import EncoderDirectory
            from fovea.disagg.socket_channel import SocketChannel

            pin = torch.device(pd_device).type == "cuda"
            # Where each worker is now (on Ray it can move), and whether it shares this node.
            directory, key = EncoderDirectory.from_environment(list(encoder_addresses)), authkey or b""
            self.open_channel = lambda index: SocketChannel(index, partial(directory.endpoint, index), key, pin)
        elif ray_address is None:
            pin = torch.device(pd_device).type == "cuda"
            self.open_channel = lambda index: PipeChannel(index, self.model_dir, device, dtype, batch_images, pin,
                                                          fused_vision)
        else:
            from fovea.disagg.ray_workers import RayChannel, connect

            connect(ray_address)
            self.open_channel = lambda index: RayChannel(index, self.model_dir, device, dtype, batch_images,
                                                         fused_vision)
        self.workers = [WorkerHandle(i) for i in range(workers)]
        self.vision_fingerprint = ""
        self._pick = threading.Lock()
        self._channels = threading.Lock()  # a worker's channel is taken (to close it) by one thread
        self.device = torch.device(pd_device)
        self.on_handoff = on_handoff
        self.handoff_totals: dict[str, float] = {"batches": 0, "images": 0, "seconds": 0.0}
        self.handoff_pinned: dict = {}  # whether each side's shared segments are pinned for CUDA
        # Encodes submitted ahead of the engine's step (at admission), sent by one client
        # thread per worker.
        self._pending: deque[tuple[list[ImageInput], Future]] = deque()
        self._pending_ready = threading.Condition()
        self._stopping = False
        self._stopped = threading.Event()
        self._clients = [threading.Thread(target=self._dispatch, name=f"fovea-encode-client-{i}", daemon=True)
                         for i in range(workers)]

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> EncoderPool:
        for worker in self.workers:
            self._spawn(worker)
        for worker in self.workers:
            self._await_ready(worker)
        prints = {w.vision_fingerprint for w in self.workers}
        if len(prints) != 1:
            raise FoveaError(f"the encode workers loaded different vision weights (fingerprints {sorted(prints)})")
        self.vision_fingerprint = prints.pop()
        log.info("%d encode worker(s) ready (vision fingerprint %s)", len(self.workers), self.vision_fingerprint)
        for client in self._clients:
            client.start()
        threading.Thread(target=self._supervise, name="fovea-encode-supervisor", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        with self._pending_ready:
            self._stopping = True
            for _, future in self._pending:
                future.cancel()
            self._pending.clear()
            self._pending_ready.notify_all()
        with self._pick:  # a restart begun before this saw _stopping has its thread recorded by now
            pass
        for worker in self.workers:
            self._end(worker, "stopped")
        # A restart under way ends what it started once it sees the pool stopping (``_restart``):
        # wait for it, so that no process or shared memory outlives the pool.
        for worker in self.workers:
            thread = worker.restart_thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=30)

    def _spawn(self, worker: WorkerHandle) -> None:
        worker.channel = self.open_channel(worker.index)
        worker.pid, worker.state = worker.channel.pid, "starting"

    def _await_ready(self, worker: WorkerHandle) -> None:
        assert worker.channel is not None
        try:
            meta, _ = unpack(worker.channel.ready(self.start_timeout_s))
        except (TimeoutError, WorkerLost, EOFError, OSError) as exc:
            self._end(worker, "failed")
            raise FoveaError(f"encode worker {worker.index} could not start: {exc}") from exc
        if meta.get("kind") != encode_worker.READY:
            self._end(worker, "failed")
            raise FoveaError(f"encode worker {worker.index} could not start: {meta.get('message')}")
        worker.vision_fingerprint, worker.state, worker.plan = meta["vision_fingerprint"], "ready", meta["plan"]
        worker.pid = worker.channel.pid  # a shared worker's is known from its ready frame
        log.info("encode worker %d (pid %s) loaded %.1f M vision parameters in %.1f s, vision stage %s; %s",
                 worker.index, worker.pid, meta["parameters"] / 1e6, meta["load_seconds"], meta.get("vision"),
                 meta["plan_text"])

    def _end(self, worker: WorkerHandle, state: str) -> None:
        # Taken under the lock: stop() and a restart thread may end the same worker at once, and
        # a pipe closed twice raises (EBADF) in whichever comes second.
        with self._channels:
            channel, worker.channel, worker.state = worker.channel, None, state
        if channel is not None:
            channel.close()

    def _begin_restart(self, worker: WorkerHandle, why: str) -> None:
        """Restart ``worker`` in the background, once however many notice it is gone."""
        with self._pick:
            if worker.restarting or self._stopping:
                return
            worker.restarting, worker.state = True, "dead"
            thread = worker.restart_thread = threading.Thread(
                target=self._restart, args=(worker, why), name=f"fovea-encode-restart-{worker.index}", daemon=True)
        thread.start()

    def _restart(self, worker: WorkerHandle, why: str) -> None:
        log.warning("encode worker %d (pid %s) %s: restarting it", worker.index, worker.pid, why)
        try:
            self._end(worker, "dead")
            if self._stopping:  # stopped meanwhile: no new process to leave behind
                return
            worker.restarts += 1
            self._spawn(worker)
            if self._stopping:
                self._end(worker, "stopped")
                return
            self._await_ready(worker)
        except FoveaError as exc:
            if not self._stopping:  # the pool stopping under a restart ends it; that is no failure
                log.error("encode worker %d could not be restarted (tried again in %.0f s): %s", worker.index,
                          RETRY_FAILED_S, exc)
            worker.failed_at = time.monotonic()
        finally:
            worker.restarting = False

    def _supervise(self) -> None:
        """Restart workers that died between batches (no batch would find out), and retry those
        whose restart failed (a GPU that was full may have room now)."""
        while not self._stopped.wait(SUPERVISE_S):
            for worker in self.workers:
                if worker.restarting:
                    continue
                # "dead" too: status() marks a worker it finds gone, for /health, before this does.
                if worker.state in ("ready", "dead") and (worker.channel is None or not worker.channel.alive()):
                    self._begin_restart(worker, "died between batches")
                elif worker.state == "failed" and time.monotonic() - worker.failed_at > RETRY_FAILED_S:
                    self._begin_restart(worker, "failed to start earlier")

    def status(self) -> list[dict]:
        for worker in self.workers:
            if worker.state in ("ready", "busy") and worker.channel is not None and not worker.channel.alive():
                worker.state = "dead"
        return [w.status() for w in self.workers]

    # ---- encoding -----------------------------------------------------------------------
    def _choose(self, exclude: set[int]) -> WorkerHandle | None:
        with self._pick:
            for worker in sorted(self.workers, key=lambda w: (w.state != "ready", w.batches)):
                if worker.index not in exclude and worker.state == "ready" and worker.lock.acquire(blocking=False):
                    worker.state = "busy"
                    return worker
        return None

    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's verified rows on the pool's device, from a worker; retried once elsewhere.
        Raises the first image's refusal (see ``encode_each`` for one outcome per image)."""
        out = self.encode_each(images)
        for result in out:
            if isinstance(result, BaseException):
                raise result
        return out

    def encode_each(self, images: list[ImageInput]) -> list[torch.Tensor | BaseException]:
        """One outcome per image: its verified rows, or why it was refused (a mismatch fails
        that image only). A batch no worker could encode raises ``EncoderUnavailable``."""
        batch_id = uuid.uuid4().hex
        items = [({"kind": encode_worker.BATCH}, None),
                 *(encode_worker.image_item(batch_id, image, self.recipe_fingerprint) for image in images)]
        itemsize = DTYPES[self.rows_dtype].itemsize
        reply_bytes = sum(aligned(image.num_tokens * self.hidden * itemsize) for image in images)
        tried: set[int] = set()
        deadline = time.monotonic() + 2 * self.timeout_s
        last = "no encode worker is ready" + (f" (the last loss: {self._last_lost})" if self._last_lost else "")
        while len(tried) < 2 and time.monotonic() < deadline:
            worker = self._choose(tried)
            if worker is None:
                # Every worker is busy, restarting or tried: wait a little for one.
                if all(w.state in ("dead", "failed") or w.index in tried for w in self.workers):
                    break
                time.sleep(0.002)
                continue
            tried.add(worker.index)
            started = time.perf_counter()
            try:
                if worker.channel is None:
                    raise WorkerLost("is not running")
                reply = worker.channel.round_trip(items, reply_bytes, self.timeout_s)
                # The reply may be views of the worker's reply segment: verified and copied out
                # before the worker can take another batch.
                landing, landed = time.perf_counter(), {}
                out = self._verify(reply, batch_id, images, landed)
                timing = {**getattr(worker.channel, "last_timing", {}), "land_s": time.perf_counter() - landing,
                          "land_wait_s": landed.get("wait_s", 0.0)}
            except WorkerLost as lost:
                last = self._last_lost = f"worker {worker.index} {lost}"
                worker.state = "dead"  # not chosen again until the restart has it ready
                worker.lock.release()
                self._begin_restart(worker, str(lost))
                continue
            except BaseException:
                worker.state = "ready"
                worker.lock.release()
                raise
            worker.state, worker.batches = "ready", worker.batches + 1
            worker.peak_reserved_bytes = reply[0][0].get("peak_reserved_bytes")
            worker.lock.release()
            self._observe(worker, reply[0][0], timing, time.perf_counter() - started, len(images))
            return out
        raise EncoderUnavailable(f"no encode worker could encode {len(images)} image(s): {last}; retry shortly")

    def _observe(self, worker: WorkerHandle, batch: dict, timing: dict, seconds: float, images: int) -> None:
        """The hand-off's cost: the round trip less the worker's vision forward, per image
        (pixels out, embeddings sealed, back, landed on the device and verified), and where it
        goes: each side's writing, the worker's reading and sealing, this side's landing and
        verifying, and the pipe (the exchange less the worker's handling: waking either side)."""
        if not images or "encode_s" not in batch:
            return
        handoff = max(0.0, seconds - float(batch["encode_s"]))
        parts = {"worker_read": batch.get("read_s", 0.0), "worker_seal": batch.get("seal_s", 0.0),
                 "worker_write": batch.get("write_s", 0.0), "this_write": timing.get("write_s", 0.0),
                 "this_land": timing.get("land_s", 0.0),
                 "this_land_device_wait": timing.get("land_wait_s", 0.0),  # (part of this_land)
                 "pipe": max(0.0, timing.get("exchange_s", 0.0) - batch.get("handle_s", 0.0))
                 if "exchange_s" in timing and "handle_s" in batch else 0.0}
        segment = getattr(getattr(worker.channel, "incoming", None), "segment", None)  # Ray: none
        self.handoff_pinned = {"worker": batch.get("pinned"), "this_side": segment.pinned if segment else None}
        with self._pick:
            totals = self.handoff_totals
            totals["batches"] += 1
            totals["images"] += images
            totals["seconds"] += handoff
            for name, value in parts.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        if self.on_handoff is not None:
            self.on_handoff(handoff / images, images)

    def handoff_summary(self) -> dict:
        """Mean hand-off per image since start, and its parts (``/health``'s "handoff")."""
        totals = dict(self.handoff_totals)
        n = max(1, int(totals.pop("images")))
        batches = int(totals.pop("batches"))
        return {"batches": batches, "images": n if batches else 0,
                "mean_ms_per_image": 1e3 * totals.pop("seconds") / n,
                "parts_ms_per_image": {name: 1e3 * value / n for name, value in totals.items()},
                "pinned": self.handoff_pinned}


    def _verify(self, reply: list, batch_id: str, images: list[ImageInput],
                timing: dict[str, float] | None = None) -> list[torch.Tensor | BaseException]:
        head = reply[0][0] if reply else {}
        if head.get("kind") == encode_worker.ERROR:
            raise EncoderFailed(f"the encode worker failed: {head.get('message')}")
        if head.get("kind") != encode_worker.BATCH or len(reply) - 1 != len(images):
            raise HandoffMismatch("frame", f"{len(reply) - 1} embeddings for {len(images)} images")
        out: list[torch.Tensor | BaseException | None] = [None] * len(images)
        sound = []
        for index, ((fields, data), image) in enumerate(zip(reply[1:], images, strict=True)):
            want = Expectation(
                request_id=batch_id, image_hash=image.hash, model_id=self.model_id,
                vision_fingerprint=self.vision_fingerprint, recipe_fingerprint=self.recipe_fingerprint,
                dtype=self.rows_dtype, hidden=self.hidden, tokens=image.num_tokens,
                grid=image.grid)
            try:
                header = header_from(fields)
                check_header(header, want)
                sound.append((index, header, b"" if data is None else data))
            except HandoffMismatch as exc:
                out[index] = exc
        landed = land_each([(h, d) for _, h, d in sound], self.device, timing=timing)
        for (index, _, _), rows in zip(sound, landed, strict=True):
            out[index] = rows
        return out  # type: ignore[return-value]

    # ---- ahead of the step: batched submissions -----------------------------------------
    def submit(self, images: list[ImageInput]) -> Future:
        """Encode ``images`` on a client thread while the engine goes on stepping. Submissions
        that wait while every worker is busy are sent together, up to ``batch_images`` images
        (the batch the workers planned their peak for), so one request's image per call does
        not mean one image per vision forward under load."""
        future: Future = Future()
        with self._pending_ready:
            self._pending.append((images, future))
            self._pending_ready.notify()
        return future

    def _dispatch(self) -> None:
        while True:
            with self._pending_ready:
                while not self._pending and not self._stopping:
                    self._pending_ready.wait()
                if self._stopping:
                    return
                taken, count = [], 0
                while self._pending and (not taken or count + len(self._pending[0][0]) <= self.batch_images):
                    images, future = self._pending.popleft()
                    if future.set_running_or_notify_cancel():
                        taken.append((images, future))
                        count += len(images)
            if not taken:
                continue
            try:
                results = self.encode_each([image for images, _ in taken for image in images])
            except BaseException as exc:  # noqa: BLE001 - each waiting request is told why
                for _, future in taken:
                    future.set_exception(exc)
                continue
            start = 0
            for images, future in taken:
                mine = results[start:start + len(images)]
                start += len(images)
                refused = next((r for r in mine if isinstance(r, BaseException)), None)
                if refused is not None:
                    future.set_exception(refused)
                else:
                    future.set_result(mine)
