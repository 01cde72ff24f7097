"""--encode-device: the encode workers on a device of their own (the vision tower on cuda:1 beside
a language model on cuda:0 is a supported layout, not an accident). On CPU: the flag's refusals
and its path; tests/gpu/test_e_pd_two_gpus.py runs both layouts where two GPUs exist."""

from __future__ import annotations

import httpx
import pytest
import torch
from scene_helpers import free_port, fresh_scene, start_server, stop_server
from test_e_pd import agg_answers, body

from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.errors import ModelLoadError
from fovea.serve.app import create_app


def settings(**fields) -> ServerSettings:
    return ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False, **fields)


def test_it_places_encode_workers_so_agg_and_ray_refuse_it():
    with pytest.raises(ValueError, match="--encode-device places the encode workers: it needs --topology e_pd"):
        settings(encode_device="cuda:1")
    with pytest.raises(ValueError, match="--encode-device places local encode workers; on Ray"):
        settings(topology="e_pd", encode_device="cuda:1", ray_address="local")


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="cuda:3 exists here")
def test_a_device_this_machine_lacks_is_refused_at_start_naming_the_flag(demo_model):
    with pytest.raises(ModelLoadError, match="--encode-device cuda:3 was asked for"):
        create_app(settings(topology="e_pd", encode_device="cuda:3"), demo_model)


def test_the_encode_worker_runs_on_the_device_named_and_answers_as_agg(demo_model):
    live, server, thread = start_server(settings(topology="e_pd", encode_workers=1, encode_device="cpu"), demo_model)
    try:
        images = [scenes.render(fresh_scene(seed)) for seed in (3, 4)]
        answers = [httpx.post(live.base_url + "/v1/chat/completions", json=body(im), timeout=120)
                   .json()["choices"][0]["message"]["content"] for im in images]
        worker = httpx.get(live.base_url + "/health", timeout=30).json()["encode_workers"][0]
    finally:
        stop_server(server, thread)
    assert worker["plan"]["device"] == "cpu"
    assert answers == agg_answers(demo_model, images)
