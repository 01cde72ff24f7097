"""Shared fixtures: the shipped demo model, loaded once, and a live fovea server on loopback."""

from __future__ import annotations

import base64
import io
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from PIL import Image

from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def demo_model() -> LoadedModel:
    return load_model(None, device="cpu", dtype="float32")


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def fresh_scene(seed: int, **sampler_kwargs) -> scenes.Scene:
    """A scene no test has fixed in advance: drawn from an unseeded-looking but reproducible seed."""
    return scenes.SceneSampler(**sampler_kwargs).sample(random.Random(10_000_019 + seed))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    app: object
    settings: ServerSettings


def start_server(settings: ServerSettings, loaded: LoadedModel) -> tuple[LiveServer, uvicorn.Server, threading.Thread]:
    from fovea.serve.app import create_app

    app = create_app(settings, loaded=loaded)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fovea test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://{settings.host}:{settings.port}", app, settings), server, thread


@pytest.fixture(scope="session")
def live_server(demo_model: LoadedModel) -> Iterator[LiveServer]:
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32")
    live, server, thread = start_server(settings, demo_model)
    yield live
    server.should_exit = True
    thread.join(timeout=30)
