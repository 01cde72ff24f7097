"""What crosses between the API process and the engine core, and how.

Messages are pickled (protocol 5) and sent as one ZeroMQ frame each. Two parts of a request
do not go through the socket as they are:

- **Pixels** are written to one file in shared memory (``/dev/shm``) per request. The
  message carries only the file's path and each image's slice. The core maps the file
  copy-on-write and removes its name at once, so the pages live exactly as long as the
  tensors that view them. A LLaVA image is 1.3 MB of float16 patches, a Qwen-VL image its resized
  uint8 pixels (2.8 MB at 1280x720; the core patches it, ``models.qwen_pixels``); through the
  socket they would be copied twice more, on the core's busy loop.
- **Grammars** are xgrammar's compiled form, serialised without their tokenizer, which each
  side builds once (``CompiledGrammar.serialize_json``). The API process compiles a request's
  grammar, so a bad schema is still a 400 before the stream starts, and the core only
  deserialises it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fovea.engine.sampling.params import SamplingParams
from fovea.loading.prompt import EncodedPrompt

FALLBACK_DIR = Path(tempfile.gettempdir())
PIXEL_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else FALLBACK_DIR
PIXEL_PREFIX = "fovea-pixels-"
log = logging.getLogger("fovea.engine.process")
_ALIGN = 64  # each image's bytes start on a cache line, so every dtype views them aligned


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=5)


def loads(frame: bytes | memoryview) -> Any:
    return pickle.loads(frame)


@dataclass(frozen=True, slots=True)
class PixelSlice:
    """Where one image's pixels lie in its request's shared-memory file."""

    offset: int
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch."


@dataclass(frozen=True, slots=True)
class WireGrammar:
    serialized: str  # CompiledGrammar.serialize_json()
    vocab_size: int
    dead_ends: bool


def pixels_out(prompt: EncodedPrompt, owner: str) -> tuple[EncodedPrompt, str | None]:
    """The prompt with its images' pixels written to one new shared-memory file and replaced by
    their slices, and the file's path (None for a prompt without images). ``owner`` names the
    writing process in the file name, so that what a dead core never read can be found."""
    if not prompt.images:
        return prompt, None
    name = f"{PIXEL_PREFIX}{owner}-{uuid.uuid4().hex}"
    try:
        return _write_pixels(prompt, PIXEL_DIR / name)
    except OSError as exc:  # /dev/shm full (a container's default is 64 MiB): the temp directory
        if PIXEL_DIR == FALLBACK_DIR:
            raise
        log.warning("pixels go through %s: %s is full or not writable (%s); give the container more shared "
                    "memory (docker run --shm-size)", FALLBACK_DIR, PIXEL_DIR, exc.strerror)
        return _write_pixels(prompt, FALLBACK_DIR / name)


def _write_pixels(prompt: EncodedPrompt, path: Path) -> tuple[EncodedPrompt, str]:
    images, offset = [], 0
    try:
        with open(path, "wb") as f:
            for image in prompt.images:
                pixels = image.pixels.detach().to("cpu").contiguous()
                raw = pixels.reshape(-1).view(torch.uint8)
                pad = -offset % _ALIGN
                if pad:
                    f.write(b"\0" * pad)
                    offset += pad
                f.write(memoryview(raw.numpy()))
                images.append(dataclasses.replace(image, pixels=PixelSlice(
                    offset, tuple(pixels.shape), str(pixels.dtype).removeprefix("torch."))))
                offset += raw.numel()
    except BaseException:
        remove_pixels(str(path))
        raise
    return dataclasses.replace(prompt, images=images), str(path)


def pixels_in(prompt: EncodedPrompt, path: str | None) -> EncodedPrompt:
    """The prompt with its pixels viewed from the shared-memory file, whose name is removed: the
    mapping (private, copy-on-write) keeps the pages until the last tensor viewing them goes."""
    if path is None:
        return prompt
    try:
        size = os.path.getsize(path)
        data = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    finally:
        remove_pixels(path)
    images = []
    for image in prompt.images:
        where: PixelSlice = image.pixels
        dtype = getattr(torch, where.dtype)
        count = 1
        for n in where.shape:
            count *= n
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        pixels = data[where.offset:where.offset + nbytes].view(dtype).view(where.shape)
        images.append(dataclasses.replace(image, pixels=pixels))
    return dataclasses.replace(prompt, images=images)


def remove_pixels(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_orphans(owner: str) -> int:
    """Remove the pixel files ``owner`` wrote that no core took (the core died first)."""
    removed = 0
    for directory in {PIXEL_DIR, FALLBACK_DIR}:
        for path in directory.glob(f"{PIXEL_PREFIX}{owner}-*"):
            remove_pixels(str(path))
            removed += 1
    return removed


def params_out(params: SamplingParams) -> SamplingParams:
    """The parameters with a compiled grammar in its serialised form."""
    grammar = params.grammar
    if grammar is None or isinstance(grammar, WireGrammar):
        return params
    return dataclasses.replace(params, grammar=WireGrammar(grammar.compiled.serialize_json(), grammar.vocab_size,
                                                           grammar.dead_ends))


class GrammarReader:
    """The core's side of ``params_out``: one xgrammar TokenizerInfo, built on first use."""

    def __init__(self, tokenizer: Any, stop_token_ids: list[int]) -> None:
        self.tokenizer, self.stop_token_ids = tokenizer, stop_token_ids
        self._info: dict[int, Any] = {}

    def params_in(self, params: SamplingParams) -> SamplingParams:
        wire = params.grammar
        if not isinstance(wire, WireGrammar):
            return params
        import xgrammar as xgr

        from fovea.engine.structured.compiler import Grammar

        info = self._info.get(wire.vocab_size)
        if info is None:
            info = self._info[wire.vocab_size] = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=wire.vocab_size, stop_token_ids=list(self.stop_token_ids))
        compiled = xgr.CompiledGrammar.deserialize_json(wire.serialized, info)
        return dataclasses.replace(params, grammar=Grammar(compiled, wire.vocab_size, wire.dead_ends))
