"""The FastAPI application: routes, error handling, start-up and shutdown."""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fovea import __version__
from fovea.config import ServerSettings
from fovea.engine.engine import Engine, EngineConfig
from fovea.model.loader import LoadedModel, load_model
from fovea.serve.chat import make_chat_router
from fovea.serve.error_handlers import error_body, install_error_handlers
from fovea.serve.images_api import make_images_router
from fovea.serve.state import ServerState

log = logging.getLogger("fovea.serve")


def create_app(settings: ServerSettings, loaded: LoadedModel | None = None) -> FastAPI:
    """Build the app; ``loaded`` lets tests share one loaded model between apps."""
    loaded = loaded or load_model(settings.model, settings.device, settings.dtype)
    engine = Engine(loaded, EngineConfig(settings.max_batch_size, settings.max_queue))
    state = ServerState.build(settings, loaded, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving %s on device=%s dtype=%s", state.model_name, loaded.device,
                 str(loaded.dtype).removeprefix("torch."))
        yield
        engine.stop()

    app = FastAPI(title="fovea", version=__version__, lifespan=lifespan)
    app.state.fovea = state
    install_error_handlers(app)

    @app.middleware("http")
    async def limits_and_auth(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return JSONResponse(error_body(
                f"the request body is {int(length)} bytes; the limit is {settings.max_body_bytes} bytes "
                "(--max-body-bytes). Send smaller images or upload them with POST /v1/images.",
                "request_too_large"), status_code=413)
        if settings.api_key and request.url.path != "/health":
            supplied = request.headers.get("authorization", "")
            if not hmac.compare_digest(supplied.encode(), f"Bearer {settings.api_key}".encode()):
                return JSONResponse(error_body(
                    "a valid API key is required: send 'Authorization: Bearer <key>'.", "invalid_api_key"),
                    status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": state.model_name,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "queue_depth": engine.queue_depth,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "fovea",
            "root": str(loaded.path),
            "max_model_len": loaded.context_length,
        }]}

    app.include_router(make_chat_router(state))
    app.include_router(make_images_router(state.store, settings.media))
    return app
