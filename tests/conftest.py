"""Shared fixtures: the shipped demo model, loaded once, and a live fovea server on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from scene_helpers import TEST_DEVICE, LiveServer, free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.loading.loader import LoadedModel, load_model
from fovea.testing.quiet_logs import logging_left_as_found  # noqa: F401 (autouse: see its module)


@pytest.fixture(scope="session")
def demo_model() -> LoadedModel:
    return load_model(None, device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="session")
def live_server(demo_model: LoadedModel) -> Iterator[LiveServer]:
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device=TEST_DEVICE, dtype="float32",
                              canary_interval_s=0)
    live, server, thread = start_server(settings, demo_model)
    yield live
    stop_server(server, thread)
