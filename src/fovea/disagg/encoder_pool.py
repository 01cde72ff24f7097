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

``status()`` is what ``/health`` lists: each worker's pid, state, restarts and batches.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fovea.disagg import encode_worker
from fovea.disagg.channels import PipeChannel, WorkerLost
from fovea.disagg.handoff import Expectation, HandoffMismatch, from_frame, open_rows, unpack
from fovea.errors import FoveaError
from fovea.models.base import ImageInput

if TYPE_CHECKING:
    from fovea.disagg.ray_workers import RayChannel

log = logging.getLogger("fovea.disagg")


class EncoderUnavailable(FoveaError):
    status, code, type = 503, "encoder_unavailable", "server_error"


@dataclass
class WorkerHandle:
    index: int
    channel: PipeChannel | RayChannel | None = None
    state: str = "starting"  # starting | ready | busy | dead | failed
    pid: int | None = None
    restarts: int = 0
    batches: int = 0
    vision_fingerprint: str = ""
    plan: dict | None = None  # its memory plan (encoder_plan.EncoderPlan), as it reported it
    lock: threading.Lock = field(default_factory=threading.Lock)

    def status(self) -> dict:
        return {"index": self.index, "pid": self.pid, "state": self.state, "restarts": self.restarts,
                "batches": self.batches, "plan": self.plan}


class EncoderPool:
    def __init__(self, model_dir: str | Path, *, workers: int, device: str, dtype: str, model_id: str,
                 recipe_fingerprint: str, hidden: int, timeout_s: float = 60.0, start_timeout_s: float = 300.0,
                 batch_images: int = 8, ray_address: str | None = None) -> None:
        if workers < 1:
            raise ValueError("an encoder pool needs at least one worker")
        self.model_dir = str(model_dir)
        self.model_id, self.recipe_fingerprint, self.hidden = model_id, recipe_fingerprint, hidden
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.batch_images = batch_images  # the engine's vision batch: what each worker plans its peak for
        if ray_address is None:
            self.open_channel = lambda index: PipeChannel(index, self.model_dir, device, dtype, batch_images)
        else:
            from fovea.disagg.ray_workers import RayChannel, connect

            connect(ray_address)
            self.open_channel = lambda index: RayChannel(index, self.model_dir, device, dtype, batch_images)
        self.workers = [WorkerHandle(i) for i in range(workers)]
        self.vision_fingerprint = ""
        self._pick = threading.Lock()
        # Encodes submitted ahead of the engine's step (at admission), one thread per worker.
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fovea-encode-client")

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
        return self

    def stop(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        for worker in self.workers:
            self._end(worker, "stopped")

    def submit(self, images: list[ImageInput]) -> Future:
        """``encode(images)`` on a client thread: the engine goes on stepping meanwhile."""
        return self.executor.submit(self.encode, images)

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
        log.info("encode worker %d (pid %s) loaded %.1f M vision parameters in %.1f s; %s", worker.index,
                 worker.pid, meta["parameters"] / 1e6, meta["load_seconds"], meta["plan_text"])

    def _end(self, worker: WorkerHandle, state: str) -> None:
        if worker.channel is not None:
            worker.channel.close()
        worker.channel, worker.state = None, state

    def _restart(self, worker: WorkerHandle, why: str) -> None:
        log.warning("encode worker %d (pid %s) %s: restarting it", worker.index, worker.pid, why)
        self._end(worker, "dead")
        worker.restarts += 1
        try:
            self._spawn(worker)
            self._await_ready(worker)
        except FoveaError as exc:
            log.error("encode worker %d could not be restarted: %s", worker.index, exc)

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
        """Each image's verified rows (host tensors), from a worker; retried once elsewhere."""
        batch_id = uuid.uuid4().hex
        request = encode_worker.pack_many([encode_worker.image_frame(batch_id, image, self.recipe_fingerprint)
                                           for image in images])
        tried: set[int] = set()
        deadline = time.monotonic() + 2 * self.timeout_s
        last = "no encode worker is ready"
        while len(tried) < 2 and time.monotonic() < deadline:
            worker = self._choose(tried)
            if worker is None:
                # Every worker is busy, restarting or tried: wait a little for one.
                if all(w.state in ("dead", "failed") or w.index in tried for w in self.workers):
                    break
                time.sleep(0.005)
                continue
            tried.add(worker.index)
            try:
                reply = self._round_trip(worker, request)
            except WorkerLost as lost:
                last = f"worker {worker.index} {lost}"
                worker.state = "dead"  # not chosen again until the restart has it ready
                worker.lock.release()
                threading.Thread(target=self._restart, args=(worker, str(lost)), daemon=True).start()
                continue
            worker.state, worker.batches = "ready", worker.batches + 1
            worker.lock.release()
            return self._verify(reply, batch_id, images)
        raise EncoderUnavailable(f"no encode worker could encode {len(images)} image(s): {last}; retry shortly")

    def _round_trip(self, worker: WorkerHandle, request: bytes) -> bytes:
        if worker.channel is None:
            raise WorkerLost("is not running")
        return worker.channel.round_trip(request, self.timeout_s)

    def _verify(self, reply: bytes, batch_id: str, images: list[ImageInput]) -> list[torch.Tensor]:
        frames = encode_worker.unpack_many(reply)
        if len(frames) == 1 and len(images) != 1 or not frames:
            meta, _ = unpack(frames[0]) if frames else ({}, b"")
            raise FoveaError(f"the encode worker failed: {meta.get('message', 'an empty reply')}")
        if len(frames) != len(images):
            raise HandoffMismatch("frame", f"{len(frames)} embeddings for {len(images)} images")
        out = []
        for frame, image in zip(frames, images, strict=True):
            meta, _ = unpack(frame)
            if meta.get("kind") == encode_worker.ERROR:
                raise FoveaError(f"the encode worker failed: {meta.get('message')}")
            header, payload = from_frame(frame)
            out.append(open_rows(header, payload, Expectation(
                request_id=batch_id, image_hash=image.hash, model_id=self.model_id,
                vision_fingerprint=self.vision_fingerprint, recipe_fingerprint=self.recipe_fingerprint,
                dtype=str(image.pixels.dtype).removeprefix("torch."), hidden=self.hidden, tokens=image.num_tokens,
                grid=image.grid)))
        return out

