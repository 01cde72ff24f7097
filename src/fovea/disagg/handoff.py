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

import dataclasses
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass

import torch

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
    checksum: int  # CRC-32 of the payload: catches corruption and truncation, cheaply


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


def seal(rows: torch.Tensor, *, request_id: str, image_hash: str, model_id: str, vision_fp: str,
         recipe_fp: str, grid: tuple[int, int, int] | None) -> tuple[EmbeddingHeader, bytes]:
    """The header and raw bytes of one image's rows ([tokens, hidden])."""
    data = rows.detach().to("cpu").contiguous()
    payload = data.view(-1).view(torch.uint8).numpy().tobytes()
    dtype = str(data.dtype).removeprefix("torch.")
    header = EmbeddingHeader(request_id, image_hash, model_id, vision_fp, recipe_fp, dtype,
                             (int(data.shape[0]), int(data.shape[1])), int(data.shape[0]), grid,
                             zlib.crc32(payload))
    return header, payload


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


def to_frame(header: EmbeddingHeader, payload: bytes) -> bytes:
    return pack(dataclasses.asdict(header), payload)


def from_frame(frame: bytes) -> tuple[EmbeddingHeader, bytes]:
    fields, payload = unpack(frame)
    try:
        fields["shape"] = tuple(fields["shape"])
        fields["grid"] = tuple(fields["grid"]) if fields["grid"] is not None else None
        header = EmbeddingHeader(**fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise HandoffMismatch("frame", f"unreadable header: {exc}") from exc
    return header, payload


def open_rows(header: EmbeddingHeader, payload: bytes, expected: Expectation) -> torch.Tensor:
    """The rows, once every header field matches ``expected`` and the bytes their checksum."""
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
    dtype = DTYPES.get(header.dtype)
    rows, hidden = header.shape
    if dtype is None or len(payload) != rows * hidden * dtype.itemsize:
        raise HandoffMismatch("shape", f"{len(payload)} bytes for {header.shape} {header.dtype}")
    if zlib.crc32(payload) != header.checksum:
        raise HandoffMismatch("checksum", "the bytes do not match their checksum (corrupted in transit)")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(rows, hidden)
