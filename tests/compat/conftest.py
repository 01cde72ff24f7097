"""A live fovea server on a tiny random Qwen2.5-VL with a byte-level tokenizer and a tool template."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from scene_helpers import LiveServer, free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.model.loader import LoadedModel, load_model
from fovea.testing.byte_level_model import write_model_dir


@pytest.fixture(scope="session")
def byte_model(tmp_path_factory) -> LoadedModel:
    return load_model(write_model_dir(tmp_path_factory.mktemp("byte-qwen")), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def byte_server(byte_model: LoadedModel) -> Iterator[LiveServer]:
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False)
    live, server, thread = start_server(settings, byte_model)
    yield live
    stop_server(server, thread)
