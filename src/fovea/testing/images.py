"""Images for memory and load tests."""

from __future__ import annotations

import io

from PIL import Image, ImageDraw


def flat_png(side: int) -> bytes:
    """A ``side``×``side`` PNG that is mostly one colour: a small file that decodes to a big image."""
    image = Image.new("RGB", (side, side), (250, 250, 250))
    ImageDraw.Draw(image).ellipse((side // 4, side // 4, side // 2, side // 2), fill=(220, 30, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
