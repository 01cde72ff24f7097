"""Structured outputs on the demo model at temperature 0, with questions that make the allowed
words unlikely (issue 23, item 10).

The demo's word-level vocabulary has "on" beside "one", and no token for a lone "e" or a space:
a grammar may begin "on" or "a" (of "a red circle") and then have nothing to go on. Greedy
decoding over "Describe the image." picks exactly those tokens when they are allowed, so each
answer here would fail halfway without the masks' dead-end check.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from scene_helpers import data_url

from fovea.demo import scenes

CIRCLE = scenes.Scene(128, 128, (scenes.Shape("red", "circle", 4, 0.5, (0.5, 0.5), (0, 0, 0)),))
CASES = [  # (structured_outputs, what the answer must match)
    ({"choice": ["one", "two", "three"]}, "one|two|three"),
    ({"regex": "(one|two|three)"}, "one|two|three"),
    ({"choice": ["a red circle", "one"]}, "a red circle|one"),
]


def body(question: str, structured: dict, **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": data_url(scenes.render(CIRCLE))}},
               {"type": "text", "text": question}]
    return {"model": "fovea-shapes", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 8, "structured_outputs": structured, **extra}


def streamed(response: httpx.Response) -> tuple[str, str | None]:
    """The text and finish reason of an SSE chat stream that must end with [DONE]."""
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    text, finish = "", None
    for line in lines[:-1]:
        chunk = json.loads(line)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


@pytest.mark.parametrize(("structured", "allowed"), CASES, ids=["choice", "regex", "choice-with-a-phrase"])
def test_greedy_answer_over_unlikely_words(live_server, structured, allowed):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
        reply = client.post("/v1/chat/completions", json=body("Describe the image.", structured))
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert re.fullmatch(allowed, choice["message"]["content"]) and choice["finish_reason"] == "stop", choice
        with client.stream("POST", "/v1/chat/completions",
                           json=body("Describe the image.", structured, stream=True)) as response:
            assert response.status_code == 200
            text, finish = streamed(response)
        assert text == choice["message"]["content"] and finish == "stop"


def test_greedy_answers_in_a_batch_with_free_text(live_server):
    """The same requests sharing steps with free-text ones: more structured rows than
    PARALLEL_FILL_ROWS, so masks are filled by xgrammar's batch fill as well as row by row."""
    async def together():
        async with httpx.AsyncClient(base_url=live_server.base_url, timeout=120) as client:
            jobs = [client.post("/v1/chat/completions", json=body("Describe the image.", s)) for s, _ in CASES * 6]
            free = {k: v for k, v in body("Describe the image.", {}).items() if k != "structured_outputs"}
            jobs += [client.post("/v1/chat/completions", json=free) for _ in range(4)]
            return await asyncio.gather(*jobs)

    replies = asyncio.run(together())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    for reply, (_, allowed) in zip(replies, CASES * 6):
        assert re.fullmatch(allowed, reply.json()["choices"][0]["message"]["content"])
    free = {r.json()["choices"][0]["message"]["content"] for r in replies[len(CASES) * 6:]}
    assert len(free) == 1 and "circle" in free.pop()  # greedy free text: one answer, about the picture


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_grammar_the_vocabulary_cannot_finish_is_refused_before_the_answer(live_server, stream):
    """No token spells the space of "red circle": a 400 before any byte of an answer."""
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
        reply = client.post("/v1/chat/completions", json=body("Describe the image.", {"choice": ["red circle"]},
                                                              stream=stream))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "grammar_unsatisfiable" and error["param"] == "structured_outputs.choice", error
