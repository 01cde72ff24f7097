"""The front's FastAPI app (routes, /health, /metrics) and ``run_front``, its process's life.

``run_front`` starts the shared encode workers and the PD workers, waits until every PD worker
answers (so a flag a worker refuses stops the front with that worker's error, as one server
would stop), then serves; on SIGINT or SIGTERM it stops the PD workers, then the encode
workers, and removes their socket directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from fovea import __version__
from fovea.config import SWITCH, ServerSettings
from fovea.errors import FoveaError
from fovea.front.encoders import EncodeFleet
from fovea.front.metrics import FrontMetrics, merge
from fovea.front.pd_fleet import HUNG_AFTER_S, PdFleet, PdWorker
from fovea.front.proxy import Proxy
from fovea.front.ray_encoders import RayEncodeFleet
from fovea.front.uploads import UploadRecord
from fovea.logs import RequestIdMiddleware
from fovea.serve.body_limit import BodyLimitMiddleware
from fovea.serve.error_handlers import install_error_handlers
from fovea.serve.playground_route import make_playground_router
from fovea.serve.request_gate import RequestGate
from fovea.serve.trailing_slash import StripTrailingSlash

log = logging.getLogger("fovea.front")

START_TIMEOUT_S = 900.0  # loading a large model in every PD worker can take minutes
PENDING_S = 10.0  # a Ray actor not placed for this long is waiting for a node with its resources
TABLE = "encoders.json"  # where the encode workers are, beside each PD worker on Ray
ENCODE_WATCH_S = 0.25
WORKER_HEALTH_TIMEOUT_S = 5.0


def create_front_app(settings: ServerSettings, fleet: PdFleet, encoders: EncodeFleet | RayEncodeFleet) -> FastAPI:
    metrics = FrontMetrics()
    proxy = Proxy(fleet, metrics, UploadRecord(settings.media.store_max_bytes, settings.media.store_ttl_s))
    fleet.on_restart = lambda worker: metrics.pd_restarts.labels(pd_worker=str(worker.index)).inc()
    previous = fleet.on_restart  # chained, not replaced

    def on_restart(worker: PdWorker) -> None:
        previous(worker)
        proxy.affinity.forget(worker.index)  # its caches start empty: it holds no image any more

    fleet.on_restart = on_restart

    async def watch_encoders() -> None:
        while True:
            encoders.check()
            await asyncio.sleep(ENCODE_WATCH_S)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.open()
        assert proxy.client is not None
        tasks = [asyncio.create_task(fleet.watch(proxy.client, proxy.join)), asyncio.create_task(watch_encoders())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await proxy.close()
            await asyncio.to_thread(fleet.stop)
            await asyncio.to_thread(encoders.stop)

    app = FastAPI(title="fovea", version=__version__, lifespan=lifespan, redirect_slashes=False)
    app.state.proxy = proxy
    install_error_handlers(app)
    app.add_middleware(RequestGate, api_key=settings.api_key,
                       count=lambda route, status: metrics.requests.labels(route=route, status=str(status)).inc())

    async def worker_health(worker: PdWorker) -> dict:
        if worker.state not in ("ready", "starting"):
            return {"health": None, "error": f"not running ({worker.state})"}
        try:
            reply = await proxy.fetch(worker, "/health", WORKER_HEALTH_TIMEOUT_S)
            return {"health": reply.json(), "error": None}
        except (httpx.HTTPError, ValueError) as exc:
            return {"health": None, "error": f"{type(exc).__name__}: {exc}"}

    @app.get("/health")
    async def health():
        checks = await asyncio.gather(*(worker_health(w) for w in fleet.workers))
        pd = [{**w.status(), **check} for w, check in zip(fleet.workers, checks, strict=True)]
        encode = encoders.status()
        reasons, warnings = [], []
        if not any(w["state"] == "ready" for w in pd):
            reasons.append("no prefill/decode worker is ready: requests get 503 pd_unavailable until one is")
        if encode and not any(e["state"] == "ready" for e in encode):
            reasons.append("no encode worker is ready: image requests get 503 until one is")
        for worker in pd:
            body = worker["health"] or {}
            if worker["state"] == "ready" and body.get("status", "ok") != "ok":
                reasons += [f"PD worker {worker['index']}: {r}" for r in body.get("reasons") or ["degraded"]]
            elif worker["state"] != "ready":
                warnings.append(f"PD worker {worker['index']} is {worker['state']} (restarts {worker['restarts']})")
            if worker["doubted"]:
                warnings.append(f"PD worker {worker['index']} is doubted: a connection to it failed, so requests "
                                "go to the others until its /health answers again")
        warnings += [f"encode worker {e['index']} is {e['state']} (restarts {e['restarts']})"
                     for e in encode if e["state"] != "ready"]
        model = next((w["health"].get("model") for w in pd if w["health"]), settings.served_model_name)
        status = "degraded" if reasons else "ok"
        body = {"status": status, "reasons": reasons, "warnings": warnings, "model": model,
                "topology": settings.topology, "front": {"pid": os.getpid()}, "pd_workers": pd,
                "encode_workers": encode}
        return JSONResponse(body, status_code=503 if (settings.strict and status != "ok") else 200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_route(request: Request):
        ready = fleet.ready()
        replies = await asyncio.gather(*(proxy.fetch(w, "/metrics", WORKER_HEALTH_TIMEOUT_S) for w in ready),
                                       return_exceptions=True)
        texts = {w.index: r.text for w, r in zip(ready, replies, strict=True)
                 if isinstance(r, httpx.Response) and r.status_code == 200}
        metrics.pd_ready.set(len(ready))
        metrics.encode_ready.set(sum(e["state"] == "ready" for e in encoders.status()))
        metrics.observe_pd_workers(fleet.workers)
        body = metrics.render() + merge(texts)  # bytes
        if request.method == "HEAD":  # GET's status and headers, no body
            return Response(headers={"content-length": str(len(body))}, media_type=CONTENT_TYPE_LATEST)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # Answered by any one ready PD worker, as it is (streams relayed event by event).
    async def passthrough(request: Request):
        return await proxy.one(request)

    for path, method in (("/v1/models", "GET"), ("/v1/models/{model:path}", "GET"), ("/v1/chat/completions", "POST"),
                         ("/v1/completions", "POST"), ("/generate", "POST"), ("/tokenize", "POST"), ("/detokenize", "POST")):
        app.add_api_route(path, passthrough, methods=[method])

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await proxy.responses(request)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str):
        return await proxy.stored(request, response_id)

    @app.post("/v1/images")
    async def upload_image(request: Request):
        return await proxy.upload(request)

    @app.get("/v1/images/{image_id}")
    async def get_image(request: Request, image_id: str):
        return await proxy.one(request)

    @app.delete("/v1/images/{image_id}")
    async def delete_image(request: Request, image_id: str):
        return await proxy.delete(request, image_id)

    @app.post("/fovea/canary")
    async def canary(request: Request):
        return await proxy.canary(request)

    app.include_router(make_playground_router())
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(StripTrailingSlash)
    app.add_middleware(RequestIdMiddleware)  # the id goes on to the PD worker in X-Request-Id
    return app


def await_start(fleet: PdFleet, encoders: EncodeFleet | RayEncodeFleet, timeout: float = START_TIMEOUT_S,
                pending_s: float = PENDING_S) -> None:
    """Until every PD worker's /health answers; a worker of either kind that exits first stops
    the front with its exit code (its own log, above, says why). On Ray, a worker whose actor
    waits for a node with its resources does not hold the front up for ever: once one worker is
    ready and the others have waited ``pending_s`` to be placed, the front serves, and they join
    when Ray places them."""
    deadline = time.monotonic() + timeout
    with httpx.Client(headers=fleet.headers) as client:
        while True:
            _check_encoders(encoders)
            for worker in fleet.workers:
                if worker.state != "starting" or worker.placement is None:
                    continue
                if worker.exited():
                    raise FoveaError(f"PD worker {worker.index} exited with code {worker.child.exit_code()} while "
                                     "starting (its log above says why)")
                with contextlib.suppress(httpx.HTTPError):
                    client.get(worker.url + "/health", timeout=2.0)
                    worker.state = "ready"
            waiting = [w for w in fleet.workers if w.state != "ready"]
            if not waiting:
                return
            if len(waiting) < len(fleet.workers) and all(
                    w.placement is None and time.monotonic() - w.launched_at > pending_s for w in waiting):
                log.warning("front: serving with %d of %d PD workers; PD worker(s) %s wait for a Ray node with the "
                            "resources they ask for, and join once placed", len(fleet.workers) - len(waiting),
                            len(fleet.workers), ", ".join(str(w.index) for w in waiting))
                return
            if time.monotonic() > deadline:
                raise FoveaError(f"the PD workers were not ready within {timeout:.0f} s"
                                 + ("; not placed by Ray: " + ", ".join(str(w.index) for w in waiting
                                                                        if w.placement is None)
                                    if any(w.placement is None for w in waiting) else ""))
            time.sleep(0.25)


def await_encoders(encoders: RayEncodeFleet, timeout: float = START_TIMEOUT_S) -> None:
    """On Ray, until every encode worker is ready: the PD workers start with their table."""
    deadline = time.monotonic() + timeout
    while not encoders.ready():
        _check_encoders(encoders)
        if time.monotonic() > deadline:
            raise FoveaError(f"the encode workers were not ready within {timeout:.0f} s: {encoders.status()}")
        time.sleep(0.25)


def _check_encoders(encoders: EncodeFleet | RayEncodeFleet) -> None:
    failed = encoders.failed_to_start()
    if failed is not None:
        raise FoveaError(f"encode worker {failed.index} exited with code {failed.exit_code()} while starting "
                         "(its log above says why)")
    encoders.check()


def _exit(signum: int, frame) -> None:
    raise SystemExit(0)


def make_fleets(settings: ServerSettings, argv: list[str], log_level: str, encode_key: bytes,
                internal_key: str) -> tuple[PdFleet, EncodeFleet | RayEncodeFleet]:
    """The PD workers and the encode workers they share (none in agg): processes on this machine,
    or with ``--ray-address`` actors on the Ray cluster."""
    model = str(settings.model) if settings.model is not None else None
    encode_args = (model, settings.encode_device or settings.device, settings.dtype, settings.vision_batch_size,
                   SWITCH[settings.fused_vision], log_level)
    encode_workers = (settings.encode_workers or 1) if settings.topology == "e_pd" else 0
    hung_after_s = settings.pd_timeout_s or HUNG_AFTER_S
    if settings.ray_address is None:
        encoders = EncodeFleet(encode_workers, encode_key, encode_args)
        return PdFleet(settings.pd_workers, argv, encoders.sockets, internal_key, encode_key,  # type: ignore[arg-type]
                       hung_after_s=hung_after_s), encoders
    from fovea.config import ray_resources
    from fovea.disagg.encoder_directory import ENDPOINTS_ENV
    from fovea.disagg.ray_workers import connect, ray_module
    from fovea.front.ray_hosts import DIR, RayProcess

    connect(settings.ray_address, log_to_driver=True)  # the workers' logs beside the front's
    gpu = settings.device.startswith("cuda") or (
        settings.device == "auto" and ray_module().cluster_resources().get("GPU", 0) > 0)
    pd_resources = ray_resources(settings.ray_pd_resources, gpu, "pd")
    ray_encoders = RayEncodeFleet(encode_workers, encode_key, encode_args,
                                  ray_resources(settings.ray_encode_resources, gpu, "encode"))
    fleet = PdFleet(settings.pd_workers, argv, [], internal_key, encode_key,  # type: ignore[arg-type]
                    hung_after_s=hung_after_s,
                    make_child=lambda index: RayProcess(f"pd-{index}", pd_resources, spread=True))
    log.info("front: on the Ray cluster at %s: %d PD worker(s) asking %s each, %d encode worker(s) asking %s",
             settings.ray_address, settings.pd_workers, pd_resources, encode_workers, ray_encoders.resources)
    if encode_workers:
        # Each PD worker reads where the encode workers are from a file on its node, rewritten when
        # one moves (encoder_directory): a (re)started worker gets the table as it is then.
        fleet.files = lambda worker: ({ENDPOINTS_ENV: f"{DIR}/{TABLE}"},
                                      {TABLE: json.dumps(ray_encoders.entries())})

        def tell_pd_workers(entries: list[dict | None]) -> None:
            for worker in fleet.workers:
                if worker.child is not None and worker.placement is not None:
                    worker.child.write(TABLE, json.dumps(entries))

        ray_encoders.on_change = tell_pd_workers
    return fleet, ray_encoders


def run_front(settings: ServerSettings, argv: list[str], log_level: str) -> int:
    """``argv``: the command line that started this front; each PD worker runs it with its own
    overrides. Returns once the front has stopped and its children with it."""
    import uvicorn

    from fovea.serve.http_protocol import uvicorn_options

    assert settings.pd_workers
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request and probe
    encode_key, internal_key = secrets.token_bytes(32), secrets.token_urlsafe(32)
    fleet, encoders = make_fleets(settings, argv, log_level, encode_key, internal_key)
    # Until uvicorn takes the signals over (and again after it hands them back), a stop signal
    # unwinds through the cleanup below instead of leaving the children to their watchdogs.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit)
    try:
        started = time.monotonic()
        encoders.start()
        if isinstance(encoders, RayEncodeFleet):
            await_encoders(encoders)
            fleet.sockets = encoders.sockets  # their table entries, now that they are placed
        fleet.start()
        await_start(fleet, encoders)
        log.info("front: %d PD worker(s) and %d encode worker(s) ready in %.1f s", len(fleet.workers),
                 len(encoders.procs), time.monotonic() - started)
        app = create_front_app(settings, fleet, encoders)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level.lower(), log_config=None,
                    **uvicorn_options())
    finally:
        fleet.stop()
        encoders.stop()
        sys.stdout.flush()
    return 0
