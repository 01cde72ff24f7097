"""Helpers shared by the top-level tests: drawn scenes, data URLs and a live server on loopback."""

from __future__ import annotations

import base64
import io
import random
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from PIL import Image

from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.model.loader import LoadedModel


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def fresh_scene(seed: int, **sampler_kwargs) -> scenes.Scene:
    """A scene from a seed range no training or evaluation run uses."""
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
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fovea test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://{settings.host}:{settings.port}", app, settings), server, thread


def stop_server(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=30)
