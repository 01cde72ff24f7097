"""The encode worker: a process that holds a model's vision part alone and encodes images.

It loads the tower and projector through the family's adapter (``model.vision_part``: no
language-model tensor is read), then answers batches (``wire`` messages). A batch is a batch
item (where the reply goes) and one item per image: its preprocessed pixels with a JSON meta
(batch id, content hash, recipe, dtype, shape, grid, token count). The reply is a batch item
(its timings) and one sealed embedding per image (``handoff.seal_many``: header fields and a
checksum computed on the GPU), or an error item. On one host the tensors cross in shared
memory that the pool owns; through Ray they are inline bytes. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from multiprocessing.connection import Connection

import torch

from fovea.disagg import host_copy, wire
from fovea.disagg.encoder_plan import MARGIN_BYTES, EncoderPlan, refuse_unless_fits
from fovea.disagg.handoff import DTYPES, pack, seal_many, vision_fingerprint
from fovea.disagg.parent_watch import exit_with_parent
from fovea.models.base import ImageInput

READY, ERROR, BATCH = "ready", "error", "batch"
# Images per vision forward inside a worker: a batch of 32 crosses in one message, but the
# tower runs 8 at a time, so the activation peak (which the worker's plan reserves) is 8
# images' while the rows of all 32 wait to be sealed. 8 LLaVA images are 4,616 tokens per
# product, enough to keep an H200's matrix units busy.
FORWARD_IMAGES = 8


def image_item(batch_id: str, image: ImageInput, recipe_fp: str) -> wire.Item:
    """The image's meta and pixels. Host pixels in one run (what the preprocessing makes) go as
    they are: each torch call here would release the GIL and wait to retake it beside the busy
    engine (host_copy.py); ``wire.encode`` copies their bytes."""
    data = image.pixels
    if data.requires_grad or not host_copy.copyable(data):
        data = data.detach().to("cpu").contiguous()
    meta = {"batch": batch_id, "hash": image.hash, "recipe": recipe_fp, "dtype": str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape), "grid": list(image.grid) if image.grid else None, "tokens": image.num_tokens}
    return meta, data


# Pixels: the model's dtype (patches), or uint8 (Qwen's resized images, patched by the vision stage here).
PIXEL_DTYPES = {**DTYPES, "uint8": torch.uint8}


def read_image(meta: dict, data: torch.Tensor, device: torch.device) -> ImageInput:
    pixels = data.view(PIXEL_DTYPES[meta["dtype"]]).view(*meta["shape"]).to(device, non_blocking=True)
    grid = tuple(meta["grid"]) if meta["grid"] else None
    return ImageInput(pixels, int(meta["tokens"]), meta["hash"], grid)


def measure_plan(service: EncodeService, batch_images: int) -> EncoderPlan:
    """The worker's plan: its weights, and on CUDA the measured peak of its largest batch (the
    tower's fixed size x ``batch_images``, or one image of the processor's max_pixels),
    sealing included (the checksum's temporaries live on the GPU too)."""
    from fovea.engine.memory.profile import CudaMeter, measure, tensor_bytes

    part = service.part

    weights = tensor_bytes(part.model)
    if part.device.type != "cuda":
        return EncoderPlan(str(part.device), weights, None, MARGIN_BYTES, batch_images, None)
    adapter, config = part.adapter, part.model.config
    codec = adapter.codec(adapter.load_processor(part.path), 0, part.dtype)
    if adapter.fixed_image_shape(config) is None:
        batch_images = 1  # one image of max_pixels already exceeds a step's token budget
    images = adapter.dummy_images(config, codec, batch_images)
    metas = [{"batch": "plan", "recipe": ""}] * len(images)
    _, _, peak = measure(CudaMeter(part.device), lambda: service.encode_and_seal(
        [(meta, _to(image, part.device)) for meta, image in zip(metas, images, strict=True)]))
    plan = EncoderPlan(str(part.device), weights, peak, MARGIN_BYTES, batch_images, part.free_before_bytes)
    if plan.free_bytes is not None:
        refuse_unless_fits(plan.need_bytes, plan.free_bytes, plan.render())
    return plan


def hold_to_plan(plan: EncoderPlan, device: torch.device) -> None:
    """Cap this process's caching allocator at the plan: past it, a batch fails with
    out-of-memory here instead of taking memory the prefill/decode worker sharing this GPU
    counts on."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, plan.need_bytes / total), device)


class EncodeService:
    """What an encode worker does, whatever carries its messages (a pipe and shared memory here,
    Ray's object store across machines: ``ray_workers``). Built once: loads the vision part and
    measures its plan.

    The model id is the worker's own reading of its directory; the recipe fingerprint is the
    one the pixels were preprocessed with, sent with them and returned with their rows."""

    def __init__(self, model_dir: str, device: str, dtype: str, batch_images: int = 8,
                 fused_vision: bool = False, hold: bool = True) -> None:
        """``hold``: cap this process's allocator at the plan (a worker does; `fovea doctor`,
        which only reports the plan, does not)."""
        from fovea.loading.contract import directory_fingerprint
        from fovea.loading.vision_part import load_vision_part

        # Batches of 1 to 32 images in turn fragment the caching allocator: measured on the H200,
        # 0.25 GiB reserved beyond what was allocated, the whole margin. Expandable segments
        # grow and shrink one mapping instead (read when CUDA first allocates, so set before).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.part = load_vision_part(model_dir, device, dtype)
        self.model_id = directory_fingerprint(self.part.path)
        self.encode, self.vision_label = vision_stage(self.part, fused_vision)
        self.fingerprint = vision_fingerprint(self.part.adapter.vision_modules(self.part.model))
        self.plan = measure_plan(self, batch_images)
        if hold:
            hold_to_plan(self.plan, self.part.device)

    def check_recipe(self, images: list[tuple[dict, ImageInput]]) -> None:
        """Qwen-VL's uint8 images (resized by the API process, or at their decoded size for the
        vision stage to resize to their grid, models.qwen_pixels) are resized, rescaled and
        normalised here by the recipe of this worker's own reading of the model directory: refused
        unless the pixels were sent under that same recipe (the contract's fingerprint, which a
        --processor-override changes)."""
        from fovea.loading.contract import fingerprint, recipe_of
        from fovea.models.qwen_pixels import is_resized_image

        wanted = {meta["recipe"] for meta, image in images if meta["recipe"] and is_resized_image(image.pixels)}
        if not wanted:
            return
        adapter = self.part.adapter
        ours = fingerprint(recipe_of(adapter.image_processor_of(self.part), adapter.recipe_fields))
        if wanted != {ours}:
            raise ValueError(f"images resized under preprocessing recipe {sorted(wanted)}, but this encode worker "
                             f"normalises with the model directory's recipe {ours}: a --processor-override is not "
                             "applied in encode workers; serve without it or with --topology agg")

    def ready_frame(self) -> bytes:
        part = self.part
        return pack({"kind": READY, "pid": os.getpid(), "vision_fingerprint": self.fingerprint,
                     "parameters": part.parameters, "load_seconds": part.load_seconds, "vision": self.vision_label,
                     "plan": self.plan.to_dict(), "plan_text": self.plan.render()}, b"")

    def encode_and_seal(self, images: list[tuple[dict, ImageInput]]) -> tuple[list[wire.Item], float, float]:
        """Rows for each image, sealed: (items, forward seconds, seal seconds)."""
        cuda = self.part.device.type == "cuda"
        started = time.perf_counter()
        with torch.inference_mode():
            rows = []
            for start in range(0, len(images), FORWARD_IMAGES):  # the activation peak of a chunk
                rows.extend(self.encode([image for _, image in images[start:start + FORWARD_IMAGES]]))
            if cuda:
                torch.cuda.synchronize(self.part.device)
            encoded = time.perf_counter()
            metas = [{"request_id": meta["batch"], "image_hash": image.hash, "model_id": self.model_id,
                      "vision_fingerprint": self.fingerprint, "recipe_fingerprint": meta["recipe"],
                      "grid": image.grid} for meta, image in images]
            sealed = seal_many(list(rows), metas)
        items = [(dataclasses.asdict(header), data) for header, data in sealed]
        return items, encoded - started, time.perf_counter() - encoded

    def handle(self, request: bytes, segments: wire.Attachments | None = None) -> bytes:
        """One batch: a message of images in, a message of sealed embeddings (or one error) out.
        With ``segments`` the reply's tensors go into the pool's reply segment."""
        try:
            started = time.perf_counter()
            items = wire.decode(request, segments)
            batch, images = items[0][0], items[1:]
            if batch.get("kind") != BATCH:
                raise ValueError("a batch message starts with its batch item")
            images = [(meta, read_image(meta, data, self.part.device)) for meta, data in images]
            self.check_recipe(images)
            read = time.perf_counter() - started
            try:
                rows, encode_s, seal_s = self.encode_and_seal(images)
            except torch.OutOfMemoryError:
                # Cached blocks of other batch sizes: give them back and try once more within
                # the plan's cap before refusing the batch.
                torch.cuda.empty_cache()
                rows, encode_s, seal_s = self.encode_and_seal(images)
            reply_segment = segments(batch["reply"]) if segments is not None and batch.get("reply") else None
            head = {"kind": BATCH, "read_s": read, "encode_s": encode_s, "seal_s": seal_s,
                    "peak_reserved_bytes": _peak_reserved(self.part.device),
                    "pinned": reply_segment.pinned if reply_segment is not None else None}
            writing = time.perf_counter()

            def written() -> None:
                head["write_s"] = time.perf_counter() - writing
                head["handle_s"] = time.perf_counter() - started

            return wire.encode([(head, None), *rows], reply_segment, written)
        except Exception as exc:  # noqa: BLE001 - one bad batch is answered, the worker goes on
            return wire.encode([error_item(exc, traceback.format_exc()[-2000:])])


def _peak_reserved(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def error_item(exc: BaseException, trace: str = "") -> wire.Item:
    return {"kind": ERROR, "message": f"{type(exc).__name__}: {exc}", "trace": trace}, None


def error_frame(exc: BaseException, trace: str = "") -> bytes:
    return pack(error_item(exc, trace)[0], b"")


def vision_stage(part, fused: bool) -> tuple:
    """(the vision forward, which one): the fused stage the adapter declares where it runs and
    agrees with transformers' modules on this tower (on a GPU), else the adapter's own
    (``engine.vision.vision_stage``, as the engine's model runner chooses). The fused CLIP stage keeps
    only the feature layer's hidden states: at LLaVA's batch of 32 the modules' forward keeps
    all 25 (0.9 GiB)."""
    from fovea.engine.vision.vision_stage import choose_vision_stage

    stage = choose_vision_stage(part, enabled=fused)
    return stage.forward, stage.label


def worker_main(conn: Connection, model_dir: str, device: str, dtype: str, batch_images: int = 8,
                fused_vision: bool = False) -> None:
    """The process's body: load, say ready (with the vision fingerprint), then serve until EOF."""
    exit_with_parent()  # at once, even while it loads or encodes
    torch.set_num_threads(1)
    try:
        service = EncodeService(model_dir, device, dtype, batch_images, fused_vision)
    except Exception as exc:  # noqa: BLE001 - the parent reports why the worker could not start
        conn.send_bytes(error_frame(exc))
        return
    segments = wire.Attachments(pin=service.part.device.type == "cuda")
    conn.send_bytes(service.ready_frame())
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            segments.close()
            return
        conn.send_bytes(service.handle(request, segments))


def _to(image: ImageInput, device: torch.device) -> ImageInput:
    return ImageInput(image.pixels.to(device), image.num_tokens, image.hash, image.grid)
