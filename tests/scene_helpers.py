"""Helpers shared by the top-level tests: drawn scenes, data URLs and a live server on loopback."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import http.server
import io
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from PIL import Image

from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.engine.core.request import FinishEvent, TokenEvent
from fovea.loading.loader import LoadedModel

# Where the shared demo model and the servers built on it run: CPU in CI; FOVEA_TEST_DEVICE=cuda
# runs the same HTTP tests on a GPU (the lead's GPU runs use it for the client-compatibility suite).
TEST_DEVICE = os.environ.get("FOVEA_TEST_DEVICE", "cpu")


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
    from fovea.serve.http_protocol import uvicorn_options

    app = create_app(settings, loaded=loaded)
    # log_config=None, as the CLI runs it: uvicorn's records propagate to pytest's capture (caplog)
    # instead of to a stream handler of uvicorn's own.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", log_config=None,
                            **uvicorn_options())
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


async def collect(engine, prompt, params, **kw):
    tokens, finish = [], None
    async for event in engine.generate(prompt, params, **kw):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            finish = event
        else:
            raise AssertionError(f"unexpected event {event!r}")
    return tokens, finish


def run_all(engine, jobs):
    """Start ``engine``, run (prompt, params) jobs concurrently, stop it; [(tokens, finish)]."""
    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(collect(engine, p, s) for p, s in jobs))
        finally:
            engine.stop()
    return asyncio.run(main())


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A test HTTP handler: no access log, clients that hang up on purpose are not errors,
    and ``send`` writes a whole response."""

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def handle(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # client gave up on purpose
            super().handle()

    def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def one_image_row_short(live) -> Callable[[], None]:
    """Until the returned function is called, the server's prompts give their first image one
    token fewer than its placeholder run (a hand-off that lost a row): the engine's own guard
    must catch it."""
    pre = live.app.state.fovea.preprocessor
    prompts = pre.prompts

    async def shorter(*args, **kwargs):
        prompt, twin = await prompts(*args, **kwargs)
        first = dataclasses.replace(prompt.images[0], num_tokens=prompt.images[0].num_tokens - 1)
        return dataclasses.replace(prompt, images=[first, *prompt.images[1:]]), twin

    pre.prompts = shorter

    def restore() -> None:
        pre.prompts = prompts

    return restore
