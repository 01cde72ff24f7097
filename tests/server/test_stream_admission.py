"""Admission before a stream starts: a request the server will not queue is refused (429 with
Retry-After) before any byte of a stream, and a stream that began ends with a finish_reason and
[DONE], or with an error event and [DONE], never by just stopping."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

QUEUE = 2
MESSAGES = [{"role": "user", "content": "Describe the image."}]


def events_of(lines: list[str]) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


@pytest.fixture(scope="module")
def small_queue(make_server):
    return make_server(max_queue=QUEUE, max_batch_size=1)


async def one_stream(client: httpx.AsyncClient, path: str, i: int) -> tuple[int, dict, list[str], bytes]:
    body = {"max_tokens": 64, "ignore_eos": True, "stream": True, "seed": i}  # held long enough to overlap
    body |= {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "a red circle"}
    async with client.stream("POST", path, json=body) as reply:
        raw = await reply.aread()
        lines = raw.decode().splitlines()
        return reply.status_code, dict(reply.headers), lines, raw


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_more_streams_than_the_queue_each_end_or_are_refused_before_they_start(small_queue, path):
    async def burst():
        async with httpx.AsyncClient(base_url=small_queue.base_url, timeout=300) as client:
            return await asyncio.gather(*(one_stream(client, path, i) for i in range(24)))

    results = asyncio.run(burst())
    refused = answered = 0
    for status, headers, lines, raw in results:
        if status == 429:
            refused += 1
            assert headers["retry-after"] and headers["content-type"].startswith("application/json")
            assert json.loads(raw)["error"]["code"] == "server_overloaded"
            continue
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), (status, raw[:300])
        answered += 1
        events = events_of(lines)
        assert events[-1] == "[DONE]", raw[-300:]  # never a stream that just stops
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), raw[-300:]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # The burst is larger than what one running sequence, its waiting slot and a queue of 2 hold.
    assert refused and answered, (refused, answered)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "a red circle"}),
    ("/generate", {"prompt": "Describe the image."}),
    ("/v1/responses", {"input": "hello"}),
])
def test_a_full_queue_refuses_before_the_request_is_preprocessed(small_queue, monkeypatch, path, body):
    """Under a flood each refusal would otherwise pay for its images' fetch and decode first."""
    state = small_queue.app.state.fovea
    prepared = []

    async def counted(*args, **kwargs):
        prepared.append(args)
        return await original(*args, **kwargs)

    original = state.preprocessor.prompts
    monkeypatch.setattr(state.preprocessor, "prompts", counted)
    monkeypatch.setattr(state.engine._queue, "full", lambda: True)  # as if QUEUE requests were waiting
    streamed = {} if path == "/generate" else {"stream": True}  # /generate does not stream
    reply = httpx.post(small_queue.base_url + path, json=body | streamed, timeout=60)
    assert reply.status_code == 429 and reply.headers["retry-after"], reply.text[:300]
    assert reply.json()["error"]["code"] == "server_overloaded"
    assert prepared == []
    monkeypatch.undo()  # the queue has room again: the same request is prepared and answered
    monkeypatch.setattr(state.preprocessor, "prompts", counted)
    length = {"max_output_tokens": 2} if path == "/v1/responses" else {"max_tokens": 2}
    reply = httpx.post(small_queue.base_url + path, json=body | length, timeout=120)
    assert reply.status_code == 200 and prepared, reply.text[:300]


def test_a_failure_after_a_stream_began_ends_it_with_an_error_event(make_server, monkeypatch):
    """Not a FoveaError, raised in the stream's body after the 200: the client still gets an
    error event and [DONE], and no finish_reason."""
    live = make_server()
    state = live.app.state.fovea

    def broken(*args, **kwargs):
        raise RuntimeError("metrics backend gone")

    monkeypatch.setattr(state.metrics, "observe_finish", broken)
    with httpx.Client(base_url=live.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 4, "stream": True}) as reply:
            assert reply.status_code == 200
            events = events_of(list(reply.iter_lines()))
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "engine_error" and "metrics backend gone" in last["error"]["message"]
        assert not any(c["choices"][0].get("finish_reason") for c in map(json.loads, events[:-2]) if c.get("choices"))

        with client.stream("POST", "/v1/responses", json={"input": "hello", "max_output_tokens": 4,
                                                         "stream": True}) as reply:
            assert reply.status_code == 200
            kinds = [line[7:] for line in reply.iter_lines() if line.startswith("event: ")]
        assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "a"})):
            with client.stream("POST", path, json={
                    **body, "max_tokens": 6, "ignore_eos": True, "stream": True, "n": 2,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as reply:
                assert reply.status_code == 200
                events = events_of(list(reply.iter_lines()))
            chunks = [json.loads(e) for e in events[:-1]]
            assert all("usage" in c for c in chunks), path
            completions = [c["usage"]["completion_tokens"] for c in chunks]
            assert completions == sorted(completions) and completions[-1] == 12  # 2 choices x 6 tokens
            prompt = chunks[-1]["usage"]["prompt_tokens"]
            assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
            assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
            assert chunks[-1]["choices"] == []  # include_usage's own last chunk is still there
            # Without it, only the last chunk carries usage.
            with client.stream("POST", path, json={**body, "max_tokens": 3, "stream": True,
                                                   "stream_options": {"include_usage": True}}) as reply:
                plain = [json.loads(e) for e in events_of(list(reply.iter_lines()))[:-1]]
            assert [("usage" in c) for c in plain] == [False] * (len(plain) - 1) + [True]
