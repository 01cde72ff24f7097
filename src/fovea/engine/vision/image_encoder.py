"""Image embeddings for the prompts of one step: cached ones reused, new ones encoded in batches.

Both engines use this, so the encoder cache, the vision-latency metric and the batching of
the vision tower behave the same whichever engine serves.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch

from fovea.engine.vision.encoder_cache import EncoderCache
from fovea.loading.loader import LoadedModel
from fovea.models.base import EncodedPrompt, ImageInput, PlaceholderMismatch

MAX_PREFETCHED = 4096  # images encoded ahead and not yet taken


class ImageEncoder:
    def __init__(self, loaded: LoadedModel, cache: EncoderCache, batch_size: int | None = None,
                 on_vision_seconds: Callable[[float], None] | None = None,
                 graphs: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 encode: Callable[[list[ImageInput]], list[torch.Tensor]] | None = None,
                 max_batch_tokens: int | None = None, remote: bool = False,
                 submit: Callable[[list[ImageInput]], Future] | None = None) -> None:
        self.loaded = loaded
        self.cache = cache
        self.batch_size = batch_size  # None: all new images of a step in one call
        # Image tokens per vision call at most (dynamic-resolution towers: the activation peak
        # grows with the tokens, not the image count); one image larger than this goes alone.
        self.max_batch_tokens = max_batch_tokens
        self.on_vision_seconds = on_vision_seconds
        self.graphs = graphs  # a GraphedVision (CUDA, fixed-size images), used for the batches it can run
        # The vision stage for the other batches: the adapter's eager forward, or e.g. the
        # fused stage of vision_fused (wrapped by models.llava.stacked).
        self.encode = encode if encode is not None else loaded.adapter.vision_forward(loaded)
        self._gpu_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (begin, end) not yet reported
        # remote: ``encode`` runs elsewhere (an encode worker): pixels stay on the host and the
        # rows it returns are moved to the model's device here.
        self.remote = remote
        self.submit = submit  # remote: encode on another thread, returning a future of the rows
        # remote: images submitted when their request was admitted, by hash: (future, index).
        self.prefetched: collections.OrderedDict[str, tuple[Future, int]] = collections.OrderedDict()
        self.prefetch_hits = 0  # images whose rows were ready (or in progress) when their prefill came

    def batches(self, images: list[ImageInput]) -> list[list[ImageInput]]:
        """``images`` in vision calls of at most batch_size images and max_batch_tokens tokens."""
        out: list[list[ImageInput]] = []
        tokens = 0
        for image in images:
            full = out and (self.batch_size and len(out[-1]) >= self.batch_size
                            or self.max_batch_tokens and tokens + image.num_tokens > self.max_batch_tokens)
            if not out or full:
                out.append([])
                tokens = 0
            out[-1].append(image)
            tokens += image.num_tokens
        return out

    def to_device(self, images: list[ImageInput]) -> list[ImageInput]:
        """The images' pixels on the model's device, in one copy per dtype (Qwen's resized uint8
        images beside a video's patches). On CUDA it is pinned and asynchronous: a language-model
        step may still be running, and a plain copy would wait."""
        device = self.loaded.device
        if all(image.pixels.device == device for image in images):
            return images
        out = list(images)
        for dtype in {image.pixels.dtype for image in images}:
            indices = [i for i, image in enumerate(images) if image.pixels.dtype == dtype]
            flat = torch.cat([images[i].pixels.reshape(-1) for i in indices])
            if device.type == "cuda":
                flat = flat.pin_memory().to(device, non_blocking=True)
            else:
                flat = flat.to(device)
            offset = 0
            for i in indices:
                n = images[i].pixels.numel()
                out[i] = dataclasses.replace(images[i], pixels=flat[offset:offset + n].view(images[i].pixels.shape))
                offset += n
        return out

    def run(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """One vision call: graphs where they can run the batch, else the eager or fused stage."""
        if self.graphs is not None and len({tuple(image.pixels.shape) for image in images}) == 1:
            pixels = torch.stack([image.pixels for image in images])
            if self.graphs.can_run(pixels):
                return list(self.graphs(pixels).unbind(0))
        return self.encode(images)

    def prefetch(self, prompt: EncodedPrompt) -> None:
        """Remote stages: start encoding the prompt's new images now (the engine calls this when
        it admits the request), so that its prefill finds them ready instead of waiting."""
        if self.submit is None:
            return
        new = [image for image in prompt.images if image.hash not in self.prefetched and self.cache.get(image.hash) is None]
        if not new:
            return
        future = self.submit(new)
        for index, image in enumerate(new):
            self.prefetched[image.hash] = (future, index)
        while len(self.prefetched) > MAX_PREFETCHED:  # requests cancelled before their prefill
            self.prefetched.popitem(last=False)

    def rows_for(self, prompts: Iterable[EncodedPrompt],
                 errors: dict[str, BaseException] | None = None) -> dict[str, torch.Tensor]:
        """{image hash: [num_tokens, hidden]} for every image of ``prompts``.

        With ``errors``, a remote encode that fails (a refused hand-off, no worker) is recorded
        there for each of its images instead of raised, so only the requests holding those
        images fail; without it, it raises."""
        found: dict[str, torch.Tensor] = {}
        todo: dict[str, ImageInput] = {}
        timings, needs = self.cache.timings, collections.defaultdict(list)  # needs: hash -> prompts to encode it for
        for prompt in prompts:
            fresh = timings.begin(prompt)
            for image in prompt.images:
                key = image.hash
                if key in todo:
                    needs[key].append(prompt)
                    continue
                if key in found:  # another prompt of this step took it from the cache
                    if fresh:
                        timings.note(prompt, cached=1)
                    continue
                cached = self.cache.get(key)
                if cached is not None:
                    if fresh:
                        timings.note(prompt, cached=1)
                    found[key] = cached
                elif key in self.prefetched:
                    timings.note(prompt, unknown=1)
                    future, index = self.prefetched.pop(key)
                    self.prefetch_hits += 1
                    try:
                        rows = future.result()[index].to(self.loaded.device, non_blocking=True)
                    except Exception as exc:
                        if errors is None:
                            raise
                        errors[key] = exc
                        continue
                    self.cache.put(key, rows)
                    found[key] = rows
                else:
                    todo[key] = image
                    needs[key].append(prompt)
        on_cuda = self.loaded.device.type == "cuda" and not self.remote
        for batch in self.batches(list(todo.values())):
            started, begin = time.perf_counter(), None
            if self.remote:  # verified rows from an encode worker, on the host
                try:
                    encoded = [rows.to(self.loaded.device, non_blocking=True) for rows in self.encode(batch)]
                except Exception as exc:
                    if errors is None:
                        raise
                    errors.update(dict.fromkeys((image.hash for image in batch), exc))
                    continue
            else:
                batch = self.to_device(batch)
                begin = self._record() if on_cuda else None
                encoded = self.run(batch)
            if begin is not None:
                self._gpu_timings.append((begin, self._record()))
                call = self._gpu_timings[-1]
            else:
                call = 1000 * (time.perf_counter() - started)
                if self.on_vision_seconds:
                    self.on_vision_seconds(call / 1000)
            for image in batch:
                for prompt in needs[image.hash]:
                    timings.note(prompt, call=call, encoded=1)
            for image, rows in zip(batch, encoded, strict=True):
                if rows.shape[0] != image.num_tokens:
                    raise PlaceholderMismatch(f"the vision stage returned {rows.shape[0]} rows for an image of "
                                              f"{image.num_tokens} tokens", status=500)
                self.cache.put(image.hash, rows)
                found[image.hash] = rows
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
