"""The composition root: ``create_app`` builds the server from its parts (the model and its contract, the
encode workers, the engine, the canary's lifecycle, the routes)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from fovea import __version__, logs
from fovea.config import ServerSettings, engine_config
from fovea.engine import PagedEngine
from fovea.engine.memory.plan import check_weights_fit
from fovea.engine.runner import kernel_selfcheck
from fovea.errors import ModelLoadError
from fovea.guard.canary_fit import ANSWER_TOKENS, PROBE_SIZE, CanaryFit
from fovea.guard.memory import estimate_weight_bytes
from fovea.loading.contract import (
    ModelContract,
    apply_processor_override,
    check_contract,
    fingerprint,
    recipe_of,
    vision_row_width,
)
from fovea.loading.loader import LoadedModel, default_model_dir, load_model, resolve_device, resolve_dtype
from fovea.logs import RequestIdMiddleware
from fovea.serve.body_limit import BodyLimitMiddleware
from fovea.serve.canary_lifecycle import canary_runner, lifespan
from fovea.serve.chat import make_chat_router
from fovea.serve.completions import make_completions_router
from fovea.serve.error_handlers import install_error_handlers
from fovea.serve.images_api import make_images_router
from fovea.serve.metrics import Metrics
from fovea.serve.operations_routes import make_operations_router
from fovea.serve.playground_route import make_playground_router
from fovea.serve.request_gate import RequestGate
from fovea.serve.responses.routes import make_responses_router
from fovea.serve.startup_checks import QuietStartupRefusal, fit_canary_to_engine
from fovea.serve.state import ServerState
from fovea.serve.tokenize import make_tokenize_router
from fovea.serve.trailing_slash import StripTrailingSlash
from fovea.startup_clock import STARTUP

if TYPE_CHECKING:
    from fovea.disagg.encoder_pool import EncoderPool

log = logging.getLogger("fovea.serve")


def check_fits_before_load(settings: ServerSettings) -> None:
    """On a GPU, refuse a model whose weights cannot fit the memory this process may use,
    from the safetensors headers, before loading a byte of it."""
    device = resolve_device(settings.device)
    if device.type != "cuda" or settings.load_format == "dummy":  # dummy: no files; the memory plan checks
        return
    import torch

    path = settings.model or default_model_dir()
    dtype = resolve_dtype(settings.dtype, device)
    free, total = torch.cuda.mem_get_info(device)
    check_weights_fit(estimate_weight_bytes(path, dtype), str(dtype).removeprefix("torch."), str(device), total,
                      free, settings.gpu_memory_utilization, settings.kv_cache_memory)


def create_app(settings: ServerSettings, loaded: LoadedModel | None = None,
               on_core_address: Callable[[str], None] = lambda address: None) -> FastAPI:
    """The server, composed: the model (loaded and checked against its contract), the encode
    workers (e_pd), the engine, the canary's lifecycle and the routes. ``loaded`` lets tests share
    one loaded model between apps; it runs the engine in this process (``--engine-core thread``).

    With ``--engine-core process`` (and no ``loaded``) the model, the encode workers and the
    engine live in the engine core's process (``engine.process``), and this process holds the
    model's structure alone (no weights) for its processor, templates and tokenizer.
    ``on_core_address`` is then given the core's address as soon as its process starts."""
    if settings.engine_core == "process" and loaded is None:
        return create_app_with_core(settings, on_core_address)
    loaded, contract = load_and_check(settings, loaded)
    metrics = engine_metrics(lambda: engine)
    config = engine_config(settings)
    pool = start_encode_workers(settings, loaded, contract, metrics, config) if settings.topology == "e_pd" else None
    try:
        with STARTUP.phase("engine"):
            engine = PagedEngine(loaded, config, on_vision_seconds=lambda s: metrics.vision_latency.observe(1000 * s),
                                 remote_encoder=pool)
        fit = fit_canary(settings, loaded, engine)
    except BaseException:
        if pool is not None:  # refused at start-up: its worker processes go with it
            pool.stop()
        raise
    return compose(settings, loaded, engine, contract, metrics, pool, fit,
                   on_stop=pool.stop if pool is not None else lambda: None)


def create_app_with_core(settings: ServerSettings,
                         on_core_address: Callable[[str], None] = lambda address: None) -> FastAPI:
    """``create_app`` with the engine core in its own process: it loads, checks and profiles while
    this process reads the model's structure; the routes then talk to it through ``EngineClient``."""
    from fovea.engine.process.client import EngineClient, start_core

    level, fmt = logs.configured()
    structure: dict = {}

    def read_structure() -> None:
        structure["loaded"] = load_model(settings.model, settings.device, settings.dtype, weights=False,
                                         load_format=settings.load_format)

    process, address, info = start_core(settings, level, fmt, while_waiting=read_structure,
                                        on_address=on_core_address)
    STARTUP.merge(info.startup_seconds, info.startup_depth)
    loaded = structure["loaded"]
    return attach(settings, loaded, EngineClient(process, address, info, loaded.context_length,
                                                 api_servers=settings.api_server_count))


def create_app_attached(settings: ServerSettings, address: str, info) -> FastAPI:
    """A further API process's app (``--api-server-count``): the same routes, fed to the engine core
    another API process started (``address``, ``info``); it neither starts nor stops that core."""
    from fovea.engine.process.client import EngineClient

    loaded = load_model(settings.model, settings.device, settings.dtype, weights=False,
                        load_format=settings.load_format)
    return attach(settings, loaded, EngineClient(None, address, info, loaded.context_length,
                                                 api_servers=settings.api_server_count))


def attach(settings: ServerSettings, loaded: LoadedModel, engine) -> FastAPI:
    """The app around an engine core's client: metrics fed from the core's stats, the canary fitted
    to its limits, and the server stopped (status 1) if the core dies."""
    from fovea.engine.process.client import stop_server_on_death

    metrics = engine_metrics(lambda: engine)
    if engine.process is not None:  # the core's timings reach every API process: one observes them
        engine.on_vision_seconds = lambda s: metrics.vision_latency.observe(1000 * s)
        engine.on_handoff = metrics.observe_handoff
    try:
        same_recipe_as_core(settings, loaded, engine.info.contract)
        fit = fit_canary(settings, loaded, engine)
        pool = engine.encode_workers if settings.topology == "e_pd" else None
        app = compose(settings, loaded, engine, engine.info.contract, metrics, pool, fit, on_stop=lambda: None)
    except BaseException:
        engine.stop()
        raise
    engine.on_death = stop_server_on_death(app.state)
    return app


def same_recipe_as_core(settings: ServerSettings, loaded: LoadedModel, contract: ModelContract) -> None:
    """This process's processor with the core's --processor-override, checked against the core's
    contract: this process resizes (and for most families normalises) what the core encodes."""
    apply_processor_override(loaded, settings.processor_override, settings.force_processor_override)
    ours = fingerprint(recipe_of(loaded.codec.image_processor, loaded.adapter.recipe_fields))
    if ours != contract.recipe_fingerprint:
        raise ModelLoadError(f"this API process preprocesses with recipe {ours}, the engine core's contract says "
                             f"{contract.recipe_fingerprint}; both must read the same model directory")


def engine_metrics(engine: Callable[[], object]) -> Metrics:
    """The metrics, reading the engine (local or the core's client) lazily: they exist before it."""
    return Metrics(lambda: engine().queue_depth,
                   lambda: (engine().encoder_cache.hits, engine().encoder_cache.misses),
                   lambda: getattr(engine(), "oom_recoveries", 0),
                   lambda: (engine().steps, dict(engine().phase_seconds)))


def fit_canary(settings: ServerSettings, loaded: LoadedModel, engine) -> CanaryFit | None:
    if not settings.canary:
        return None
    with STARTUP.phase("canary fit"):
        return fit_canary_to_engine(settings, loaded, engine)


def compose(settings: ServerSettings, loaded: LoadedModel, engine, contract: ModelContract, metrics: Metrics,
            pool, fit: CanaryFit | None, on_stop: Callable[[], None]) -> FastAPI:
    """The app around an engine: its state, the canary's lifecycle, the middleware and the routes."""
    state = ServerState.build(settings, loaded, engine, contract, metrics)
    if fit is not None:
        adapt_canary(state, fit)
    run_canary = canary_runner(state)
    app = FastAPI(title="fovea", version=__version__, redirect_slashes=False,
                  lifespan=lifespan(state, run_canary, on_stop=on_stop))
    app.state.fovea = state
    install_error_handlers(app, on_error_code=metrics.observe_error_code)
    app.add_middleware(QuietStartupRefusal, state=app.state)
    app.add_middleware(RequestGate, api_key=settings.api_key,
                       count=lambda route, status: metrics.requests.labels(route=route, status=str(status)).inc())
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(StripTrailingSlash)
    app.add_middleware(RequestIdMiddleware)  # outermost: every line and response of a request has its id
    app.include_router(make_operations_router(state, pool, run_canary))
    app.include_router(make_chat_router(state))
    app.include_router(make_completions_router(state))
    app.include_router(make_responses_router(state))
    app.include_router(make_tokenize_router(state))
    app.include_router(make_images_router(state.store, settings.media))
    app.include_router(make_playground_router())
    return app


def load_and_check(settings: ServerSettings, loaded: LoadedModel | None) -> tuple[LoadedModel, ModelContract]:
    """The model (loaded unless given: refused first if its weights cannot fit) and its contract."""
    if loaded is None:
        check_fits_before_load(settings)
        device = resolve_device(settings.device)
        kernel_selfcheck.start_early(device, resolve_dtype(settings.dtype, device))  # compiles while loading
        with STARTUP.phase("load weights"):
            loaded = load_model(settings.model, settings.device, settings.dtype, load_format=settings.load_format)
    with STARTUP.phase("contract"):
        contract = check_contract(loaded, override=settings.processor_override,
                                  force_override=settings.force_processor_override)
    for note in contract.notes:
        log.warning("%s: %s", loaded.name, note)
    return loaded, contract


def sends_resized_images(loaded: LoadedModel) -> bool:
    """Whether the codec sends uint8 images that the vision stage patches (qwen_pixels), resized
    in the API process or by the vision stage, rather than pixels already normalised there."""
    from fovea.models.qwen_pixels import host_resize_supported

    return hasattr(loaded.adapter, "patch_recipe") and host_resize_supported(loaded.codec.image_processor)


def start_encode_workers(settings: ServerSettings, loaded: LoadedModel, contract: ModelContract, metrics: Metrics,
                         config) -> EncoderPool:
    """The e_pd topology's encode workers, started and ready. They run the vision stage agg would
    run here (the fused one on a GPU for models of 1 B parameters or more), so both topologies
    give the same rows."""
    from fovea.disagg.encoder_pool import EncoderPool

    if contract.processor_override and sends_resized_images(loaded):
        raise ModelLoadError(
            f"--processor-override {contract.processor_override} is not applied in encode workers, which "
            "normalise and patch Qwen-VL's resized images with the model directory's own recipe: serve without "
            "the override, or with --topology agg")
    encode_device = (resolve_device(settings.encode_device, "--encode-device") if settings.encode_device
                     else loaded.device)
    fused = config.resolved(encode_device, loaded.context_length,
                            sum(p.numel() for p in loaded.model.parameters())).fused_vision
    with STARTUP.phase("encode workers"):
        return EncoderPool(loaded.path, workers=settings.encode_workers or 1, device=str(encode_device),
                           dtype=str(loaded.dtype).removeprefix("torch."), model_id=contract.model_fingerprint,
                           recipe_fingerprint=contract.recipe_fingerprint, hidden=vision_row_width(loaded),
                           timeout_s=settings.encode_timeout_s or 60.0, ray_address=settings.ray_address,
                           batch_images=config.vision_batch_size, pd_device=str(loaded.device),
                           fused_vision=bool(fused), on_handoff=metrics.observe_handoff,
                           encoder_addresses=list(settings.encode_addresses), authkey=settings.encode_authkey).start()


def adapt_canary(state: ServerState, fit: CanaryFit) -> None:
    """The canary's probe and answer length, as fitted to what the engine holds per sequence."""
    state.canary.adapt(fit.size, fit.answer_tokens)
    if (fit.size, fit.answer_tokens) != (PROBE_SIZE, ANSWER_TOKENS):
        log.info("grounding canary fitted to %d tokens per sequence: probe images of %dx%d (%d prompt tokens), "
                 "answers of at most %d tokens", state.engine.max_context, fit.size, fit.size, fit.prompt_tokens,
                 fit.answer_tokens)
