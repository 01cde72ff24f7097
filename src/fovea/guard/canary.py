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
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import torch

from fovea.engine.core.request import ErrorEvent, FinishEvent
from fovea.engine.engine import PagedEngine
from fovea.engine.sampling.params import SamplingParams
from fovea.guard.canary_fit import ANSWER_TOKENS

# The drawings live beside the contract's probe image (no torch there: start-up checks use them).
from fovea.guard.probe_images import (  # noqa: F401  (CanaryCase and PROBE_SIZE: imported from here too)
    DEFAULT_CASES,
    PROBE_SIZE,
    CanaryCase,
    draw_blank,
    draw_case,
    png_bytes,
)
from fovea.loading.loader import LoadedModel
from fovea.loading.prompt import EncodedPrompt, encode_prompt, render_chat
from fovea.media import decode_image_bytes
from fovea.media.config import MediaConfig

KL_FLOOR = 0.05  # nats; below this an answer does not depend on the image in any useful way


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
    probe_size: int = PROBE_SIZE  # the probe images' side, and the answer tokens allowed (fitted to the limits)
    answer_tokens: int = ANSWER_TOKENS

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
        # The probe image's side and the answer tokens allowed: fitted to the server's limits
        # (guard/canary_fit.py) by ``adapt``; these are what the canary asks for given room.
        self.probe_size = PROBE_SIZE
        self.answer_tokens = ANSWER_TOKENS

    def adapt(self, size: int, answer_tokens: int) -> None:
        """Use probe images of ``size`` pixels a side and answers of at most ``answer_tokens``
        (the fit to a small per-sequence limit or small image limits)."""
        self.probe_size, self.answer_tokens = size, answer_tokens

    async def _first_logprobs(self, image_bytes: bytes, question: str,
                              max_tokens: int) -> tuple[str, torch.Tensor, str]:
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
                return event.text, event.first_logprobs, event.finish_reason
            if isinstance(event, ErrorEvent):
                raise event.error
        raise RuntimeError("the engine ended the canary request without finishing it")

    async def calibrate(self) -> float:
        """KL between each reference image and a JPEG re-encoding of it: the model's noise floor."""
        noise = 0.0
        for case in self.cases:
            image = draw_case(case, self.probe_size, variant=next(self._variants))
            _, p, _ = await self._first_logprobs(png_bytes(image), case.question, 1)
            _, q, _ = await self._first_logprobs(png_bytes(image, "JPEG", quality=90), case.question, 1)
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
            image = draw_case(case, self.probe_size, variant=next(self._variants))
            answer, p, finish = await self._first_logprobs(png_bytes(image), case.question, self.answer_tokens)
            blank = draw_blank(image.size, variant=next(self._variants))
            _, q, _ = await self._first_logprobs(png_bytes(blank), case.question, 1)
            kl = kl_divergence(p, q)
            hit = case.colour in answer.lower().replace(",", " ").replace(".", " ").split()
            results.append(CaseResult(case.colour, answer, hit, kl))
            if not hit:
                cut = (f"; the answer was cut at {self.answer_tokens} token(s) to fit the server's per-sequence "
                       "limit: raise --max-model-len or --kv-cache-memory"
                       if finish == "length" and self.answer_tokens < ANSWER_TOKENS else "")
                reasons.append(f"canary: asked {case.question!r} about a {case.colour} {case.shape}, "
                               f"got {answer!r} (no {case.colour!r}{cut})")
            if not kl > threshold:
                reasons.append(f"canary: image ignored: the answer to {case.question!r} is the same with a blank "
                               f"image (ablation KL {kl:.4f} <= threshold {threshold:.4f} nats)")
        min_kl = min((r.ablation_kl for r in results), default=math.nan)
        self.last = CanaryResult(not reasons, reasons, threshold, min_kl, results,
                                 seconds=time.perf_counter() - started, probe_size=self.probe_size,
                                 answer_tokens=self.answer_tokens)
        return self.last
