"""Deterministic probe images: what the contract sends through a model's vision stage at load.

Plain PIL drawings (a few coloured shapes on a textured background), so that checking a model
needs nothing from the demo package and no file on disk.
"""

from __future__ import annotations

import random

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
