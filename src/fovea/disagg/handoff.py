"""The verified hand-off of image embeddings from an encode worker to a prefill/decode worker.

Every embedding tensor travels with a header that names what it is: the request, the image's
content hash, the model and the fingerprint of the vision weights that made it, the
preprocessing recipe, dtype, shape, token count and grid, and a checksum of its bytes. The
receiving side checks every field against what its own prompt expects and refuses a
mismatch with the field's name (``HandoffMismatch.reason``, the label of
``fovea_modality_mismatch_errors_total``). There is no fallback: a refused embedding fails
its request; it is never re-encoded silently or dropped to text.

On the wire a frame is a length-prefixed JSON header and the tensor's raw bytes: nothing is
ever unpickled from a socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import struct
import time
from dataclasses import dataclass

import torch

from fovea.engine.kernels import checksum_kernel
from fovea.errors import FoveaError

MAGIC = b"FVE1"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class HandoffMismatch(FoveaError):
    """An embedding that is not the one this request's prompt needs."""

    status, code, type = 500, "image_embedding_mismatch", "server_error"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"image embedding refused ({reason}): {message}")
        self.reason = reason


@dataclass(frozen=True)
class EmbeddingHeader:
    request_id: str
    image_hash: str
    model_id: str
    vision_fingerprint: str
    recipe_fingerprint: str
    dtype: str
    shape: tuple[int, int]
    tokens: int
    grid: tuple[int, int, int] | None
    checksum: int  # handoff.checksum of the payload: catches corruption, computed on the device


@dataclass(frozen=True)
class Expectation:
    """What the prefill/decode side knows independently of the encoder."""

    request_id: str
    image_hash: str
    model_id: str
    vision_fingerprint: str
    recipe_fingerprint: str
    dtype: str
    hidden: int
    tokens: int
    grid: tuple[int, int, int] | None


def vision_fingerprint(modules: list[torch.nn.Module]) -> str:
    """Names, shapes, dtypes and a sample of the bytes of every vision tensor: two processes
    with different tower or projector weights get different fingerprints."""
    digest = hashlib.sha256()
    for index, module in enumerate(modules):
        for name, tensor in sorted(module.state_dict().items()):
            data = tensor.detach().reshape(-1)
            digest.update(f"{index}.{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            step = max(1, data.numel() // 64)
            digest.update(data[::step][:64].to("cpu", torch.float32).numpy().tobytes())
    return digest.hexdigest()[:16]


def checksum(data: torch.Tensor) -> torch.Tensor:
    """A 64-bit checksum of ``data``'s bytes, computed where the tensor lives (a few kernels on a
    GPU, no copy to the host): the sum of its 16-bit words, each times an odd weight that
    depends on its position, modulo 2**64. A changed word changes the sum (its weight is odd),
    and so do swapped or shifted words (their weights differ). CRC-32 on the host costs about
    1 ms per 336 px LLaVA image, the whole hand-off budget; this is microseconds on the GPU.
    Integer sums wrap identically on every device, so CPU and GPU agree bit for bit."""
    words = data.contiguous().view(-1).view(torch.uint8)
    if words.numel() % 2:
        words = torch.cat([words, words.new_zeros(1)])
    words = words.view(torch.int16).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64).mul_(_STRIDE).add_(1)
    return (words.mul_(weights)).sum()


_STRIDE = 0x4F1BBCDCBFA53E0A  # even (half the 64-bit golden ratio), so every weight i * stride + 1 is odd


def as_bytes(data: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return data.contiguous().view(-1).view(torch.uint8)


def byte_tensor(payload: torch.Tensor | bytes) -> torch.Tensor:
    """Raw bytes as a flat uint8 tensor (a copy: frombuffer needs a writable buffer); a tensor as is."""
    if not isinstance(payload, bytes):
        return payload
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)


def seal_many(rows: list[torch.Tensor], metas: list[dict]) -> list[tuple[EmbeddingHeader, torch.Tensor]]:
    """Headers and byte views of each image's rows ([tokens, hidden]), checksummed on their own
    device with one synchronisation for the batch. ``metas`` give each image's header fields
    other than dtype, shape, tokens and checksum."""
    flat = [as_bytes(r.detach()) for r in rows]
    sums = torch.stack([checksum(f) for f in flat]).tolist() if flat else []
    out = []
    for r, f, meta, total in zip(rows, flat, metas, sums, strict=True):
        header = EmbeddingHeader(dtype=str(r.dtype).removeprefix("torch."), shape=(int(r.shape[0]), int(r.shape[1])),
                                 tokens=int(r.shape[0]), checksum=int(total), **meta)
        out.append((header, f))
    return out


def seal(rows: torch.Tensor, *, request_id: str, image_hash: str, model_id: str, vision_fp: str,
         recipe_fp: str, grid: tuple[int, int, int] | None) -> tuple[EmbeddingHeader, torch.Tensor]:
    """The header and byte view of one image's rows."""
    meta = {"request_id": request_id, "image_hash": image_hash, "model_id": model_id,
            "vision_fingerprint": vision_fp, "recipe_fingerprint": recipe_fp, "grid": grid}
    return seal_many([rows], [meta])[0]


def pack(meta: dict, payload: bytes) -> bytes:
    """A frame: magic, the two lengths, a JSON header, the raw bytes."""
    head = json.dumps(meta, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<II", len(head), len(payload)) + head + payload


def unpack(frame: bytes) -> tuple[dict, bytes]:
    if len(frame) < 12 or frame[:4] != MAGIC:
        raise HandoffMismatch("frame", "not an embedding frame (bad magic or too short)")
    head_len, payload_len = struct.unpack("<II", frame[4:12])
    if len(frame) != 12 + head_len + payload_len:
        raise HandoffMismatch("frame", f"frame of {len(frame)} bytes, its lengths say {12 + head_len + payload_len}")
    try:
        meta = json.loads(frame[12:12 + head_len])
    except ValueError as exc:
        raise HandoffMismatch("frame", f"unreadable header: {exc}") from exc
    if not isinstance(meta, dict):
        raise HandoffMismatch("frame", "the header is not a JSON object")
    return meta, frame[12 + head_len:]


def to_frame(header: EmbeddingHeader, payload: torch.Tensor | bytes) -> bytes:
    """A header and its bytes inline in one frame (Ray's object store, tests)."""
    data = payload if isinstance(payload, bytes) else payload.cpu().numpy().tobytes()
    return pack(dataclasses.asdict(header), data)


def header_from(fields: dict) -> EmbeddingHeader:
    try:
        fields = dict(fields)
        fields["shape"] = tuple(fields["shape"])
        fields["grid"] = tuple(fields["grid"]) if fields["grid"] is not None else None
        return EmbeddingHeader(**fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise HandoffMismatch("frame", f"unreadable header: {exc}") from exc


def from_frame(frame: bytes) -> tuple[EmbeddingHeader, bytes]:
    fields, payload = unpack(frame)
    return header_from(fields), payload


def check_header(header: EmbeddingHeader, expected: Expectation) -> None:
    checks = [
        ("request", header.request_id, expected.request_id),
        ("image", header.image_hash, expected.image_hash),
        ("model", header.model_id, expected.model_id),
        ("vision_weights", header.vision_fingerprint, expected.vision_fingerprint),
        ("preprocessing", header.recipe_fingerprint, expected.recipe_fingerprint),
        ("dtype", header.dtype, expected.dtype),
        ("tokens", header.tokens, expected.tokens),
        ("grid", header.grid, expected.grid),
        ("shape", header.shape, (expected.tokens, expected.hidden)),
    ]
    for reason, got, want in checks:
        if got != want:
            raise HandoffMismatch(reason, f"the encoder sent {reason} {got!r}, this request needs {want!r}")


def land_each(items: list[tuple[EmbeddingHeader, torch.Tensor | bytes]],
              device: torch.device | str = "cpu", batched: bool | None = None,
              timing: dict[str, float] | None = None) -> list[torch.Tensor | HandoffMismatch]:
    """Each payload's rows on ``device`` if its length fits its header and the bytes that landed
    there their checksum, else why not (one synchronisation for the batch). The headers'
    other fields are ``check_header``'s to judge.

    The payloads may be views of a reused buffer (shared memory): the rows returned are copies.
    On a GPU the copies run on a stream of their own, so the engine's queued steps do not
    delay them, and are marked as used by the default stream the engine reads them on.

    ``batched`` (default: on a GPU, where triton imports; on the CPU only under triton's
    interpreter, for the tests) lands a batch in a fixed number of GIL-releasing torch calls,
    however many images it holds: the payloads that lie back to back in one
    buffer (the pool's shared segment) cross in one copy, one kernel checksums every image
    (``checksum_kernel``), and the rows are slices of the landed block (``_row_views``). This runs in a client
    thread that shares the GIL with the engine and the event loop, and each torch call can
    wait a switch interval to retake it (bench/handoff_gil_probe.py). ``timing`` gets
    ``wait_s``: the seconds spent waiting for the device to finish the copies and checksums
    (the rest of the landing is this thread's own work)."""
    device = torch.device(device)
    out: list[torch.Tensor | HandoffMismatch | None] = [None] * len(items)
    sound: list[tuple[int, torch.Tensor]] = []
    for index, (header, payload) in enumerate(items):
        data = byte_tensor(payload)
        dtype = DTYPES.get(header.dtype)
        rows, hidden = header.shape
        if dtype is None or data.numel() != rows * hidden * dtype.itemsize:
            out[index] = HandoffMismatch("shape", f"{data.numel()} bytes for {header.shape} {header.dtype}")
        else:
            sound.append((index, data))
    if not sound:
        return out  # type: ignore[return-value]
    on_gpu = device.type == "cuda"
    if batched is None:
        batched = on_gpu and checksum_kernel.usable()
    block = _one_block(sound) if batched else None
    headers = [items[index][0] for index, _ in sound]
    with torch.cuda.stream(_landing_stream(device)) if on_gpu else contextlib.nullcontext():
        if block is not None:
            span, offsets = block
            landed = span.to(device, non_blocking=True) if on_gpu else span.clone()
            if on_gpu:
                landed.record_stream(torch.cuda.default_stream(device))
            base = landed.data_ptr()
            sums = _read_back(checksum_kernel.checksum_table(
                [base + at for at in offsets], [data.numel() // 2 for _, data in sound], device, _STRIDE), timing)
            rows = _row_views(landed, offsets, headers)
        elif on_gpu:
            copies = [data.to(device, non_blocking=True) for _, data in sound]
            for c in copies:
                c.record_stream(torch.cuda.default_stream(device))
            sums = _read_back(torch.stack([checksum(c) for c in copies]), timing)
            rows = [c.view(DTYPES[h.dtype]).view(*h.shape) for c, h in zip(copies, headers, strict=True)]
        else:
            copies = [data.to(device, copy=True) for _, data in sound]
            sums = [int(checksum(c)) for c in copies]
            rows = [c.view(DTYPES[h.dtype]).view(*h.shape) for c, h in zip(copies, headers, strict=True)]
    for (index, _), header, landed_rows, total in zip(sound, headers, rows, sums, strict=True):
        if int(total) != header.checksum:
            out[index] = HandoffMismatch("checksum", "the bytes do not match their checksum (corrupted in transit)")
        else:
            out[index] = landed_rows
    return out  # type: ignore[return-value]


def _read_back(sums: torch.Tensor, timing: dict[str, float] | None) -> list[int]:
    """The checksums on the host: the landing's one synchronisation, timed into ``timing``."""
    started = time.perf_counter()
    out = sums.tolist()
    if timing is not None:
        timing["wait_s"] = time.perf_counter() - started
    return out


def _one_block(sound: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, list[int]] | None:
    """A flat view from the first payload's start to the last one's end, and each payload's
    offset in it, if the payloads are views of one buffer in increasing order with even
    lengths (the kernel reads 16-bit words) and the gaps are small (the shared segment aligns
    each tensor to 256 bytes); else None."""
    first = sound[0][1]
    storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
    offsets: list[int] = []
    end = start
    for _, data in sound:
        gap = data.storage_offset() - end
        if (data.untyped_storage().data_ptr() != storage or not 0 <= gap <= 4096
                or data.numel() % 2 or not data.is_contiguous()):
            return None
        offsets.append(data.storage_offset() - start)
        end = data.storage_offset() + data.numel()
    return first.as_strided((end - start,), (1,), start), offsets


def _row_views(landed: torch.Tensor, offsets: list[int], headers: list[EmbeddingHeader]) -> list[torch.Tensor]:
    """Each image's [tokens, hidden] rows as a view of the landed block. Where every image has
    one dtype and width and lies on a whole row (the segment's 256-byte alignment divides every
    served model's row, e.g. 4,096 x 2 bytes), the block is viewed as one table in two torch
    calls and each image is a slice of it: slicing keeps the GIL, while each ``view`` releases
    it, and retaking it can wait for another thread's whole C call (the event loop's response
    encoding, a tokenizer): bench/gil_releasing_calls.py. Otherwise, two views per image."""
    dtype, hidden = DTYPES[headers[0].dtype], headers[0].shape[1]
    row = hidden * dtype.itemsize
    if (row and landed.numel() % row == 0 and all(at % row == 0 for at in offsets)
            and all(DTYPES[h.dtype] is dtype and h.shape[1] == hidden for h in headers)):
        table = landed.view(dtype).view(-1, hidden)
        return [table[at // row: at // row + h.shape[0]] for at, h in zip(offsets, headers, strict=True)]
    return [landed[at: at + h.shape[0] * h.shape[1] * DTYPES[h.dtype].itemsize].view(DTYPES[h.dtype]).view(*h.shape)
            for at, h in zip(offsets, headers, strict=True)]


def open_each(items: list[tuple[EmbeddingHeader, torch.Tensor | bytes]], expected: list[Expectation],
              device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Each image's rows on ``device``, once every header field matches its expectation and the
    bytes their checksum; the first refusal raises."""
    for (header, _), want in zip(items, expected, strict=True):
        check_header(header, want)
    out = land_each(items, device)
    for result in out:
        if isinstance(result, HandoffMismatch):
            raise result
    return out  # type: ignore[return-value]


def open_rows(header: EmbeddingHeader, payload: torch.Tensor | bytes, expected: Expectation,
              device: torch.device | str = "cpu") -> torch.Tensor:
    return open_each([(header, payload)], [expected], device)[0]


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _landing_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
