"""Small test videos made with PyAV: solid-colour frames encoded as MP4 (H.264, or MPEG-4 Part 2
where this FFmpeg lacks an H.264 encoder)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def make_mp4(colours: list[tuple[int, int, int]], width: int = 64, height: int = 48, fps: int = 4) -> bytes:
    """An MP4 of one frame per colour, ``fps`` frames per second."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        for index, colour in enumerate(colours):
            pixels = np.empty((height, width, 3), dtype=np.uint8)
            pixels[:] = colour
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()
