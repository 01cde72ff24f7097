"""Memory through HTTP: the plan in /health, out-of-memory recovery counted in /metrics, and a
request that can never fit answered with an error, never a truncated answer that looks finished."""

import json

import httpx
import pytest
import torch
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes


def body(seed: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(scenes.render(fresh_scene(seed)))}},
        {"type": "text", "text": "Describe the image."}]}], "temperature": 0, **extra}


@pytest.fixture
def server(make_server):
    live = make_server()
    engine = live.app.state.fovea.engine
    execute = engine.runner.execute
    yield live, engine
    engine.runner.execute = execute  # the server is the session's: leave it healthy


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_health_shows_the_memory_plan(server):
    live, engine = server
    health = httpx.get(live.base_url + "/health").json()
    memory = health["memory"]
    assert 0 < health["kv_free_share"] <= 1  # what a front routes by
    names = [line["name"] for line in memory["lines"]]
    assert names[:2] == ["weights", "kv_cache"] and "encoder cache" in names
    assert memory["kv_cache"]["blocks"] == engine.block_manager.num_blocks
    assert memory["planned_bytes"] == sum(line["bytes"] for line in memory["lines"])


def test_big_steps_that_run_out_of_memory_are_retried_and_counted(server):
    live, engine = server
    execute = engine.runner.execute

    def small_steps_only(plan, previous=None):
        if plan.num_tokens > 80:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return execute(plan, previous)

    before = metric(live.base_url, "fovea_oom_recoveries_total")
    engine.runner.execute = small_steps_only
    with httpx.Client(timeout=60) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # together: their prefills share steps
            replies = list(pool.map(lambda s: client.post(live.base_url + "/v1/chat/completions", json=body(s)),
                                    range(2000, 2004)))
    for seed, reply in zip(range(2000, 2004), replies):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == scenes.describe_answer(fresh_scene(seed))
    assert metric(live.base_url, "fovea_oom_recoveries_total") > before


def test_a_request_that_never_fits_ends_with_an_error_event_then_done(server):
    live, engine = server
    execute = engine.runner.execute

    def never(plan, previous=None):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    engine.runner.execute = never
    with httpx.stream("POST", live.base_url + "/v1/chat/completions", json=body(2100, stream=True),
                      timeout=60) as reply:
        assert reply.status_code == 200
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "out_of_memory" and error["type"] == "server_error" and "even alone" in error["message"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # nothing looks finished

    plain = httpx.post(live.base_url + "/v1/chat/completions", json=body(2101), timeout=60)
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "out_of_memory"

    engine.runner.execute = execute  # memory is back: the same server answers again
    reply = httpx.post(live.base_url + "/v1/chat/completions", json=body(2200), timeout=60)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == scenes.describe_answer(fresh_scene(2200))
