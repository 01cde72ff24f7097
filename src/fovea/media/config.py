"""Limits and permissions for turning client-supplied references into images.

Every knob that decides what a client may make the server read (files, hosts) or how much work
one image may cost (bytes, pixels, time) lives here, so the defaults are safe and visible in one
place: local files and remote fetches are both off until an operator names what is allowed.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from pathlib import Path

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class MediaConfig:
    max_image_bytes: int = 20 * MiB
    max_image_pixels: int = 40_000_000
    # Empty means ``file://`` references are refused outright.
    allowed_media_dirs: tuple[Path, ...] = ()
    # Exact host names (case-insensitive); empty means http(s) references are refused outright.
    allowed_media_domains: tuple[str, ...] = ()
    # Off by default so an allowlisted name that resolves to 10.x / 127.x cannot reach internal services.
    allow_private_addresses: bool = False
    fetch_timeout_s: float = 10.0
    # Transparent pixels are composited on this colour: models are trained on opaque RGB.
    background: tuple[int, int, int] = (255, 255, 255)
    store_max_bytes: int = 256 * MiB
    store_ttl_s: float = 3600.0
    # Images four times larger than the model's input are brought to about twice it before the
    # processor's resize (JPEG: decoded at a reduced scale). False: the processor sees every pixel.
    prereduce: bool = True
    # Decoding an image over large_image_pixels takes a share of large_decode_budget_bytes
    # (width x height x 4 bytes for each one in progress): large decodes wait for each other,
    # small ones never wait for them.
    large_image_pixels: int = 4_000_000
    large_decode_budget_bytes: int = 512 * MiB
    # Videos (models that take them): the encoded size, the frames sampled from one video (at
    # the model's fps; the model's token cost grows with it), its duration and each frame's pixels.
    max_video_bytes: int = 20 * MiB
    max_video_frames: int = 64
    max_video_seconds: float = 600.0
    max_video_frame_pixels: int = 1920 * 1080

    def __post_init__(self) -> None:
        _positive_int("max_image_bytes", self.max_image_bytes)
        _positive_int("max_image_pixels", self.max_image_pixels)
        _positive_int("store_max_bytes", self.store_max_bytes)
        if self.store_max_bytes < self.max_image_bytes:
            raise ValueError(
                f"store_max_bytes ({self.store_max_bytes}) must be at least max_image_bytes "
                f"({self.max_image_bytes}), otherwise an accepted image could never be stored."
            )
        _positive_int("large_image_pixels", self.large_image_pixels)
        _positive_int("large_decode_budget_bytes", self.large_decode_budget_bytes)
        _positive_number("fetch_timeout_s", self.fetch_timeout_s)
        _positive_int("max_video_bytes", self.max_video_bytes)
        _positive_int("max_video_frames", self.max_video_frames)
        _positive_number("max_video_seconds", self.max_video_seconds)
        _positive_int("max_video_frame_pixels", self.max_video_frame_pixels)
        _positive_number("store_ttl_s", self.store_ttl_s)
        if not isinstance(self.allow_private_addresses, bool):
            raise TypeError("allow_private_addresses must be True or False.")
        object.__setattr__(self, "allowed_media_dirs", _dirs(self.allowed_media_dirs))
        object.__setattr__(self, "allowed_media_domains", _domains(self.allowed_media_domains))
        object.__setattr__(self, "background", _colour(self.background))


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}.")


def _dirs(dirs: object) -> tuple[Path, ...]:
    if isinstance(dirs, (str, Path)):
        dirs = (dirs,)  # a lone path is an easy mistake; a str would otherwise split into letters
    out = []
    for d in dirs:  # type: ignore[union-attr]
        p = Path(d).expanduser()
        if not p.is_absolute():
            raise ValueError(f"allowed_media_dirs entries must be absolute paths, got {str(d)!r}.")
        out.append(p)
    return tuple(out)


def _domains(domains: object) -> tuple[str, ...]:
    if isinstance(domains, str):
        domains = (domains,)
    out = []
    for d in domains:  # type: ignore[union-attr]
        host = str(d).strip().lower().rstrip(".")
        if not host or (any(c in host for c in "/:@*? \t") and not _is_ipv6_literal(host)):
            raise ValueError(
                f"allowed_media_domains entries must be bare host names such as 'images.example.com' "
                f"(no scheme, port, path or wildcard), got {d!r}."
            )
        out.append(host.strip("[]"))
    return tuple(out)


def _is_ipv6_literal(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _colour(colour: object) -> tuple[int, int, int]:
    try:
        r, g, b = colour  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"background must be an (r, g, b) triple, got {colour!r}.") from None
    if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in (r, g, b)):
        raise ValueError(f"background components must be integers 0-255, got {colour!r}.")
    return (r, g, b)
