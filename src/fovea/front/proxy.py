"""The front's proxying: one request to one PD worker, or an image upload to all of them.

A request goes to a ready worker chosen by load and by the affinity of its images (routing.py),
and its response comes back unchanged: a JSON body once read whole, a server-sent stream event
by event. If the worker cannot be reached at all the request has not started, so it is sent to
another. If the worker dies while it holds the request, the client gets 503
``pd_worker_lost``; a stream that has begun ends instead with that error as an event, then
``data: [DONE]``, and no chunk with a finish_reason (as the server itself ends a stream that
fails).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from urllib.parse import quote

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fovea.errors import FoveaError
from fovea.front.children import WORKER_HEADER
from fovea.front.metrics import FrontMetrics
from fovea.front.pd_fleet import PdFleet, PdWorker
from fovea.front.routing import AffinityTable, affinity_keys
from fovea.front.uploads import Upload, UploadRecord, sync

log = logging.getLogger("fovea.front")

# Generation is not bounded here (a long answer is not a fault), but a worker that sends
# nothing for this long is given up on; one that died fails at once (its connection closes).
READ_TIMEOUT_S = 600.0
TIMEOUT = httpx.Timeout(connect=5.0, read=READ_TIMEOUT_S, write=60.0, pool=None)
# Not passed on: hop-by-hop headers, the client's credentials (the front checked them and
# sends its own to the worker), and what the front's server sets itself.
_SKIP_REQUEST = frozenset({"host", "authorization", "content-length", "connection", "keep-alive", "te", "trailer",
                           "transfer-encoding", "upgrade", "proxy-authorization", "proxy-connection"})
# The last event of a Responses API stream (it has no data: [DONE]).
_RESPONSES_ENDS = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")
_SKIP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})


class PdWorkerLost(FoveaError):
    status, code, type = 503, "pd_worker_lost", "server_error"


class PdWorkerTimeout(FoveaError):
    status, code, type = 504, "pd_worker_timeout", "server_error"


class PdUnavailable(FoveaError):
    status, code, type = 503, "pd_unavailable", "server_error"


class RelayResponse(StreamingResponse):
    """A stream from a worker: ``on_close`` runs however it ends (finished, the client gone,
    the front stopping), so the worker's connection is closed and its count released."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int, raw_headers: list[tuple[bytes, bytes]],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, status_code)
        self.raw_headers = raw_headers
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


class Proxy:
    def __init__(self, fleet: PdFleet, metrics: FrontMetrics, record: UploadRecord) -> None:
        self.fleet, self.metrics, self.record = fleet, metrics, record
        self.affinity = AffinityTable()
        self.client: httpx.AsyncClient | None = None

    async def open(self) -> None:
        self.client = httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=None,
                                                                             max_keepalive_connections=512))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # ---- one worker -------------------------------------------------------------------------
    async def one(self, request: Request, prefer: PdWorker | None = None) -> Response:
        """To ``prefer`` if it is ready, else the worker the routing rule picks (routing.py); to
        the next one if it cannot be reached."""
        body, route = await request.body(), _route(request)
        keys = affinity_keys(body)
        tried: set[int] = set()
        while True:
            if prefer is not None and prefer.state == "ready" and not tried:
                worker, outcome = prefer, None  # a stored response's holder: not an affinity choice
            else:
                worker, outcome = self.fleet.choose(tried, keys, self.affinity)
            if worker is None:
                raise PdUnavailable("no prefill/decode worker is ready to take the request"
                                    + (f" ({len(tried)} could not be reached)" if tried else "")
                                    + "; retry shortly")
            tried.add(worker.index)
            worker.in_flight += 1
            worker.routed += 1
            # Now, not once it answers: the same image's next requests follow it while it runs.
            self.affinity.record(keys, worker.index)
            try:
                upstream = await self._send(worker, request.method, _target(request), body,
                                            self._headers(request.headers.raw), stream=True)
            except BaseException as exc:
                # No answer: the count goes back whatever the cause. Cancelled (the client went away
                # while the worker worked) or a bug, httpx closes the connection and the worker drops
                # the request; a count left up would make it look busier to every later request.
                worker.in_flight -= 1
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self.fleet.suspect(worker)
                    continue  # it never got the request
                if isinstance(exc, httpx.TransportError):
                    self._count(outcome)
                    return self._failed(worker, route, exc)
                raise
            self._count(outcome)
            self.metrics.routed.labels(pd_worker=str(worker.index), route=route,
                                       status=str(upstream.status_code)).inc()
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return RelayResponse(self._events(worker, upstream, route), upstream.status_code,
                                     _response_headers(upstream, worker), partial(self._finish, worker, upstream))
            try:
                content = await upstream.aread()
            except httpx.TransportError as exc:
                return self._failed(worker, route, exc)
            finally:
                await self._finish(worker, upstream)
            return _buffered(upstream.status_code, content, _response_headers(upstream, worker))

    def _count(self, outcome: str | None) -> None:
        """A request's affinity outcome, once it has reached a worker."""
        if outcome is not None:
            self.metrics.affinity.labels(outcome=outcome).inc()

    async def _finish(self, worker: PdWorker, upstream: httpx.Response) -> None:
        worker.in_flight -= 1
        await upstream.aclose()

    async def _events(self, worker: PdWorker, upstream: httpx.Response, route: str) -> AsyncIterator[bytes]:
        """The worker's events as they come, each passed on whole (a worker that dies mid-event
        leaves no half event behind)."""
        pending, finished, count = b"", False, 0
        try:
            async for chunk in upstream.aiter_raw():
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    finished = finished or event.strip() == b"data: [DONE]" or event.startswith(_RESPONSES_ENDS)
                    count += 1
                    yield event + b"\n\n"
            if pending:
                yield pending
        except httpx.TransportError as exc:
            if not finished:
                error = self._lose(worker, route, exc, streamed=True)
                if route == "/v1/responses":  # the Responses API's own error event, next in its sequence
                    event = {"type": "error", "sequence_number": count, "code": error.code, "message": error.message,
                             "param": None}
                    yield b"event: error\n" + _sse(json.dumps(event, separators=(",", ":")))
                else:
                    yield _sse(json.dumps(error.to_body(), separators=(",", ":"))) + _sse("[DONE]")

    def _failed(self, worker: PdWorker, route: str, exc: httpx.TransportError) -> Response:
        error = self._lose(worker, route, exc)
        return JSONResponse(error.to_body(), status_code=error.status, headers={WORKER_HEADER: str(worker.index)})

    def _lose(self, worker: PdWorker, route: str, exc: httpx.TransportError, streamed: bool = False) -> FoveaError:
        """Count and describe a request its worker failed to answer."""
        self.fleet.suspect(worker)
        self.metrics.lost.labels(pd_worker=str(worker.index)).inc()
        if not streamed:  # a stream was counted with the status it began with
            self.metrics.routed.labels(pd_worker=str(worker.index), route=route, status="503").inc()
        if isinstance(exc, httpx.TimeoutException):
            log.warning("PD worker %d sent nothing for %.0f s on %s", worker.index, READ_TIMEOUT_S, route)
            return PdWorkerTimeout(f"prefill/decode worker {worker.index} sent nothing for {READ_TIMEOUT_S:.0f} s; "
                                   "the request was given up")
        log.warning("PD worker %d (pid %s) lost a request on %s: %s: %s", worker.index, worker.pid, route,
                    type(exc).__name__, exc)
        return PdWorkerLost(f"the prefill/decode worker that held this request ({worker.index}) went away "
                            f"({type(exc).__name__}); retry it", code="pd_worker_lost")

    # ---- stored responses (/v1/responses) ---------------------------------------------------
    async def responses(self, request: Request) -> Response:
        """A response that continues a stored one goes to the worker that stores it (which then
        stores the new one too, if asked); any other as the routing rule says."""
        previous = _previous_response_id(await request.body())
        holder = await self._holder(request, previous) if previous else None
        return await self.one(request, prefer=holder)

    async def stored(self, request: Request, response_id: str) -> Response:
        """GET or DELETE of a stored response: every ready worker is asked, and the one that
        holds it answers (the others' 404 is the answer when none does)."""
        results = await self._fan_out(self._ready_or_refuse(), request.method, _target(request), b"",
                                      self._headers(request.headers.raw))
        answered = [(w, r) for w, r in results if isinstance(r, httpx.Response)]
        if not answered:
            raise PdWorkerLost("every prefill/decode worker went away during the request; retry it")
        worker, reply = next(((w, r) for w, r in answered if r.status_code != 404), answered[0])
        return _buffered(reply.status_code, reply.content, _response_headers(reply, worker))

    async def _holder(self, request: Request, response_id: str) -> PdWorker | None:
        path = f"/v1/responses/{quote(response_id, safe='')}"
        results = await self._fan_out(self.fleet.ready(), "GET", path, b"", self._headers(request.headers.raw))
        return next((w for w, r in results if isinstance(r, httpx.Response) and r.status_code == 200), None)

    # ---- every worker -----------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        """To every ready worker. Stored when every worker that answered stored it (one that
        died meanwhile is given it when it rejoins); else the first refusal, as the worker said it."""
        body = await request.body()
        headers = self._headers(request.headers.raw)
        targets = self._ready_or_refuse()
        results = await self._fan_out(targets, "POST", "/v1/images", body, headers)
        stored = [(w, r) for w, r in results if isinstance(r, httpx.Response) and r.status_code == 200]
        refused = [(w, r) for w, r in results if isinstance(r, httpx.Response) and r.status_code != 200]
        if stored:
            image_id = stored[0][1].json()["id"]
            self.record.add(image_id, body, request.headers.get("content-type", ""))
            # A worker that finished joining while this upload was out had not been sent it.
            late = [w for w in self.fleet.ready() if w not in targets]
            await self._fan_out(late, "POST", "/v1/images", body, headers)
        if refused or stored:
            worker, reply = (refused or stored)[0]
            return _buffered(reply.status_code, reply.content, _response_headers(reply, worker))
        raise PdWorkerLost("every prefill/decode worker went away while it stored the image; retry it")

    async def delete(self, request: Request, image_id: str) -> Response:
        self.record.remove(image_id)  # before the targets are chosen: a joining worker drops it too
        targets = self._ready_or_refuse()
        results = await self._fan_out(targets, "DELETE", _target(request), b"", self._headers(request.headers.raw))
        answered = [(w, r) for w, r in results if isinstance(r, httpx.Response)]
        if not answered:
            raise PdWorkerLost("every prefill/decode worker went away during the delete; retry it")
        worker, reply = next(((w, r) for w, r in answered if r.status_code == 200), answered[0])
        return _buffered(reply.status_code, reply.content, _response_headers(reply, worker))

    async def canary(self, request: Request) -> Response:
        """Each ready worker runs its own grounding canary."""
        targets = self._ready_or_refuse()
        results = await self._fan_out(targets, "POST", "/fovea/canary", b"", self._headers(request.headers.raw))
        out = []
        for worker, reply in results:
            if isinstance(reply, httpx.Response):
                out.append({"index": worker.index, "status": reply.status_code, "body": _json(reply)})
            else:
                out.append({"index": worker.index, "error": f"{type(reply).__name__}: {reply}"})
        return JSONResponse({"pd_workers": out})

    async def join(self, worker: PdWorker) -> None:
        """Before a (re)started worker is ready: the images the others hold."""
        async def upload(item: Upload) -> None:
            reply = await self._send(worker, "POST", "/v1/images", item.body,
                                     {**self.fleet.headers, "content-type": item.content_type})
            if reply.status_code != 200:
                log.warning("PD worker %d refused an uploaded image again: %s", worker.index, reply.text[:200])

        async def delete(image_id: str) -> None:
            await self._send(worker, "DELETE", f"/v1/images/{image_id}", b"", dict(self.fleet.headers))

        await sync(self.record, upload, delete)

    async def fetch(self, worker: PdWorker, path: str, timeout: float) -> httpx.Response:
        assert self.client is not None
        return await self.client.get(worker.url + path, headers=self.fleet.headers, timeout=timeout)

    # ---- plumbing ---------------------------------------------------------------------------
    def _ready_or_refuse(self) -> list[PdWorker]:
        targets = self.fleet.ready()
        if not targets:
            raise PdUnavailable("no prefill/decode worker is ready; retry shortly")
        return targets

    async def _fan_out(self, targets: list[PdWorker], method: str, path: str, body: bytes,
                       headers: list | dict) -> list[tuple[PdWorker, httpx.Response | httpx.TransportError]]:
        async def call(worker: PdWorker) -> httpx.Response | httpx.TransportError:
            worker.in_flight += 1
            try:
                return await self._send(worker, method, path, body, headers)
            except httpx.TransportError as exc:
                self.fleet.suspect(worker)
                return exc
            finally:
                worker.in_flight -= 1

        return list(zip(targets, await asyncio.gather(*(call(w) for w in targets)), strict=True))

    async def _send(self, worker: PdWorker, method: str, path: str, body: bytes, headers: list | dict,
                    stream: bool = False) -> httpx.Response:
        assert self.client is not None, "the proxy is opened in the app's lifespan"
        request = self.client.build_request(method, worker.url + path, content=body or None, headers=headers)
        return await self.client.send(request, stream=stream)

    def _headers(self, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        kept = [(k, v) for k, v in raw if k.decode("latin-1").lower() not in _SKIP_REQUEST]
        return [*kept, (b"authorization", self.fleet.headers["authorization"].encode())]


def _previous_response_id(body: bytes) -> str | None:
    """The body's previous_response_id, if it is a JSON object with one (the worker refuses the rest)."""
    if b"previous_response_id" not in body:  # the usual case: no parse of a body of inline images
        return None
    try:
        value = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _route(request: Request) -> str:
    return getattr(request.scope.get("route"), "path", request.url.path)


def _target(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def _response_headers(upstream: httpx.Response, worker: PdWorker) -> list[tuple[bytes, bytes]]:
    kept = [(k.lower(), v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in _SKIP_RESPONSE]
    return [*kept, (WORKER_HEADER.encode(), str(worker.index).encode())]


def _buffered(status: int, content: bytes, raw_headers: list[tuple[bytes, bytes]]) -> Response:
    response = Response(content, status_code=status)
    response.raw_headers = [*raw_headers, (b"content-length", str(len(content)).encode())]
    return response


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def _json(reply: httpx.Response):
    try:
        return reply.json()
    except ValueError:
        return reply.text[:2000]
