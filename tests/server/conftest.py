"""Fixtures for the HTTP-level server tests: live servers with special settings and error checks.

Servers are started with ``scene_helpers.start_server`` on loopback and share the session's loaded
demo model; every one started here is stopped when the session ends.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import httpx
import pytest
from scene_helpers import TEST_DEVICE, LiveServer, free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.media import MediaConfig

ERROR_KEYS = {"message", "type", "param", "code"}
ANY = "<any>"  # pass as param to skip checking it (test modules cannot import this one)


@pytest.fixture(autouse=True)
def _quiet_pil_warnings() -> Iterator[None]:
    # PIL warns (UserWarning) about the corrupt EXIF/TIFF data some tests send on purpose.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture(scope="session")
def make_server(demo_model) -> Iterator[Callable[..., LiveServer]]:
    """``make_server(media=MediaConfig(...), **ServerSettings fields)`` -> a started LiveServer."""
    running = []

    def make(media: MediaConfig | None = None, **fields) -> LiveServer:
        settings = ServerSettings(host="127.0.0.1", port=free_port(), device=TEST_DEVICE, dtype="float32",
                                  canary=False, media=media or MediaConfig(), **fields)
        live, server, thread = start_server(settings, demo_model)
        running.append((server, thread))
        return live

    yield make
    for server, thread in running:
        stop_server(server, thread)


def check_error(response: httpx.Response, status: int, code: str, param=ANY) -> dict:
    """The response is an OpenAI-style error with this status, code and (unless ANY) param."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] == code, error
    if param != ANY:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="session")
def assert_error() -> Callable[..., dict]:
    return check_error
