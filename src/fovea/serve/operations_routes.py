"""The routes operators and clients poll: /health, /metrics, /version, /v1/models and a canary
run on demand."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from fovea import __version__
from fovea.serve.chat import check_model_name
from fovea.serve.state import ServerState
from fovea.startup_clock import STARTUP


def make_operations_router(state: ServerState, pool, run_canary: Callable[[], Awaitable[None]]) -> APIRouter:
    """``pool``: the encode workers' pool (e_pd), else None."""
    router = APIRouter()
    settings, loaded, contract, engine, metrics = (state.settings, state.loaded, state.contract, state.engine,
                                                   state.metrics)

    @router.get("/health")
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
            "quantization": contract.quantization,
            "load_format": contract.load_format,
            "model_family": loaded.adapter.family.name,
            "topology": settings.topology,
            "api_servers": state.api_servers(),
            "encode_workers": workers,
            "handoff": pool.handoff_summary() if pool is not None else None,
            "probe_image_tokens": contract.probe_image_tokens,
            "recipe_fingerprint": contract.recipe_fingerprint,
            "processor_override": contract.processor_override,
            "queue_depth": engine.queue_depth,
            "kv_free_share": kv_free_share(engine),
            "memory": engine.memory_report(),
            "startup": STARTUP.report() if STARTUP.ready_after is not None else None,
            "canary": None if last is None else {
                "ok": last.ok, "min_ablation_kl": last.min_ablation_kl, "threshold": last.threshold,
                "checked_at": last.checked_at, "answers": {c.colour: c.answer for c in last.cases},
                "probe_size": last.probe_size, "answer_tokens": last.answer_tokens,
                "meaningful": state.canary_meaningful},
        }
        code = 503 if status == "starting" or (settings.strict and status != "ok") else 200
        return JSONResponse(body, status_code=code)

    @router.post("/fovea/canary")
    async def canary_now():
        """Run the grounding canary now (also runs at start-up and every --canary-interval seconds)."""
        await run_canary()
        return state.canary.last.to_dict()

    @router.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_route(request: Request):
        # HEAD (load generators such as aiperf probe with it): GET's status and headers, no body.
        body = metrics.render()
        if request.method == "HEAD":
            return Response(headers={"content-length": str(len(body))}, media_type=CONTENT_TYPE_LATEST)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
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
            "quantization": contract.quantization,  # the checkpoint's format; null: unquantized
        }

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        """OpenAI's "retrieve model": the one entry of /v1/models, or 404 for another name
        (``:path``: served names such as ``Qwen/Qwen2.5-VL-7B-Instruct`` hold slashes)."""
        check_model_name(state, model, param=None)
        return model_card()

    return router


def kv_free_share(engine) -> float | None:
    """The KV cache's free share (free blocks include cached ones that may be evicted), which a
    front routes by; None from an engine core in its own process until its first stats."""
    blocks = engine.block_manager
    free = getattr(blocks, "num_free", None)
    return None if free is None else round(free / blocks.num_blocks, 4)
