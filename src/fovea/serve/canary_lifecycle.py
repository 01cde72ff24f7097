"""The grounding canary's life in a server: the start-up run (which may refuse start-up), the
periodic runs, and the metrics each run sets; then the app's lifespan around them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from fovea.errors import FoveaError
from fovea.serve.startup_checks import StartupRefused, refuse_at_startup
from fovea.serve.state import ServerState
from fovea.startup_clock import STARTUP

log = logging.getLogger("fovea.serve")


class CanaryFailed(FoveaError):
    status, code, type = 503, "canary_failed", "server_error"


def canary_runner(state: ServerState) -> Callable[[], Awaitable[None]]:
    """One canary run, its result logged and put on the metrics."""

    async def run_canary() -> None:
        result = await state.canary.run()
        state.metrics.canary_ok.set(1 if result.ok else 0)
        state.metrics.canary_kl.set(result.min_ablation_kl)
        if not state.canary_meaningful:
            log.warning("grounding canary ran (%s, min ablation KL %.3f nats) but means nothing: --load-format dummy",
                        "passed" if result.ok else "failed", result.min_ablation_kl)
        elif result.ok:
            log.info("grounding canary passed (min ablation KL %.3f nats > %.3f) in %.2f s",
                     result.min_ablation_kl, result.threshold, result.seconds)
        else:
            for reason in result.reasons:
                log.error("%s", reason)

    return run_canary


def lifespan(state: ServerState, run_canary: Callable[[], Awaitable[None]], on_stop: Callable[[], None]):
    """The app's lifespan: start the engine, run the start-up canary (refusing start-up where it
    cannot run, or fails under --strict), log where start-up's seconds went, then the periodic
    canary; at shutdown stop them, the engine, the preprocessing pool and ``on_stop``."""
    settings, engine = state.settings, state.engine

    async def canary_loop() -> None:
        while True:
            await asyncio.sleep(settings.canary_interval_s)
            try:
                await run_canary()
            except Exception:  # a broken canary run must not stop serving
                log.exception("grounding canary run failed")

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        contract, loaded = state.contract, state.loaded
        log.info("serving %s (%s) on device=%s dtype=%s (vision %s), probe images of %s image tokens",
                 state.model_name, loaded.adapter.family.name, loaded.device, contract.dtype, contract.vision_dtype,
                 contract.probe_image_tokens)
        task = None
        try:
            if settings.canary:
                try:
                    with STARTUP.phase("canary"):
                        await run_canary()
                except FoveaError as exc:  # e.g. encode workers that cannot answer within --encode-timeout
                    raise refuse_at_startup(app.state, StartupRefused(
                        f"the grounding canary could not run at start-up: {exc.message}")) from None
                if settings.strict and not state.canary.last.ok and state.canary_meaningful:
                    raise refuse_at_startup(app.state, CanaryFailed(
                        "--strict: the grounding canary failed at start-up: " + "; ".join(state.canary.last.reasons)))
                if settings.canary_interval_s > 0:
                    task = asyncio.create_task(canary_loop())
            STARTUP.mark_ready()
            log.info("%s", STARTUP.summary())
            announce = getattr(engine, "announce_serving", None)  # an engine core's client: counts for /health
            if announce is not None:
                announce()
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            engine.stop()
            state.preprocessor.close(wait=True)
            on_stop()

    return run
