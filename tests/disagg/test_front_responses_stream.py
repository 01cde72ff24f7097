"""A PD worker that goes away in the middle of a stream: the front ends a Responses API stream with
that API's own error event (next in its sequence), a chat stream with chat's error and [DONE], and
adds nothing to a stream that had already ended."""

from __future__ import annotations

import asyncio
import json

import httpx

from fovea.front.metrics import FrontMetrics
from fovea.front.pd_fleet import PdFleet
from fovea.front.proxy import Proxy
from fovea.front.uploads import UploadRecord


class CutUpstream:
    """A worker's streamed reply that breaks off after ``events``."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events

    async def aiter_raw(self):
        for event in self.events:
            yield event
        raise httpx.ReadError("the worker went away")


def relay(route: str, events: list[bytes]) -> bytes:
    fleet = PdFleet(1, [], [], "key", b"key")
    proxy = Proxy(fleet, FrontMetrics(), UploadRecord(1 << 20, 60.0))

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in proxy._events(fleet.workers[0], CutUpstream(events), route)])

    return asyncio.run(collect())


def sse(kind: str, sequence: int) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence})}\n\n".encode()


def test_a_cut_responses_stream_ends_with_its_own_error_event():
    out = relay("/v1/responses", [sse("response.created", 0), sse("response.output_text.delta", 1)]).decode()
    *events, last = [e for e in out.split("\n\n") if e]
    assert len(events) == 2 and last.startswith("event: error\ndata: ")
    error = json.loads(last.split("data: ", 1)[1])
    assert error["type"] == "error" and error["sequence_number"] == 2 and error["code"] == "pd_worker_lost"
    assert "[DONE]" not in out


def test_a_finished_responses_stream_gets_nothing_added():
    events = [sse("response.created", 0), sse("response.completed", 1)]
    assert relay("/v1/responses", events) == b"".join(events)


def test_a_cut_chat_stream_still_ends_with_chats_error_and_done():
    out = relay("/v1/chat/completions", [b'data: {"choices": []}\n\n']).decode()
    assert out.endswith("data: [DONE]\n\n") and '"code":"pd_worker_lost"' in out
