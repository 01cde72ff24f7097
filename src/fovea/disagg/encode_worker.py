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
    shape = adapter.fixed_image_shape(config)
    if shape is not None:
        images = [ImageInput(torch.randn(shape, dtype=part.dtype), 0, f"plan-{i}") for i in range(batch_images)]
    else:
        codec = adapter.codec(adapter.load_processor(part.path), 0, part.dtype)
        images, batch_images = adapter.dummy_images(codec, 1), 1
    encode = adapter.vision_forward(part)
    with torch.inference_mode():
        _, _, peak = measure(CudaMeter(part.device), lambda: encode([_to(im, part.device) for im in images]))
    plan = EncoderPlan(str(part.device), weights, peak, MARGIN_BYTES, batch_images, part.free_before_bytes)
    if plan.free_bytes is not None:
        refuse_unless_fits(plan.need_bytes, plan.free_bytes, plan.render())
    return plan


def worker_main(conn: Connection, model_dir: str, device: str, dtype: str, batch_images: int = 8) -> None:
    """The process's body: load, say ready (with the vision fingerprint), then serve until EOF.

    The model id is the worker's own reading of its directory; the recipe fingerprint is the
    one the pixels were preprocessed with, sent with them and returned with their rows."""
    torch.set_num_threads(1)
    try:
        from fovea.model.contract import directory_fingerprint
        from fovea.model.vision_part import load_vision_part

        part = load_vision_part(model_dir, device, dtype)
        model_id = directory_fingerprint(part.path)
        plan = measure_plan(part, batch_images)
        encode = part.adapter.vision_forward(part)
        fingerprint = vision_fingerprint(part.adapter.vision_modules(part.model))
        conn.send_bytes(pack({"kind": READY, "pid": os.getpid(), "vision_fingerprint": fingerprint,
                              "parameters": part.parameters, "load_seconds": part.load_seconds,
                              "plan": plan.to_dict(), "plan_text": plan.render()}, b""))
    except Exception as exc:  # noqa: BLE001 - the parent reports why the worker could not start
        conn.send_bytes(pack({"kind": ERROR, "message": f"{type(exc).__name__}: {exc}"}, b""))
        return
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            images = [read_image(frame) for frame in unpack_many(request)]
            batch = [image for _, image in images]
            with torch.inference_mode():
                rows = encode([_to(image, part.device) for image in batch])
            replies = [to_frame(*seal(r, request_id=meta["batch"], image_hash=image.hash, model_id=model_id,
                                      vision_fp=fingerprint, recipe_fp=meta["recipe"], grid=image.grid))
                       for (meta, image), r in zip(images, rows, strict=True)]
            conn.send_bytes(pack_many(replies))
        except Exception as exc:  # noqa: BLE001 - one bad batch is answered, the worker goes on
            conn.send_bytes(pack_many([pack({"kind": ERROR, "message": f"{type(exc).__name__}: {exc}",
                                             "trace": traceback.format_exc()[-2000:]}, b"")]))


def _to(image: ImageInput, device: torch.device) -> ImageInput:
    return ImageInput(image.pixels.to(device), image.num_tokens, image.hash, image.grid)
