"""The grounding canary: known images through the real serving path, answers must depend on them.

Each reference image is one large shape of a known colour, drawn in code. For each, the
canary (a) asks what colour the shape is and requires the colour word in the answer, and
(b) compares the first-token distribution given the image with the one given a blank
canvas of the same size: if their KL divergence is not above a threshold, the model is
ignoring the image. Every run draws slightly moved variants, so neither the encoder cache
nor the prefix cache can answer for the model. The threshold is calibrated at start-up from the KL between an image
and a re-encoded copy of itself (what "the same picture" looks like to this model), with a
floor so that a model that ignores everything cannot calibrate itself into passing.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import torch
from PIL import Image, ImageDraw

from fovea.engine.paged.engine import PagedEngine
from fovea.engine.request import ErrorEvent, FinishEvent
from fovea.engine.sampling import SamplingParams
from fovea.media import decode_image_bytes
from fovea.media.config import MediaConfig
from fovea.model.loader import LoadedModel
from fovea.model.prompt import EncodedPrompt, encode_prompt, render_chat

KL_FLOOR = 0.05  # nats; below this an answer does not depend on the image in any useful way


@dataclass(frozen=True)
class CanaryCase:
    colour: str
    rgb: tuple[int, int, int]
    shape: str

    @property
    def question(self) -> str:
        return f"What color is the {self.shape}?"


DEFAULT_CASES = (
    CanaryCase("red", (220, 30, 30), "circle"),
    CanaryCase("blue", (30, 70, 220), "square"),
    CanaryCase("green", (30, 160, 50), "triangle"),
)


def draw_case(case: CanaryCase, size: int = 256, variant: int = 0) -> Image.Image:
    """The reference image; ``variant`` nudges the shape by a few pixels so that every canary
    run sends pixels no cache has seen (the encoder cache and the prefix cache key on them)."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    rng = random.Random(variant)
    dx, dy = (rng.randint(-size // 32, size // 32) for _ in range(2))
    lo, hi = size * 0.3, size * 0.7
    if case.shape == "circle":
        draw.ellipse((lo + dx, lo + dy, hi + dx, hi + dy), fill=case.rgb)
    elif case.shape == "square":
        draw.rectangle((lo + dx, lo + dy, hi + dx, hi + dy), fill=case.rgb)
    else:
        draw.polygon([(size / 2 + dx, lo + dy), (hi + dx, hi + dy), (lo + dx, hi + dy)], fill=case.rgb)
    return image


def draw_blank(size: tuple[int, int], variant: int = 0) -> Image.Image:
    """A white canvas with one barely-off-white pixel placed by ``variant`` (again: never cached)."""
    image = Image.new("RGB", size, (255, 255, 255))
    rng = random.Random(variant)
    image.putpixel((rng.randrange(size[0]), rng.randrange(size[1])), (250, 250, 250))
    return image


def png_bytes(image: Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def kl_divergence(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """KL(p || q) in nats from two log-probability vectors."""
    p_log, q_log = p_log.double(), q_log.double()
    return float((p_log.exp() * (p_log - q_log)).sum().clamp(min=0.0))


@dataclass
class CaseResult:
    colour: str
    answer: str
    has_keyword: bool
    ablation_kl: float


@dataclass
class CanaryResult:
    ok: bool
    reasons: list[str]
    threshold: float
    min_ablation_kl: float
    cases: list[CaseResult]
    checked_at: float = field(default_factory=time.time)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class Canary:
    def __init__(self, loaded: LoadedModel, engine: PagedEngine, cases: tuple[CanaryCase, ...] = DEFAULT_CASES,
                 media: MediaConfig | None = None, floor: float = KL_FLOOR,
                 prompts: Callable[..., Awaitable[tuple[EncodedPrompt, EncodedPrompt | None]]] | None = None) -> None:
        """``prompts``: the server's preprocessor (``Preprocessor.prompts``), so the canary's images take
        the path requests' images take; without it they are decoded and encoded in a thread here."""
        self.loaded = loaded
        self.prompts = prompts
        self.engine = engine
        self.cases = cases
        self.media = media or MediaConfig()
        self.floor = floor
        self.threshold: float | None = None
        self.last: CanaryResult | None = None
        self._variants = itertools.count(1)

    async def _first_logprobs(self, image_bytes: bytes, question: str, max_tokens: int) -> tuple[str, torch.Tensor]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = render_chat(self.loaded, messages)
        if self.prompts is not None:
            prompt, _ = await self.prompts(text, [(image_bytes, "canary")])
        else:
            image = await asyncio.to_thread(decode_image_bytes, image_bytes, self.media)  # the serving decoder
            prompt = await asyncio.to_thread(encode_prompt, self.loaded, text, [image])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        async for event in self.engine.generate(prompt, params, want_first_logprobs=True):
            if isinstance(event, FinishEvent):
                assert event.first_logprobs is not None
                return event.text, event.first_logprobs
            if isinstance(event, ErrorEvent):
                raise event.error
        raise RuntimeError("the engine ended the canary request without finishing it")

    async def calibrate(self) -> float:
        """KL between each reference image and a JPEG re-encoding of it: the model's noise floor."""
        noise = 0.0
        for case in self.cases:
            image = draw_case(case, variant=next(self._variants))
            _, p = await self._first_logprobs(png_bytes(image), case.question, 1)
            _, q = await self._first_logprobs(png_bytes(image, "JPEG", quality=90), case.question, 1)
            noise = max(noise, kl_divergence(p, q))
        self.threshold = max(self.floor, 5.0 * noise)
        return self.threshold

    async def run(self) -> CanaryResult:
        started = time.perf_counter()
        if self.threshold is None:
            await self.calibrate()
        threshold = self.threshold or self.floor
        results: list[CaseResult] = []
        reasons: list[str] = []
        for case in self.cases:
            image = draw_case(case, variant=next(self._variants))
            answer, p = await self._first_logprobs(png_bytes(image), case.question, 16)
            blank = draw_blank(image.size, variant=next(self._variants))
            _, q = await self._first_logprobs(png_bytes(blank), case.question, 1)
            kl = kl_divergence(p, q)
            hit = case.colour in answer.lower().replace(",", " ").replace(".", " ").split()
            results.append(CaseResult(case.colour, answer, hit, kl))
            if not hit:
                reasons.append(f"canary: asked {case.question!r} about a {case.colour} {case.shape}, "
                               f"got {answer!r} (no {case.colour!r})")
            if not kl > threshold:
                reasons.append(f"canary: image ignored: the answer to {case.question!r} is the same with a blank "
                               f"image (ablation KL {kl:.4f} <= threshold {threshold:.4f} nats)")
        min_kl = min((r.ablation_kl for r in results), default=math.nan)
        self.last = CanaryResult(not reasons, reasons, threshold, min_kl, results,
                                 seconds=time.perf_counter() - started)
        return self.last
