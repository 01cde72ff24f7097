"""Video decoding with PyAV: Qwen's frame sampling, the frame cap, and every refusal's code."""

from __future__ import annotations

import base64

import pytest

from fovea.media import MediaConfig
from fovea.media.video import (
    InvalidVideo,
    VideoTooLarge,
    decode_video_bytes,
    load_video_bytes,
    sample_indices,
)
from fovea.testing.videos import make_mp4

RGB = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]


def reference_indices(total: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    # transformers' Qwen2VLVideoProcessor.sample_frames (min_frames 4, temporal_patch_size 2), verbatim arithmetic
    import math

    import torch
    cap = math.floor(min(max_frames, total) / 2) * 2
    n = min(max(total / source_fps * fps, 4), cap, total)
    n = math.floor(n / 2) * 2
    return torch.arange(0, total, total / n).int().tolist()


@pytest.mark.parametrize("total,source_fps,fps,cap", [(12, 4, 2, 64), (300, 30, 2, 64), (301, 29.97, 2, 16),
                                                      (5, 25, 2, 64), (1000, 24, 2.0, 768), (7, 7, 1, 64)])
def test_sampling_is_qwens(total, source_fps, fps, cap):
    assert sample_indices(total, source_fps, fps, cap) == reference_indices(total, source_fps, fps, cap)


def test_a_short_video_keeps_its_frames():
    assert sample_indices(1, 4, 2, 64) == [0]


def test_frames_are_sampled_at_the_fps_and_decoded_rgb():
    video = decode_video_bytes(make_mp4(RGB * 4, fps=4), MediaConfig(), fps=2.0)
    assert video.indices == [0, 2, 4, 6, 8, 10] and video.total_frames == 12 and video.sampled_fps == 2.0
    for frame, index in zip(video.frames, video.indices):
        assert frame.mode == "RGB" and frame.size == (64, 48)
        pixel = frame.getpixel((10, 10))
        assert max(range(3), key=lambda c: pixel[c]) == index % 3  # its own colour


def test_the_frame_cap_holds():
    video = decode_video_bytes(make_mp4(RGB * 10, fps=2), MediaConfig(max_video_frames=8), fps=2.0)
    assert len(video.frames) == 8


@pytest.mark.parametrize("data", [b"", b"not a video at all" * 10, None])
def test_garbage_is_invalid_video(data):
    if data is None:
        data = make_mp4(RGB * 4)[:300]  # truncated
    with pytest.raises(InvalidVideo) as info:
        decode_video_bytes(data, MediaConfig(), fps=2.0)
    assert info.value.code == "invalid_video" and info.value.status == 400


def test_limits_are_video_too_large():
    data = make_mp4(RGB * 4, fps=4)
    with pytest.raises(VideoTooLarge) as info:
        decode_video_bytes(data, MediaConfig(max_video_bytes=100), fps=2.0)
    assert info.value.code == "video_too_large" and "--max-video-bytes" in info.value.message
    with pytest.raises(VideoTooLarge, match="max-video-seconds"):
        decode_video_bytes(data, MediaConfig(max_video_seconds=1.0), fps=2.0)
    with pytest.raises(VideoTooLarge, match="max-video-frame-pixels"):
        decode_video_bytes(data, MediaConfig(max_video_frame_pixels=1000), fps=2.0)


def test_sources_data_urls_and_allowed_files(tmp_path):
    data = make_mp4(RGB * 2)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    assert load_video_bytes(url, MediaConfig()) == data
    with pytest.raises(InvalidVideo, match="not a video"):
        load_video_bytes("data:image/png;base64," + base64.b64encode(data).decode(), MediaConfig())
    with pytest.raises(VideoTooLarge):
        load_video_bytes(url, MediaConfig(max_video_bytes=100))
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    assert load_video_bytes(path.as_uri(), MediaConfig(allowed_media_dirs=(tmp_path,))) == data
    with pytest.raises(Exception) as info:
        load_video_bytes(path.as_uri(), MediaConfig())
    assert info.value.code == "media_source_forbidden"
    with pytest.raises(InvalidVideo):
        load_video_bytes("ftp://x/y.mp4", MediaConfig())
