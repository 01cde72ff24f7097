"""Image embeddings for the prompts of one step: cached ones reused, new ones encoded in batches.

Both engines use this, so the encoder cache, the vision-latency metric and the batching of
the vision tower behave the same whichever engine serves.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable

import torch

from fovea.engine.encoder_cache import EncoderCache
from fovea.model.loader import LoadedModel
from fovea.model.prompt import EncodedPrompt, PlaceholderMismatch
from fovea.model.vision import encode_images


class ImageEncoder:
    def __init__(self, loaded: LoadedModel, cache: EncoderCache, batch_size: int | None = None,
                 on_vision_seconds: Callable[[float], None] | None = None,
                 graphs: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 encode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.loaded = loaded
        self.cache = cache
        self.batch_size = batch_size  # None: all new images of a step in one call
        self.on_vision_seconds = on_vision_seconds
        self.graphs = graphs  # a GraphedVision (CUDA), used for the batches it can run
        # the vision stage for the other batches: encode_images, or e.g. vision_fused.FusedVision
        self.encode = encode if encode is not None else functools.partial(encode_images, loaded)
        self._gpu_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (begin, end) not yet reported

    def rows_for(self, prompts: Iterable[EncodedPrompt]) -> dict[str, torch.Tensor]:
        """{image hash: [tokens_per_image, hidden]} for every image of ``prompts``."""
        found: dict[str, torch.Tensor] = {}
        todo: dict[str, torch.Tensor] = {}
        for prompt in prompts:
            for index, key in enumerate(prompt.image_hashes):
                if key in found or key in todo:
                    continue
                cached = self.cache.get(key)
                if cached is not None:
                    found[key] = cached
                else:
                    todo[key] = prompt.pixel_values[index]
        keys = list(todo)
        step = self.batch_size or max(1, len(keys))
        on_cuda = self.loaded.device.type == "cuda"
        for lo in range(0, len(keys), step):
            batch = keys[lo:lo + step]
            started = time.perf_counter()
            pixels = torch.stack([todo[k] for k in batch])
            if on_cuda and pixels.device.type == "cpu":
                # Pinned and asynchronous: a language-model step may still be running on the
                # GPU, and a plain copy would wait for it.
                pixels = pixels.pin_memory().to(self.loaded.device, non_blocking=True)
            begin = self._record() if on_cuda else None
            if self.graphs is not None and self.graphs.can_run(pixels):
                encoded = self.graphs(pixels)
            else:
                encoded = self.encode(pixels)
            if begin is not None:
                self._gpu_timings.append((begin, self._record()))
            elif self.on_vision_seconds:
                self.on_vision_seconds(time.perf_counter() - started)
            for key, rows in zip(batch, encoded, strict=True):
                self.cache.put(key, rows)
                found[key] = rows
        self._report_finished_timings()
        return found

    @staticmethod
    def _record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _report_finished_timings(self) -> None:
        """On CUDA the vision metric is the stage's GPU time, read from events once they have
        passed (never waiting for them: that would stall the engine behind a running step)."""
        while self._gpu_timings and self._gpu_timings[0][1].query():
            begin, end = self._gpu_timings.pop(0)
            if self.on_vision_seconds:
                self.on_vision_seconds(begin.elapsed_time(end) / 1e3)


def token_embeddings(loaded: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The language model's token embeddings of ``input_ids`` (any shape).

    Some checkpoints give the image token an id past the embedding table; those positions are
    overwritten with image rows afterwards, so any valid id will do for the lookup.
    """
    table = loaded.model.get_input_embeddings()
    return table(input_ids.masked_fill(input_ids >= table.num_embeddings, 0))


def scatter_image_rows(embeds: torch.Tensor, input_ids: torch.Tensor, rows: list[torch.Tensor],
                       image_token_id: int, request_id: str) -> None:
    """Write each image's rows into one sequence's image-token positions (in place).

    The prompt's counts were checked when it was built; this guards the hand-off itself.
    """
    positions = (input_ids == image_token_id).nonzero().squeeze(1)
    check_image_row_count(positions.numel(), rows, request_id)
    if rows:
        embeds[positions] = torch.cat(rows).to(embeds.dtype)


def check_image_row_count(positions: int, rows: list[torch.Tensor], request_id: str) -> None:
    """The hand-off guard: as many image rows as the prompt has image-token positions."""
    supplied = sum(r.shape[0] for r in rows)
    if supplied != positions:
        raise PlaceholderMismatch(f"request {request_id}: {positions} image-token positions but "
                                  f"{supplied} image embedding rows", status=500)


def start_worker(target: Callable[[], None], name: str, device: torch.device,
                 cpu_threads: int | None) -> threading.Thread:
    """The engine's worker thread. On a CPU device the model gets all cores but one (the
    other is left to HTTP and preprocessing: oversubscribed OpenMP threads spin and starve them)."""
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads or max(1, (os.cpu_count() or 2) - 1))
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
