"""Deterministic probe images: what the contract sends through a model's vision stage at load,
and the grounding canary's shapes (``draw_case``) and blank canvases.

Plain PIL drawings (coloured shapes on a plain or textured background), so that checking a
model needs nothing from the demo package and no file on disk, and no torch.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw


def probe_image(width: int = 256, height: int = 256, seed: int = 4242) -> Image.Image:
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(180, 256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(8, max(9, width // 2)), y0 + rng.randrange(8, max(9, height // 2))
        colour = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
    return image


PROBE_SIZE = 256  # the probe images' side where the server's limits allow it


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


def draw_case(case: CanaryCase, size: int = PROBE_SIZE, variant: int = 0) -> Image.Image:
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
