"""``prompt_logprobs`` over HTTP (vLLM's layout) on the demo model: chat on the response, completions
on every choice, the prompt scored once for n choices, the refusals; and the memory plan has no
line for a grounding forward any more (grounding runs through the engine)."""

from __future__ import annotations

import httpx
import pytest
import torch
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes
from fovea.engine.memory.planner import Planner
from fovea.testing.tolerance import assert_close_to_model

URL = data_url(scenes.render(fresh_scene(5100, min_shapes=2)))
CHAT = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                                  {"type": "text", "text": "Describe the image."}]}]}
TEXT = {"prompt": "user: <image> Describe the image. assistant:", "images": [URL]}


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        client.engine = live_server.app.state.fovea.engine
        client.tokenizer = live_server.app.state.fovea.loaded.tokenizer
        client.loaded = live_server.app.state.fovea.loaded
        yield client


def check_layout(entries: list, tokens: list[int], k: int, tokenizer) -> None:
    """``tokens``: the prompt's tokens from the second on."""
    assert len(entries) == len(tokens) + 1 and entries[0] is None
    for token, entry in zip(tokens, entries[1:]):
        own = entry[str(token)]  # the prompt's own token, always there
        assert own["rank"] >= 1 and own["logprob"] <= 0 and own["decoded_token"] == tokenizer.decode([token])
        top = sorted((v for v in entry.values() if v["rank"] <= k), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == list(range(1, k + 1))
        values = [v["logprob"] for v in top]
        assert values == sorted(values, reverse=True) and own["logprob"] <= values[0]
        # The top k, and the own token beside them when it is not among them.
        assert len(entry) == (k if own["rank"] <= k else k + 1)
        if own["rank"] > k:
            assert own["logprob"] <= values[-1]


def prompt_tokens(http, path: str, body: dict) -> tuple[list[int], int]:
    """The prompt's tokens from the second on (prompt_logprobs=0: the own token alone), and its length."""
    scored = http.post(path, json={**body, "max_tokens": 1, "prompt_logprobs": 0}).json()
    entries = scored["prompt_logprobs"] if "prompt_logprobs" in scored else scored["choices"][0]["prompt_logprobs"]
    assert all(len(e) == 1 for e in entries[1:])
    return [int(next(iter(e))) for e in entries[1:]], scored["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_layout_is_vllms(http, path):
    body = CHAT if path.endswith("chat/completions") else TEXT
    tokens, count = prompt_tokens(http, path, body)
    assert len(tokens) == count - 1
    reply = http.post(path, json={**body, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3})
    assert reply.status_code == 200, reply.text
    out = reply.json()
    if path.endswith("chat/completions"):
        assert "prompt_logprobs" not in out["choices"][0]
        entries = out["prompt_logprobs"]
    else:
        assert "prompt_logprobs" not in out
        entries = out["choices"][0]["prompt_logprobs"]
    check_layout(entries, tokens, 3, http.tokenizer)
    assert http.engine.loaded.image_token_id in tokens  # the image's placeholder tokens have entries too
    plain = http.post(path, json={**body, "max_tokens": 2, "temperature": 0}).json()
    assert "prompt_logprobs" not in plain and "prompt_logprobs" not in plain["choices"][0]
    assert plain["choices"][0].get("text", plain["choices"][0].get("message")) == \
        out["choices"][0].get("text", out["choices"][0].get("message"))  # scoring changes no answer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("value", [21, -1, 2.5, "3", True])
def test_out_of_range_values_are_a_400(http, path, value, assert_error):
    body = CHAT if path.endswith("chat/completions") else TEXT
    error = assert_error(http.post(path, json={**body, "prompt_logprobs": value}), 400, "invalid_prompt_logprobs",
                         "prompt_logprobs")
    assert "0 to 20" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streaming_is_refused(http, path, assert_error):
    body = CHAT if path.endswith("chat/completions") else TEXT
    error = assert_error(http.post(path, json={**body, "prompt_logprobs": 1, "stream": True}), 400,
                         "unsupported_parameter", "prompt_logprobs")
    assert "stream" in error["message"]


def test_n_choices_score_the_prompt_once(http):
    before = http.engine.prompts_scored
    out = http.post("/v1/completions", json={**TEXT, "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 3,
                                             "prompt_logprobs": 2}).json()
    assert http.engine.prompts_scored == before + 1
    first, second = (c["prompt_logprobs"] for c in out["choices"])
    assert first == second and first[0] is None and len(first) == out["usage"]["prompt_tokens"]
    before = http.engine.prompts_scored
    chat = http.post("/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 3, "temperature": 1.0,
                                                   "prompt_logprobs": 1}).json()
    assert http.engine.prompts_scored == before + 1 and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_token_id_prompts_and_batches(http):
    ids = http.tokenizer("the red circle is above", add_special_tokens=False)["input_ids"]
    one = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}).json()
    entries = one["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and [int(next(iter(e))) for e in entries[1:]] == ids[1:]
    before = http.engine.prompts_scored
    batch = http.post("/v1/completions", json={"prompt": [ids, ids[:3]], "n": 2, "max_tokens": 1,
                                               "prompt_logprobs": 0}).json()
    assert http.engine.prompts_scored == before + 2  # each prompt once, not each choice
    lists = [c["prompt_logprobs"] for c in batch["choices"]]
    assert lists[0] == lists[1] and len(lists[2]) == 3 and lists[2] == lists[3]  # one scoring per prompt
    # Alone or batched with another prompt: the same tokens and ranks, and log-probabilities equal up
    # to float32 rounding (a batch of other shapes reduces in another order).
    config = http.loaded.model.config
    assert_same_scores(lists[0], entries, config, len(ids))
    assert_same_scores(lists[2], entries[:3], config, 3)


def assert_same_scores(got: list, want: list, config, context: int) -> None:
    assert [e and {k: (v["rank"], v["decoded_token"]) for k, v in e.items()} for e in got] == \
        [e and {k: (v["rank"], v["decoded_token"]) for k, v in e.items()} for e in want]
    a = torch.tensor([v["logprob"] for e in got[1:] for v in e.values()])
    b = torch.tensor([v["logprob"] for e in want[1:] for v in e.values()])
    assert_close_to_model(a, b, config, context, scale=float(b.abs().max()), what="prompt log-probabilities")


def test_the_memory_plan_has_no_grounding_forward(http):
    assert not hasattr(Planner, "_reference_forward")
    memory = httpx.get(str(http.base_url) + "/health").json()["memory"]
    assert not any("grounding" in line["name"] for line in memory["lines"])
