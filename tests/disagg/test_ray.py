"""``--topology e_pd --ray-address``: encode workers as actors on a local Ray cluster."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from scene_helpers import free_port, fresh_scene, start_server, stop_server
from test_e_pd import agg_answers, ask_all, health

from fovea.config import ServerSettings
from fovea.demo import scenes

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_e_pd(demo_model):
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20)
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False,
                              topology="e_pd", encode_workers=2, encode_timeout_s=20.0, ray_address="local")
    live, server, thread = start_server(settings, demo_model)
    yield live
    stop_server(server, thread)
    ray.shutdown()


def test_answers_equal_agg_and_a_killed_actor_is_replaced(ray_e_pd, demo_model):
    images = [scenes.render(fresh_scene(70_000 + i)) for i in range(20)]
    expected = agg_answers(demo_model, images)
    replies = asyncio.run(ask_all(ray_e_pd.base_url, images[:12]))
    assert [r.status_code for r in replies] == [200] * 12, [r.text for r in replies if r.status_code != 200][:2]
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == expected[:12]
    assert all(w["state"] == "ready" and w["plan"]["weights_bytes"] > 0 for w in health(ray_e_pd)["encode_workers"])

    pool = ray_e_pd.app.state.fovea.engine.runner.embedder.images.encode.__self__
    ray.kill(pool.workers[0].channel.actor)  # the actor dies; the pool learns it at its next batch
    again = asyncio.run(ask_all(ray_e_pd.base_url, images[12:]))  # new images: the encoder cache has none
    assert [r.status_code for r in again] == [200] * 8
    assert [r.json()["choices"][0]["message"]["content"] for r in again] == expected[12:]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        workers = health(ray_e_pd)["encode_workers"]
        if sum(w["restarts"] for w in workers) >= 1 and all(w["state"] == "ready" for w in workers):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the killed actor was not replaced: {workers}")
    assert httpx.get(ray_e_pd.base_url + "/health", timeout=30).json()["status"] == "ok"
