"""The FastAPI application: routes, error handling, start-up checks, canary and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from fovea import __version__
from fovea.config import SWITCH, ServerSettings
from fovea.engine.paged import PagedEngine, PagedEngineConfig, kernel_selfcheck
from fovea.engine.paged.config import VISION_BATCH
from fovea.engine.paged.memory_plan import check_weights_fit
from fovea.errors import FoveaError
from fovea.guard.canary_fit import ANSWER_TOKENS, PROBE_SIZE
from fovea.guard.memory import estimate_weight_bytes
from fovea.logs import RequestIdMiddleware
from fovea.model.contract import check_contract, vision_row_width
from fovea.model.loader import LoadedModel, default_model_dir, load_model, resolve_device, resolve_dtype
from fovea.serve.body_limit import BodyLimitMiddleware
from fovea.serve.chat import check_model_name, make_chat_router
from fovea.serve.completions import make_completions_router
from fovea.serve.error_handlers import install_error_handlers
from fovea.serve.images_api import make_images_router
from fovea.serve.metrics import Metrics
from fovea.serve.playground_route import make_playground_router
from fovea.serve.request_gate import RequestGate
from fovea.serve.responses import make_responses_router
from fovea.serve.startup_checks import (
    QuietStartupRefusal,
    StartupRefused,
    fit_canary_to_engine,
    refuse_at_startup,
)
from fovea.serve.state import ServerState
from fovea.serve.tokenize import make_tokenize_router
from fovea.serve.trailing_slash import StripTrailingSlash
from fovea.startup_clock import STARTUP

log = logging.getLogger("fovea.serve")


class CanaryFailed(FoveaError):
    status, code, type = 503, "canary_failed", "server_error"


def check_fits_before_load(settings: ServerSettings) -> None:
    """On a GPU, refuse a model whose weights cannot fit the memory this process may use,
    from the safetensors headers, before loading a byte of it."""
    if settings.engine != "paged":
        return
    device = resolve_device(settings.device)
    if device.type != "cuda":
        return
    import torch

    path = settings.model or default_model_dir()
    dtype = resolve_dtype(settings.dtype, device)
    free, total = torch.cuda.mem_get_info(device)
    check_weights_fit(estimate_weight_bytes(path, dtype), str(dtype).removeprefix("torch."), str(device), total,
                      free, settings.gpu_memory_utilization, settings.kv_cache_memory)


def create_app(settings: ServerSettings, loaded: LoadedModel | None = None) -> FastAPI:
    """Build the app; ``loaded`` lets tests share one loaded model between apps."""
    if loaded is None:
        check_fits_before_load(settings)
        device = resolve_device(settings.device)
        kernel_selfcheck.start_early(device, resolve_dtype(settings.dtype, device))  # compiles while loading
        with STARTUP.phase("load weights"):
            loaded = load_model(settings.model, settings.device, settings.dtype)
    with STARTUP.phase("contract"):
        contract = check_contract(loaded, override=settings.processor_override,
                                  force_override=settings.force_processor_override)
    for note in contract.notes:
        log.warning("%s: %s", loaded.name, note)
    # The gauges read the engine lazily, so the metrics can exist before the engine they watch.
    metrics = Metrics(lambda: engine.queue_depth, lambda: (engine.encoder_cache.hits, engine.encoder_cache.misses),
                      lambda: getattr(engine, "oom_recoveries", 0))
    on_vision = lambda s: metrics.vision_latency.observe(1000 * s)
    pool = None
    vision_batch = settings.vision_batch_size or VISION_BATCH
    engine_config = PagedEngineConfig(max_num_seqs=settings.max_batch_size,
                                      max_queue=settings.max_queue,
                                      max_num_batched_tokens=settings.max_batched_tokens,
                                      overlap_steps=SWITCH[settings.step_overlap],
                                      fused_vision=SWITCH[settings.fused_vision],
                                      gpu_memory_utilization=settings.gpu_memory_utilization,
                                      kv_cache_memory=settings.kv_cache_memory,
                                      max_model_len=settings.max_model_len,
                                      vision_batch_size=vision_batch)
    if settings.topology == "e_pd":
        from fovea.disagg.encoder_pool import EncoderPool

        # The workers run the vision stage agg would run here (the fused one on a GPU for
        # models of 1 B parameters or more), so both topologies give the same rows.
        encode_device = (resolve_device(settings.encode_device, "--encode-device") if settings.encode_device
                         else loaded.device)
        fused = engine_config.resolved(encode_device, loaded.context_length,
                                       sum(p.numel() for p in loaded.model.parameters())).fused_vision
        with STARTUP.phase("encode workers"):
            pool = EncoderPool(loaded.path, workers=settings.encode_workers or 1, device=str(encode_device),
                               dtype=str(loaded.dtype).removeprefix("torch."), model_id=contract.model_fingerprint,
                               recipe_fingerprint=contract.recipe_fingerprint, hidden=vision_row_width(loaded),
                               timeout_s=settings.encode_timeout_s or 60.0, ray_address=settings.ray_address,
                               batch_images=vision_batch, pd_device=str(loaded.device), fused_vision=bool(fused),
                               on_handoff=metrics.observe_handoff, encoder_addresses=list(settings.encode_addresses),
                               authkey=settings.encode_authkey).start()
    try:
        with STARTUP.phase("engine"):
            engine = PagedEngine(loaded, engine_config, on_vision_seconds=on_vision, remote_encoder=pool)
        fit = None
        if settings.canary:
            with STARTUP.phase("canary fit"):
                fit = fit_canary_to_engine(settings, loaded, engine)
    except BaseException:
        if pool is not None:  # refused at start-up: its worker processes go with it
            pool.stop()
        raise
    state = ServerState.build(settings, loaded, engine, contract, metrics)
    if fit is not None:
        state.canary.adapt(fit.size, fit.answer_tokens)
        if (fit.size, fit.answer_tokens) != (PROBE_SIZE, ANSWER_TOKENS):
            log.info("grounding canary fitted to %d tokens per sequence: probe images of %dx%d (%d prompt tokens), "
                     "answers of at most %d tokens", engine.max_context, fit.size, fit.size, fit.prompt_tokens,
                     fit.answer_tokens)

    async def run_canary() -> None:
        result = await state.canary.run()
        metrics.canary_ok.set(1 if result.ok else 0)
        metrics.canary_kl.set(result.min_ablation_kl)
        if result.ok:
            log.info("grounding canary passed (min ablation KL %.3f nats > %.3f) in %.2f s",
                     result.min_ablation_kl, result.threshold, result.seconds)
        else:
            for reason in result.reasons:
                log.error("%s", reason)

    async def canary_loop() -> None:
        while True:
            await asyncio.sleep(settings.canary_interval_s)
            try:
                await run_canary()
            except Exception:  # a broken canary run must not stop serving
                log.exception("grounding canary run failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
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
                if settings.strict and not state.canary.last.ok:
                    raise refuse_at_startup(app.state, CanaryFailed(
                        "--strict: the grounding canary failed at start-up: " + "; ".join(state.canary.last.reasons)))
                if settings.canary_interval_s > 0:
                    task = asyncio.create_task(canary_loop())
            STARTUP.mark_ready()
            log.info("%s", STARTUP.summary())
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            engine.stop()
            state.preprocessor.close(wait=True)
            if pool is not None:
                pool.stop()

    app = FastAPI(title="fovea", version=__version__, lifespan=lifespan, redirect_slashes=False)
    app.state.fovea = state
    install_error_handlers(app, on_error_code=metrics.observe_error_code)

    app.add_middleware(QuietStartupRefusal, state=app.state)
    app.add_middleware(RequestGate, api_key=settings.api_key,
                       count=lambda route, status: metrics.requests.labels(route=route, status=str(status)).inc())

    @app.get("/health")
    async def health():
        status, reasons = state.health()
        workers = pool.status() if pool is not None else None
        if workers is not None and not any(w["state"] in ("ready", "busy") for w in workers):
            status, reasons = "degraded", [*reasons, "no encode worker is ready: image requests get 503 until one is"]
        last = state.canary.last
        body = {
            "status": status,
            "reasons": reasons,
            "warnings": state.warnings(),
            "model": state.model_name,
            "device": str(loaded.device),
            "dtype": contract.dtype,
            "vision_dtype": contract.vision_dtype,
            "model_family": loaded.adapter.family.name,
            "topology": settings.topology,
            "encode_workers": workers,
            "handoff": pool.handoff_summary() if pool is not None else None,
            "probe_image_tokens": contract.probe_image_tokens,
            "recipe_fingerprint": contract.recipe_fingerprint,
            "processor_override": contract.processor_override,
            "queue_depth": engine.queue_depth,
            "memory": engine.memory_report(),
            "startup": STARTUP.report() if STARTUP.ready_after is not None else None,
            "canary": None if last is None else {
                "ok": last.ok, "min_ablation_kl": last.min_ablation_kl, "threshold": last.threshold,
                "checked_at": last.checked_at, "answers": {c.colour: c.answer for c in last.cases},
                "probe_size": last.probe_size, "answer_tokens": last.answer_tokens},
        }
        code = 503 if (settings.strict and status != "ok") else 200
        return JSONResponse(body, status_code=code)

    @app.post("/fovea/canary")
    async def canary_now():
        """Run the grounding canary now (also runs at start-up and every --canary-interval seconds)."""
        await run_canary()
        return state.canary.last.to_dict()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_route(request: Request):
        # HEAD (load generators such as aiperf probe with it): GET's status and headers, no body.
        body = metrics.render()
        if request.method == "HEAD":
            return Response(headers={"content-length": str(len(body))}, media_type=CONTENT_TYPE_LATEST)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "fovea",
            "root": state.model_name,  # not the server's filesystem path
            "max_model_len": getattr(engine, "max_context", loaded.context_length),
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        """OpenAI's "retrieve model": the one entry of /v1/models, or 404 for another name
        (``:path``: served names such as ``Qwen/Qwen2.5-VL-7B-Instruct`` hold slashes)."""
        check_model_name(state, model, param=None)
        return model_card()

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(StripTrailingSlash)
    app.add_middleware(RequestIdMiddleware)  # outermost: every line and response of a request has its id
    app.include_router(make_chat_router(state))
    app.include_router(make_completions_router(state))
    app.include_router(make_responses_router(state))
    app.include_router(make_tokenize_router(state))
    app.include_router(make_images_router(state.store, settings.media))
    app.include_router(make_playground_router())
    return app
