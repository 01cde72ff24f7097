"""MediaConfig: safe defaults, and bad settings refused at start-up with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from fovea.media import MediaConfig


def test_defaults_are_safe() -> None:
    config = MediaConfig()
    assert config.max_image_bytes == 20 * 1024 * 1024 and config.max_image_pixels == 40_000_000
    assert config.allowed_media_dirs == () and config.allowed_media_domains == ()
    assert config.allow_private_addresses is False
    assert config.store_max_bytes == 256 * 1024 * 1024 and config.store_ttl_s == 3600
    assert not hasattr(config, "__dict__")  # slotted


def test_normalisation() -> None:
    config = MediaConfig(allowed_media_dirs=("/srv/images",),
                         allowed_media_domains=(" Images.Example.COM. ",))
    assert config.allowed_media_dirs == (Path("/srv/images"),)
    assert config.allowed_media_domains == ("images.example.com",)
    assert MediaConfig(allowed_media_domains=("::1",)).allowed_media_domains == ("::1",)
    assert MediaConfig(allowed_media_dirs="/srv").allowed_media_dirs == (Path("/srv"),)


def test_non_bool_private_flag_is_refused() -> None:
    with pytest.raises(TypeError, match="True or False"):
        MediaConfig(allow_private_addresses="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_image_bytes": 0}, "max_image_bytes"),
    ({"max_image_pixels": -1}, "max_image_pixels"),
    ({"max_image_bytes": 1.5}, "max_image_bytes"),
    ({"store_max_bytes": 10, "max_image_bytes": 100}, "store_max_bytes"),
    ({"fetch_timeout_s": 0}, "fetch_timeout_s"),
    ({"fetch_timeout_s": float("inf")}, "fetch_timeout_s"),
    ({"store_ttl_s": -5}, "store_ttl_s"),
    ({"allowed_media_dirs": ("relative/dir",)}, "absolute"),
    ({"allowed_media_domains": ("https://example.com",)}, "bare host"),
    ({"allowed_media_domains": ("*.example.com",)}, "wildcard"),
    ({"allowed_media_domains": ("example.com:8080",)}, "port"),
    ({"allowed_media_domains": ("",)}, "bare host"),
    ({"background": (256, 0, 0)}, "0-255"),
    ({"background": (0, 0)}, "triple"),
])
def test_invalid_settings_are_refused(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        MediaConfig(**kwargs)
