"""Untrusted video bytes in, sampled RGB frames out (PyAV), under ``MediaConfig``'s limits.

Frames are sampled as transformers' ``Qwen2VLVideoProcessor.sample_frames`` samples them (a model may
bring its own sampler: Qwen3-VL's, ``fovea.models.qwen3_vl.sample_indices``) at an
``fps``: ``total / source_fps * fps`` frames, at least ``min_frames``, at most the frame cap and the
video's own frame count, rounded down to a multiple of ``temporal_patch_size``, at the indices
``arange(0, total, total / n)``. A video shorter than one temporal patch keeps what it has (the
processor pads by repeating the last frame). The frame count comes from demuxing (no decode);
only the sampled frames are converted to RGB.

Every refusal is a ``FoveaError`` with a stable code (``invalid_video``, ``video_too_large``);
nothing from PyAV escapes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from fovea.errors import FoveaError
from fovea.media.config import MediaConfig


class InvalidVideo(FoveaError):
    """Not a video, corrupt, empty or undecodable."""

    status, code = 400, "invalid_video"


class VideoTooLarge(FoveaError):
    """Over a byte, duration or frame-size limit."""

    status, code = 400, "video_too_large"


@dataclass
class DecodedVideo:
    frames: list[Image.Image]  # the sampled frames, RGB, in order
    indices: list[int]  # their indices among the source's frames
    total_frames: int
    source_fps: float

    @property
    def sampled_fps(self) -> float:
        """transformers' ``VideoMetadata.sampled_fps``: frames kept per second of video."""
        return len(self.indices) / self.total_frames * self.source_fps


def sample_indices(total: int, source_fps: float, fps: float, max_frames: int, min_frames: int = 4,
                   temporal_patch_size: int = 2) -> list[int]:
    """The frame indices ``Qwen2VLVideoProcessor.sample_frames`` keeps (with ``fps``)."""
    if total <= 0:
        return []
    cap = math.floor(min(max_frames, total) / temporal_patch_size) * temporal_patch_size
    if cap == 0:  # fewer frames than one temporal patch: keep them all (padded later)
        return list(range(total))
    count = min(max(total / source_fps * fps, min_frames), cap, total)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    step = total / count
    # torch.arange(0, total, step).int(): float steps, truncated
    return [int(i * step) for i in range(count)]


def check_video_bytes(size: int, config: MediaConfig) -> None:
    if size > config.max_video_bytes:
        raise VideoTooLarge(f"The video is {size} bytes; this server accepts videos up to {config.max_video_bytes} "
                            "bytes (--max-video-bytes). Send a shorter or more compressed clip.")


_VIDEO_KINDS = "a data URL (data:video/mp4;base64,...), a file:// URL in an allowed directory or an http(s):// URL"


def load_video_bytes(ref: str, config: MediaConfig) -> bytes:
    """The referenced video's bytes, by the same source rules as images (data URLs, allowed
    ``file://`` directories, allowlisted hosts), under ``max_video_bytes``."""
    from dataclasses import replace

    from fovea.media.errors import ImageTooLarge, MalformedImage
    from fovea.media.inline import decode_base64
    from fovea.media.local_files import read_file_url
    from fovea.media.remote import fetch_url

    if not isinstance(ref, str) or not ref.strip():
        raise InvalidVideo(f"The video reference is empty; send {_VIDEO_KINDS}.")
    ref = ref.strip()
    # The image readers, with the video byte cap in place of the image one.
    limits = replace(config, max_image_bytes=config.max_video_bytes,
                     store_max_bytes=max(config.store_max_bytes, config.max_video_bytes))
    scheme = ref.partition(":")[0].lower() if ":" in ref[:16] else ""
    try:
        if scheme == "data":
            header, comma, payload = ref[len("data:"):].partition(",")
            params = [p.strip().lower() for p in header.split(";")]
            if not comma or "base64" not in params[1:]:
                raise InvalidVideo("The video data URL must look like data:video/mp4;base64,AAAA...")
            if params[0] not in ("", "application/octet-stream") and not params[0].startswith("video/"):
                raise InvalidVideo(f"The data URL declares the media type {params[0]!r}, which is not a video; "
                                   "send data:video/mp4;base64,... (images go in image_url parts).")
            return decode_base64(payload, limits, what="video data URL payload")
        if scheme == "file":
            return read_file_url(ref, limits)
        if scheme in ("http", "https"):
            return fetch_url(ref, limits)
    except ImageTooLarge:
        raise VideoTooLarge(f"The video is over {config.max_video_bytes} bytes, this server's limit "
                            "(--max-video-bytes); send a shorter or more compressed clip.") from None
    except MalformedImage as exc:
        raise InvalidVideo(exc.message.replace("image", "video")) from None
    raise InvalidVideo(f"The video reference is not {_VIDEO_KINDS}.")


Sampler = Callable[[int, float, float, int, int, int], list[int]]  # sample_indices' arguments


def decode_video_bytes(data: bytes, config: MediaConfig, fps: float, min_frames: int = 4,
                       temporal_patch_size: int = 2, max_frames: int | None = None,
                       sampler: Sampler | None = None) -> DecodedVideo:
    """The video's frames sampled at ``fps`` (at most ``max_frames``, by default
    ``config.max_video_frames``), RGB. ``sampler``: the model's own frame choice (Qwen3-VL's
    linspace), with ``sample_indices``' arguments; by default Qwen2-VL's."""
    max_frames = max_frames or config.max_video_frames
    sample = sampler or sample_indices
    import av  # imported here: only servers of video models need it at start-up

    check_video_bytes(len(data), config)
    if not data:
        raise InvalidVideo("The video is empty (0 bytes); send an MP4/WebM/MKV file's bytes.")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise InvalidVideo("The file has no video stream (audio only, or not a video); send a video file.")
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
            if width * height > config.max_video_frame_pixels:
                raise VideoTooLarge(f"The video's frames are {width}x{height} px; this server accepts frames up to "
                                    f"{config.max_video_frame_pixels} pixels (--max-video-frame-pixels). "
                                    "Scale the video down.")
            rate = stream.average_rate or stream.guessed_rate
            source_fps = float(rate) if rate else 0.0
            total = sum(1 for packet in container.demux(stream) if packet.size)
    except FoveaError:
        raise
    except Exception as exc:  # noqa: BLE001 - PyAV raises many kinds; none may escape as a 500
        raise InvalidVideo(f"The video could not be read ({type(exc).__name__}); it is not a video file fovea's "
                           "decoder (FFmpeg) understands, or it is corrupt or truncated.") from None
    if total == 0:
        raise InvalidVideo("The video has no frames; send a video with at least one frame.")
    if source_fps <= 0 or not math.isfinite(source_fps):
        raise InvalidVideo("The video states no frame rate; re-encode it with a constant frame rate.")
    seconds = total / source_fps
    if seconds > config.max_video_seconds:
        raise VideoTooLarge(f"The video is {seconds:.1f} s long; this server accepts videos up to "
                            f"{config.max_video_seconds:g} s (--max-video-seconds). Trim it.")
    wanted = sample(total, source_fps, fps, max_frames, min_frames, temporal_patch_size)
    frames: dict[int, Image.Image] = {}
    decoded = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            keep = set(wanted)
            for frame in container.decode(stream):
                if decoded in keep:
                    image = frame.to_image()
                    frames[decoded] = image if image.mode == "RGB" else image.convert("RGB")
                decoded += 1
                if decoded > wanted[-1]:
                    break
    except Exception as exc:  # noqa: BLE001
        if not frames:
            raise InvalidVideo(f"The video's frames could not be decoded ({type(exc).__name__}); it is corrupt or "
                               "in a codec this server's FFmpeg lacks. Re-encode it as H.264 MP4.") from None
    if not frames:
        raise InvalidVideo("None of the video's frames could be decoded; it is corrupt or truncated. "
                           "Re-encode it as H.264 MP4.")
    # Fewer decodable frames than packets (a truncated tail): sample what decoded, the same way.
    if len(frames) < len(wanted):
        total = decoded
        wanted = sample(total, source_fps, fps, max_frames, min_frames, temporal_patch_size)
        wanted = [i for i in wanted if i in frames] or [max(frames)]
    return DecodedVideo([frames[i] for i in wanted], wanted, total, source_fps)
