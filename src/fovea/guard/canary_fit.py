"""What the grounding canary needs of a server's limits, and the probe it adapts to them.

The canary asks about a drawn shape and reads the answer, so each of its requests needs the
prompt (the question and the image's tokens) plus some answer tokens within the server's
per-sequence limit (``--max-model-len``, or what the KV cache holds), and its images must
pass the server's own image limits (it sends them the way clients do). Under a small limit
it adapts: families whose image-token count follows the image's size get a smaller probe
image, and the answer it lets the model give shrinks down to one token (the token the
image-ablation check reads). Where even that cannot fit, start-up refuses with the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fovea.errors import FoveaError
from fovea.guard.probe_images import DEFAULT_CASES, PROBE_SIZE, CanaryCase, draw_case, png_bytes
from fovea.media.config import MediaConfig

if TYPE_CHECKING:  # torch and transformers: not for the checks a front runs before any model is loaded
    from fovea.models.base import EncodedPrompt, PromptCodec

ANSWER_TOKENS = 16  # what the canary lets the model say where the server's limit leaves room

PROBE_SIZES = (PROBE_SIZE, 192, 128, 96, 64, 48, 32)  # probe image sides, preferred first
# The probe images' encoded size moves by up to ~25% between the canary's runs (each nudges
# its shape by a few pixels; JPEG blocks fall differently): twice the first variant's is safe.
BYTES_MARGIN = 2


@dataclass(frozen=True)
class CanaryFit:
    size: int  # the probe images' side, pixels
    prompt_tokens: int  # the longest of the canary's prompts at that size
    image_tokens: int  # of those, the image's
    answer_tokens: int  # what the canary lets the model say

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens


class CanaryTooLong(FoveaError):
    """No probe fits the per-sequence limit; ``need`` is the smallest limit that does."""

    status, code, type = 500, "invalid_settings", "server_error"

    def __init__(self, limit: int, smallest: CanaryFit) -> None:
        self.limit, self.smallest, self.need = limit, smallest, smallest.prompt_tokens + 1
        super().__init__(f"the grounding canary needs {self.need} tokens per sequence (its prompt is "
                         f"{smallest.prompt_tokens} tokens, {smallest.image_tokens} of them its image's, and it "
                         f"reads at least one answer token), and this server holds {limit}")


class CanaryImagesRefused(FoveaError):
    """The server's image limits refuse even the smallest probe image."""

    status, code, type = 500, "invalid_settings", "server_error"

    def __init__(self, flag: str, value: int, minimum: int, what: str) -> None:
        self.flag, self.minimum = flag, minimum
        super().__init__(f"{flag} {value} refuses even the grounding canary's smallest probe image ({what}), which "
                         f"it sends the way clients send theirs; use {flag} {minimum} or more, or --no-canary")


def canary_prompt(codec: PromptCodec, case: CanaryCase, size: int) -> EncodedPrompt:
    """The canary's prompt for ``case`` with a probe image of ``size``, as its requests build it."""
    from fovea.loading.prompt import encode_prompt, render_chat

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": case.question}]}]
    return encode_prompt(codec, render_chat(codec, messages), [draw_case(case, size)])


def probe_bytes(size: int, cases: tuple[CanaryCase, ...] = DEFAULT_CASES) -> int:
    """A bound on the encoded probe images of this side (PNG, and the JPEG copy calibration sends)."""
    largest = max(max(len(png_bytes(draw_case(c, size))), len(png_bytes(draw_case(c, size), "JPEG", quality=90)))
                  for c in cases)
    return BYTES_MARGIN * largest


def media_refusal(size: int, media: MediaConfig,
                  cases: tuple[CanaryCase, ...] = DEFAULT_CASES) -> CanaryImagesRefused | None:
    """Why the server's image limits refuse the probe images of this side, or None."""
    if size * size > media.max_image_pixels:
        return CanaryImagesRefused("--max-image-pixels", media.max_image_pixels, size * size,
                                   f"{size}x{size} = {size * size:,} pixels")
    need = probe_bytes(size, cases)
    if need > media.max_image_bytes:
        return CanaryImagesRefused("--max-image-bytes", media.max_image_bytes, need, f"up to {need:,} bytes")
    return None


def fit_canary(codec: PromptCodec, media: MediaConfig, limit: int | None,
               cases: tuple[CanaryCase, ...] = DEFAULT_CASES) -> CanaryFit:
    """The probe that fits: the most answer tokens (up to ``ANSWER_TOKENS``), then the largest
    image. ``limit``: tokens per sequence (None: not known yet; only the image limits apply)."""
    refused: CanaryImagesRefused | None = None
    fits: list[CanaryFit] = []
    last_tokens: int | None = None
    for size in PROBE_SIZES:
        refused = media_refusal(size, media, cases)
        if refused is not None:
            continue
        prompts = [canary_prompt(codec, case, size) for case in cases]
        longest = max(prompts, key=lambda p: len(p.input_ids))
        tokens = len(longest.input_ids)
        if tokens == last_tokens:
            continue  # the processor gives this size the same token count: a smaller image does not help
        last_tokens = tokens
        room = ANSWER_TOKENS if limit is None else min(ANSWER_TOKENS, limit - tokens)
        fits.append(CanaryFit(size, tokens, sum(longest.image_token_counts), room))
        if room == ANSWER_TOKENS:
            break  # a smaller image cannot do better
    if not fits:
        assert refused is not None
        raise refused  # the smallest probe's refusal
    best = max(fits, key=lambda f: (f.answer_tokens, f.size))
    if best.answer_tokens < 1:
        assert limit is not None
        raise CanaryTooLong(limit, min(fits, key=lambda f: f.prompt_tokens))
    return best
