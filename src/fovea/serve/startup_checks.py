"""Flag values that cannot work, refused at start-up in one line that names the flag and the fix.

``check_before_load`` runs before a byte of the weights is read (a PD front runs it too, and
imports no torch for it unless a check needs the model's processor): the port, a GPU share
on a host engine, and the grounding canary against ``--max-model-len`` and the image limits.
``fit_canary_to_engine`` runs once the engine knows what the KV cache holds per sequence, and
what only the start-up canary's run can find (encode workers that never answer within
``--encode-timeout``; ``--strict`` and a failing canary) is refused the same way.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING, Any

from fovea.config import ServerSettings
from fovea.errors import FoveaError
from fovea.guard.canary_fit import PROBE_SIZE, CanaryFit, CanaryTooLong, fit_canary, media_refusal

if TYPE_CHECKING:
    from fovea.engine.engine import PagedEngine
    from fovea.loading.loader import LoadedModel


class StartupRefused(FoveaError):
    status, code, type = 500, "invalid_settings", "server_error"


def check_before_load(settings: ServerSettings, *, front: bool = False) -> None:
    from fovea.startup_clock import STARTUP

    check_port(settings.host, settings.port)
    with STARTUP.phase("GPU share"):
        check_gpu_share(settings, front)
    if settings.canary and (settings.max_model_len is not None or media_refusal(PROBE_SIZE, settings.media)):
        from fovea.loading.loader import load_codec

        try:
            with STARTUP.phase("canary against the limits"):
                fit_canary(load_codec(settings.model, load_format=settings.load_format), settings.media,
                           settings.max_model_len)
        except CanaryTooLong as exc:
            raise StartupRefused(too_short(f"--max-model-len {exc.limit}", exc,
                                           f"use --max-model-len {exc.need} or more")) from None


def check_port(host: str, port: int) -> None:
    """Bind and release the address uvicorn will bind, so that a port in use is refused now,
    not after the model has loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own socket
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            raise StartupRefused(f"--host {host} is not an address this machine can listen on ({exc.strerror})") \
                from None
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise StartupRefused(f"--host {host} is not an address of this machine ({exc.strerror})") from None
            raise StartupRefused(f"--port {port} on {host} cannot be listened on ({exc.strerror}); choose another "
                                 "--port, or stop what holds it") from None


def check_gpu_share(settings: ServerSettings, front: bool) -> None:
    """--gpu-memory-utilization on an engine that runs on the host (the memory planner refuses
    it too, after loading; here it costs no load). A front knows the device only when named."""
    if settings.gpu_memory_utilization is None:
        return
    if settings.device.startswith("cpu"):
        device = settings.device
    elif front:
        return
    else:
        from fovea.loading.loader import resolve_device

        device = str(resolve_device(settings.device))
    if not device.startswith("cuda"):
        from fovea.engine.memory.planner import gpu_share_off_gpu

        raise gpu_share_off_gpu(device)


def fit_canary_to_engine(settings: ServerSettings, loaded: LoadedModel, engine: PagedEngine) -> CanaryFit:
    """The canary's probe for what this engine holds per sequence; refused in one line where
    nothing fits, naming the flag that sets the limit."""
    try:
        return fit_canary(loaded.codec, settings.media, engine.max_context)
    except CanaryTooLong as exc:
        kv_tokens = engine.block_manager.num_blocks * engine.config.block_size
        if engine.config.max_model_len <= kv_tokens:
            what = (f"--max-model-len {settings.max_model_len}" if settings.max_model_len is not None
                    else f"the model's context of {engine.config.max_model_len} tokens")
            raise StartupRefused(too_short(what, exc, f"use --max-model-len {exc.need} or more")) from None
        need = -(-exc.need // engine.config.block_size) * engine.runner.kv_plan.bytes_per_block
        size = f"{-(-need // 1024)}KiB"
        if settings.kv_cache_memory is not None:
            what = f"--kv-cache-memory {settings.kv_cache_memory} ({kv_tokens} tokens of KV cache)"
        else:
            what = f"the KV cache ({kv_tokens} tokens)"
        fix = (f"use --kv-cache-memory {size} or more" if settings.kv_cache_memory is not None
               or loaded.device.type != "cuda" else
               f"raise --gpu-memory-utilization, or use --kv-cache-memory {size} or more")
        raise StartupRefused(too_short(what, exc, fix)) from None


def too_short(what: str, exc: CanaryTooLong, fix: str) -> str:
    small = exc.smallest
    return (f"{what} is too small for this model: the grounding canary needs {exc.need} tokens per sequence (its "
            f"prompt is {small.prompt_tokens} tokens, {small.image_tokens} of them its image's, and it reads at least "
            f"one answer token) and this server holds {exc.limit}; {fix}, or pass --no-canary")


# ---- refusals found while the app starts (the start-up canary) ---------------------------------
def refuse_at_startup(state: Any, error: FoveaError) -> FoveaError:
    """Record ``error`` as why the app could not start (raise what this returns from the lifespan):
    uvicorn then logs no traceback, and the CLI prints the refusal in one line and exits 2."""
    state.startup_refusal = error
    return error


def startup_refusal(state: Any) -> FoveaError | None:
    return getattr(state, "startup_refusal", None)


class QuietStartupRefusal:
    """ASGI middleware: a start-up that failed with a recorded refusal reaches uvicorn without
    the traceback text Starlette attaches (uvicorn would log it whole)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def quiet(message: dict) -> None:
            if message["type"] == "lifespan.startup.failed" and startup_refusal(self.state) is not None:
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, quiet)
