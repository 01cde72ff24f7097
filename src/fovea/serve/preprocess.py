"""Image bytes and prompt text in, an ``EncodedPrompt`` out, off the event loop.

Decoding an image and running the model's processor on it cost milliseconds of CPU per
request. By default (``workers`` = 0) that runs in this process's threads, where part of it
holds the GIL that the event loop and the engine's worker thread need too. With ``workers`` >
0 it runs in that many worker processes instead. Each holds a copy of the model's processor,
overrides included, and proves it with the recipe fingerprint of every answer. On the H200
machine the threads were much faster (245 requests/s against 6 for seven workers,
docs/benchmarks.md), so they are the default.

Large images take a lane of their own: an image over ``large_image_pixels`` waits for a share
of ``large_decode_budget_bytes`` (its pixels x ``DECODE_BYTES_PER_PIXEL``) and for one of the
workers that large decodes may use, never all of them, so small requests never queue behind
large ones and the memory that decodes take together is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import multiprocessing
import pickle
import time
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch
from PIL import Image

from fovea.disagg.parent_watch import exit_with_parent
from fovea.errors import FoveaError
from fovea.loading.contract import fingerprint, recipe_of
from fovea.media import MediaConfig, decode_image_bytes
from fovea.media.video import DecodedVideo, decode_video_bytes
from fovea.models.base import DEFAULT_OPTIONS, EncodedPrompt, EncodeOptions, PromptCodec

log = logging.getLogger("fovea.serve")

# Peak bytes per pixel of decoding a large image: a PNG decoded as RGBA (4), its RGB
# conversion (3) and the transposed or composited copies beside them.
DECODE_BYTES_PER_PIXEL = 10
SLOW_S = 1.0  # a prompt that takes longer than this to prepare is logged


class PreprocessingFailed(FoveaError):
    status, code, type = 500, "preprocessing_failed", "server_error"


def codec_fingerprint(codec: PromptCodec, fields: tuple[str, ...]) -> str:
    return fingerprint(recipe_of(codec.image_processor, fields))


def decode_videos(model: PromptCodec, media: MediaConfig, videos: list[tuple[bytes, str]]) -> list[DecodedVideo]:
    """Each video's frames, sampled at the model's fps under the frame cap (refusals name ``where``)."""
    recipe = getattr(model, "video", None)
    if recipe is None:
        raise FoveaError("this model takes no video input; send frames as image_url parts.",
                         code="videos_not_supported")
    out = []
    for data, where in videos:
        try:
            out.append(decode_video_bytes(data, media, recipe.fps, recipe.min_frames, recipe.temporal_patch_size,
                                          max_frames=min(media.max_video_frames, recipe.max_frames),
                                          sampler=getattr(recipe, "sample_indices", None)))
        except FoveaError as exc:
            exc.param = where
            raise
    return out


def build_prompts(model: PromptCodec, media: MediaConfig, reduce_to: int | None, text: str,
                  images: list[tuple[bytes, str]], template_rendered: bool,
                  blank_twin: bool, videos: list[tuple[bytes, str]] = (),
                  options: EncodeOptions = DEFAULT_OPTIONS) -> tuple[EncodedPrompt, EncodedPrompt | None]:
    """Decode each image and video (a refusal names ``where``, its request path) and encode the
    prompt, and with ``blank_twin`` the same prompt with blank images and videos (both with the
    request's ``options``)."""
    decoded = []
    for data, where in images:
        try:
            decoded.append(decode_image_bytes(data, media, reduce_to))
        except FoveaError as exc:
            exc.param = where
            raise
    clips = decode_videos(model, media, list(videos)) if videos else []
    extra = {"videos": clips} if clips else {}
    prompt = model.encode(text, decoded, template_rendered=template_rendered, options=options, **extra)
    twin = None
    if blank_twin and (decoded or clips):
        blanks = [Image.new("RGB", im.size, (255, 255, 255)) for im in decoded]
        if clips:
            extra = {"videos": [DecodedVideo([Image.new("RGB", f.size, (255, 255, 255)) for f in c.frames],
                                             c.indices, c.total_frames, c.source_fps) for c in clips]}
        twin = model.encode(text, blanks, template_rendered=template_rendered, options=options, **extra)
    return prompt, twin


# ---- worker processes -----------------------------------------------------------------
# The worker's processor, media limits, target size and its recipe's fingerprint (read once:
# the processor does not change after start-up, and every answer carries it).
_WORKER: tuple[PromptCodec, MediaConfig, int | None, str] | None = None


def _init_worker(codec: bytes, recipe_fields: tuple[str, ...], media: MediaConfig, reduce_to: int | None) -> None:
    global _WORKER
    exit_with_parent()  # a server killed with SIGKILL leaves no preprocessing worker behind
    torch.set_num_threads(1)  # one core per worker: the pool is the parallelism
    model = pickle.loads(codec)
    _WORKER = (model, media, reduce_to, codec_fingerprint(model, recipe_fields))


def _work(text: str, images: list[tuple[bytes, str]], template_rendered: bool, blank_twin: bool,
          videos: list[tuple[bytes, str]] = (), options: EncodeOptions = DEFAULT_OPTIONS):
    assert _WORKER is not None, "worker not initialised"
    model, media, reduce_to, recipe = _WORKER
    return (*build_prompts(model, media, reduce_to, text, images, template_rendered, blank_twin, videos, options),
            recipe)


def _ping() -> str:
    assert _WORKER is not None
    return _WORKER[3]


# ---- the large-image lane ----------------------------------------------------------------
class DecodeBudget:
    """Bytes that large decodes may hold together, and how many may run at once (per event loop)."""

    def __init__(self, total_bytes: int, concurrency: int) -> None:
        self.total = total_bytes
        self.concurrency = max(1, concurrency)
        self._state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.in_use = 0
        self.running = 0
        self.peak_running = 0

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        cond = self._state.get(loop)
        if cond is None:
            cond = self._state[loop] = asyncio.Condition()
        return cond

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        nbytes = min(nbytes, self.total)  # one image larger than the budget runs alone
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self.in_use + nbytes <= self.total and self.running < self.concurrency)
            self.in_use += nbytes
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        try:
            yield
        finally:
            async with cond:
                self.in_use -= nbytes
                self.running -= 1
                cond.notify_all()


def header_pixels(data: bytes) -> int:
    """Width x height from the image's header alone (0 when the header cannot be read: the
    decoder will say why)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size[0] * im.size[1]
    except Exception:  # noqa: BLE001 - any failure: let decode_image_bytes refuse it properly
        return 0


class Preprocessor:
    def __init__(self, loaded: Any, media: MediaConfig, workers: int, recipe_fingerprint: str,
                 observe: Callable[[float], None] | None = None) -> None:
        self.model: PromptCodec = loaded.codec
        self.observe = observe  # given the seconds of each prompt prepared (fovea_request_prepare_seconds)
        self.media = media
        self.reduce_to = loaded.codec.target_short_side()
        self.fingerprint = recipe_fingerprint
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None
        self._initargs = (pickle.dumps(loaded.codec), loaded.adapter.recipe_fields, media, self.reduce_to)
        if workers > 0:
            self._start_pool()
            log.info("preprocessing in %d worker processes", workers)
        # Large decodes may use all workers but one (all threads but a few in thread mode).
        self.large = DecodeBudget(media.large_decode_budget_bytes, workers - 1 if workers > 1 else 2)

    def _start_pool(self) -> None:
        self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_init_worker, initargs=self._initargs)
        # Start every worker now and check it runs the contract's recipe, not at the first request.
        answers = {f.result() for f in [self.pool.submit(_ping) for _ in range(self.workers)]}
        if answers != {self.fingerprint}:
            self.close()
            raise PreprocessingFailed(f"preprocessing workers run the recipe(s) {sorted(answers)}, not the "
                                      f"model contract's {self.fingerprint}; refusing to start")

    async def prompts(self, text: str, images: list[tuple[bytes, str]], *, template_rendered: bool = True,
                      blank_twin: bool = False, videos: list[tuple[bytes, str]] = (),
                      options: EncodeOptions = DEFAULT_OPTIONS) -> tuple[EncodedPrompt, EncodedPrompt | None]:
        """The prompt (and with ``blank_twin`` its twin with blank images); ``options``: the
        request's add_special_tokens and per-image detail."""
        large = sum(p for p in (header_pixels(data) for data, _ in images) if p > self.media.large_image_pixels)
        # A video's decoded frames: at most max_video_frames of max_video_frame_pixels each, RGB.
        large += len(videos) * self.media.max_video_frames * self.media.max_video_frame_pixels * 3 \
            // DECODE_BYTES_PER_PIXEL
        if large:
            async with self.large.hold(large * DECODE_BYTES_PER_PIXEL):
                return await self._run(text, images, template_rendered, blank_twin, videos, options)
        return await self._run(text, images, template_rendered, blank_twin, videos, options)

    async def _run(self, text: str, images: list[tuple[bytes, str]], template_rendered: bool,
                   blank_twin: bool, videos: list[tuple[bytes, str]] = (),
                   options: EncodeOptions = DEFAULT_OPTIONS) -> tuple[EncodedPrompt, EncodedPrompt | None]:
        started = time.perf_counter()
        try:
            built = await self._build(text, images, template_rendered, blank_twin, videos, options)
        finally:
            seconds = time.perf_counter() - started
            if seconds > SLOW_S:
                log.warning("preparing a request's prompt (%d image(s)) took %.2f s", len(images), seconds)
        if self.observe is not None:
            self.observe(seconds)
        return built

    async def _build(self, text: str, images: list[tuple[bytes, str]], template_rendered: bool,
                     blank_twin: bool, videos: list[tuple[bytes, str]] = (),
                     options: EncodeOptions = DEFAULT_OPTIONS) -> tuple[EncodedPrompt, EncodedPrompt | None]:
        if self.pool is None:  # this process's own processor: the contract checked it at start-up
            return await asyncio.to_thread(build_prompts, self.model, self.media, self.reduce_to, text, images,
                                           template_rendered, blank_twin, videos, options)
        loop = asyncio.get_running_loop()
        try:
            prompt, twin, recipe = await loop.run_in_executor(self.pool, _work, text, images, template_rendered,
                                                              blank_twin, videos, options)
        except BrokenProcessPool:
            # A worker died (killed for memory, say): this request fails loudly, the next gets new workers.
            log.exception("a preprocessing worker died; starting new ones")
            self.close()
            await asyncio.to_thread(self._start_pool)
            raise PreprocessingFailed("a preprocessing worker died while preparing this request's images; "
                                      "retry it") from None
        if recipe != self.fingerprint:  # what crosses a boundary carries its contract
            raise PreprocessingFailed(f"the image was preprocessed with recipe {recipe}, not the model contract's "
                                      f"{self.fingerprint}; the request was not run")
        return prompt, twin

    def close(self, wait: bool = False) -> None:
        """Stop the workers; ``wait``: until they have exited (at shutdown: the process may end by
        the signal that stopped it, without the executor's exit handler sending them away)."""
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
            self.pool = None
