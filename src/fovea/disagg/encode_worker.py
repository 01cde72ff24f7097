"""The encode worker: a process that holds a model's vision part alone and encodes images.

It loads the tower and projector through the family's adapter (``model.vision_part``: no
language-model tensor is read), then answers requests on a pipe. A request is one frame
per image (its preprocessed pixels, raw, with a JSON header: batch id, content hash, dtype,
shape, grid, token count); the reply is one sealed embedding frame per image
(``handoff.seal``), or an error frame. Nothing is pickled: frames are bytes.
"""

from __future__ import annotations

import os
import struct
import traceback
from multiprocessing.connection import Connection

import torch

from fovea.disagg.encoder_plan import MARGIN_BYTES, EncoderPlan, refuse_unless_fits
from fovea.disagg.handoff import DTYPES, pack, seal, to_frame, unpack, vision_fingerprint
from fovea.models.base import ImageInput

READY, ERROR = "ready", "error"


def pack_many(frames: list[bytes]) -> bytes:
    return struct.pack("<I", len(frames)) + b"".join(struct.pack("<I", len(f)) + f for f in frames)


def unpack_many(data: bytes) -> list[bytes]:
    (count,), offset, out = struct.unpack("<I", data[:4]), 4, []
    for _ in range(count):
        (length,) = struct.unpack("<I", data[offset:offset + 4])
        out.append(data[offset + 4:offset + 4 + length])
        offset += 4 + length
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} stray bytes after {count} frames")
    return out


def image_frame(batch_id: str, image: ImageInput, recipe_fp: str) -> bytes:
    data = image.pixels.detach().to("cpu").contiguous()
    meta = {"batch": batch_id, "hash": image.hash, "recipe": recipe_fp, "dtype": str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape), "grid": list(image.grid) if image.grid else None, "tokens": image.num_tokens}
    return pack(meta, data.view(-1).view(torch.uint8).numpy().tobytes())


def read_image(frame: bytes) -> tuple[dict, ImageInput]:
    meta, payload = unpack(frame)
    dtype = DTYPES[meta["dtype"]]
    pixels = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(*meta["shape"])
    grid = tuple(meta["grid"]) if meta["grid"] else None
    return meta, ImageInput(pixels, int(meta["tokens"]), meta["hash"], grid)


def measure_plan(part, batch_images: int) -> EncoderPlan:
    """The worker's plan: its weights, and on CUDA the measured peak of its largest batch (the
    tower's fixed size x ``batch_images``, or one image of the processor's max_pixels)."""
    from fovea.engine.paged.memory_profile import CudaMeter, measure, tensor_bytes

    weights = tensor_bytes(part.model)
    if part.device.type != "cuda":
        return EncoderPlan(str(part.device), weights, None, MARGIN_BYTES, batch_images, None)
    adapter, config = part.adapter, part.model.config
    codec = adapter.codec(adapter.load_processor(part.path), 0, part.dtype)
    if adapter.fixed_image_shape(config) is None:
        batch_images = 1  # one image of max_pixels already exceeds a step's token budget
    images = adapter.dummy_images(config, codec, batch_images)
    encode = adapter.vision_forward(part)
    with torch.inference_mode():
        _, _, peak = measure(CudaMeter(part.device), lambda: encode([_to(im, part.device) for im in images]))
    plan = EncoderPlan(str(part.device), weights, peak, MARGIN_BYTES, batch_images, part.free_before_bytes)
    if plan.free_bytes is not None:
        refuse_unless_fits(plan.need_bytes, plan.free_bytes, plan.render())
    return plan


class EncodeService:
    """What an encode worker does, whatever carries its frames (a pipe here, Ray's object store
    across machines: ``ray_workers``). Built once: loads the vision part and measures its plan.

    The model id is the worker's own reading of its directory; the recipe fingerprint is the
    one the pixels were preprocessed with, sent with them and returned with their rows."""

    def __init__(self, model_dir: str, device: str, dtype: str, batch_images: int = 8) -> None:
        from fovea.model.contract import directory_fingerprint
        from fovea.model.vision_part import load_vision_part

        self.part = load_vision_part(model_dir, device, dtype)
        self.model_id = directory_fingerprint(self.part.path)
        self.plan = measure_plan(self.part, batch_images)
        self.encode = self.part.adapter.vision_forward(self.part)
        self.fingerprint = vision_fingerprint(self.part.adapter.vision_modules(self.part.model))

    def ready_frame(self) -> bytes:
        part = self.part
        return pack({"kind": READY, "pid": os.getpid(), "vision_fingerprint": self.fingerprint,
                     "parameters": part.parameters, "load_seconds": part.load_seconds,
                     "plan": self.plan.to_dict(), "plan_text": self.plan.render()}, b"")

    def handle(self, request: bytes) -> bytes:
        """One batch: image frames in, sealed embedding frames (or one error frame) out."""
        try:
            images = [read_image(frame) for frame in unpack_many(request)]
            with torch.inference_mode():
                rows = self.encode([_to(image, self.part.device) for _, image in images])
            return pack_many([to_frame(*seal(r, request_id=meta["batch"], image_hash=image.hash,
                                             model_id=self.model_id, vision_fp=self.fingerprint,
                                             recipe_fp=meta["recipe"], grid=image.grid))
                              for (meta, image), r in zip(images, rows, strict=True)])
        except Exception as exc:  # noqa: BLE001 - one bad batch is answered, the worker goes on
            return pack_many([error_frame(exc, traceback.format_exc()[-2000:])])


def error_frame(exc: BaseException, trace: str = "") -> bytes:
    return pack({"kind": ERROR, "message": f"{type(exc).__name__}: {exc}", "trace": trace}, b"")


def worker_main(conn: Connection, model_dir: str, device: str, dtype: str, batch_images: int = 8) -> None:
    """The process's body: load, say ready (with the vision fingerprint), then serve until EOF."""
    torch.set_num_threads(1)
    try:
        service = EncodeService(model_dir, device, dtype, batch_images)
    except Exception as exc:  # noqa: BLE001 - the parent reports why the worker could not start
        conn.send_bytes(error_frame(exc))
        return
    conn.send_bytes(service.ready_frame())
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(service.handle(request))


def _to(image: ImageInput, device: torch.device) -> ImageInput:
    return ImageInput(image.pixels.to(device), image.num_tokens, image.hash, image.grid)
