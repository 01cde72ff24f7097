"""RequestGate, the API-key check and request counter, driven as a bare ASGI app."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from fovea.serve.request_gate import RequestGate

KEY = "k3y"


def inner_app(calls: list[str], *, chunks: int = 3, fail_before: bool = False, fail_after: bool = False):
    """Streams ``chunks`` body messages, like an SSE completion, after setting the route."""
    async def app(scope, receive, send):
        calls.append(scope["path"])
        scope["route"] = SimpleNamespace(path="/v1/chat/completions")  # as the router does
        if fail_before:
            raise RuntimeError("boom before the response")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(chunks):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            if fail_after:
                raise RuntimeError("boom mid-stream")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


def call(gate: RequestGate, path: str = "/v1/chat/completions", headers: list | None = None) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": headers or []}
    asyncio.run(gate(scope, receive, send))
    return sent


def gate_with(app, api_key: str | None = None) -> tuple[RequestGate, list[tuple[str, int]]]:
    counted: list[tuple[str, int]] = []
    return RequestGate(app, api_key, lambda route, status: counted.append((route, status))), counted


def test_without_a_key_every_message_passes_through_and_is_counted_once():
    calls: list[str] = []
    gate, counted = gate_with(inner_app(calls, chunks=3))
    sent = call(gate)
    assert calls == ["/v1/chat/completions"]
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 4
    assert [m.get("body") for m in sent[1:4]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert counted == [("/v1/chat/completions", 200)]


@pytest.mark.parametrize("headers", [[], [(b"authorization", b"Bearer wrong")], [(b"authorization", KEY.encode())],
                                     [(b"authorization", f"bearer {KEY}".encode())]])
def test_a_missing_or_wrong_key_is_refused_with_401_before_the_app_runs(headers):
    calls: list[str] = []
    gate, counted = gate_with(inner_app(calls), api_key=KEY)
    sent = call(gate, headers=headers)
    assert calls == []
    start, body = sent
    assert start["status"] == 401 and (b"www-authenticate", b"Bearer") in start["headers"]
    assert (b"content-length", str(len(body["body"])).encode()) in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == "invalid_api_key"
    assert counted == [("unmatched", 401)]


def test_the_right_key_passes_and_health_needs_none():
    calls: list[str] = []
    gate, counted = gate_with(inner_app(calls, chunks=1), api_key=KEY)
    assert call(gate, headers=[(b"authorization", f"Bearer {KEY}".encode())])[0]["status"] == 200
    assert call(gate, path="/health")[0]["status"] == 200
    assert calls == ["/v1/chat/completions", "/health"]
    assert [status for _, status in counted] == [200, 200]


@pytest.mark.parametrize("path", ["/", "/playground/app.js", "/playground/grounding.js"])
def test_the_playground_page_and_its_scripts_need_no_key(path):
    """The page loads before anyone types a key into it: without one of its scripts it breaks."""
    calls: list[str] = []
    gate, _ = gate_with(inner_app(calls, chunks=1), api_key=KEY)
    assert call(gate, path=path)[0]["status"] == 200 and calls == [path]


def test_an_exception_before_the_response_counts_as_500_and_still_propagates():
    gate, counted = gate_with(inner_app([], fail_before=True))
    with pytest.raises(RuntimeError, match="before"):
        call(gate)
    assert counted == [("/v1/chat/completions", 500)]


def test_an_exception_mid_stream_is_not_counted_twice():
    gate, counted = gate_with(inner_app([], fail_after=True))
    with pytest.raises(RuntimeError, match="mid-stream"):
        call(gate)
    assert counted == [("/v1/chat/completions", 200)]


def test_non_http_scopes_go_straight_through():
    seen: list[str] = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    gate, counted = gate_with(app, api_key=KEY)
    asyncio.run(gate({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"] and counted == []
