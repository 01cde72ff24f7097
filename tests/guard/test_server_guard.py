"""The guard as a client sees it: /health, --strict, forced overrides, grounding scores, /metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from scene_helpers import data_url, free_port, fresh_scene, start_server, stop_server
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.loading.loader import load_model
from fovea.models.clip_vision import vision_modules


def settings(**kw) -> ServerSettings:
    return ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", canary_interval_s=0, **kw)


def ask(base: str, question: str, image=None, **extra) -> httpx.Response:
    content = ([{"type": "image_url", "image_url": {"url": data_url(image)}}] if image is not None else []) + [
        {"type": "text", "text": question}]
    return httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], **extra},
                      timeout=60)


@pytest.fixture(scope="module")
def guarded(demo_model):
    live, server, thread = start_server(settings(), demo_model)
    yield live.base_url
    stop_server(server, thread)


def test_health_reports_the_contract_and_a_passing_canary(guarded):
    health = httpx.get(guarded + "/health").json()
    assert health["status"] == "ok" and health["reasons"] == []
    assert health["canary"]["ok"] and health["canary"]["answers"] == {"red": "red", "blue": "blue", "green": "green"}
    assert health["canary"]["min_ablation_kl"] > health["canary"]["threshold"]
    assert health["probe_image_tokens"] == [64, 64] and health["vision_dtype"] == "float32"


def test_grounding_score_separates_image_answers_from_text_answers(guarded):
    scene = fresh_scene(31)
    reply = ask(guarded, "Describe the image.", scenes.render(scene), fovea={"grounding": True}).json()
    grounding = reply["fovea"]["grounding"]
    assert reply["choices"][0]["message"]["content"] == scenes.describe_answer(scene)
    assert grounding["image_dependent"] is True and grounding["max_kl"] > grounding["threshold"]
    assert grounding["scored_tokens"] == len(grounding["kl_per_token"]) > 1
    text_only = ask(guarded, "Describe the image.", fovea={"grounding": True}).json()
    assert text_only["fovea"]["grounding"]["image_dependent"] is None
    plain = ask(guarded, "Describe the image.", scenes.render(scene)).json()
    assert "fovea" not in plain


def test_metrics_are_scraped_after_traffic(guarded):
    scene = fresh_scene(32)
    assert ask(guarded, "How many shapes are there?", scenes.render(scene)).status_code == 200
    assert ask(guarded, "Describe the image.", scenes.render(scene)).status_code == 200  # several tokens: a TPOT
    bad = httpx.post(guarded + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert bad.status_code == 400
    text = httpx.get(guarded + "/metrics").text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples["fovea_vision_encoder_latency_ms_count"] >= 1
    assert samples['fovea_modality_mismatch_errors_total{reason="invalid_image"}'] >= 1
    assert samples['fovea_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert samples['fovea_requests_total{route="/v1/chat/completions",status="400"}'] >= 1
    assert samples["fovea_time_to_first_token_seconds_count"] >= 1
    assert samples["fovea_time_per_output_token_seconds_count"] >= 1
    assert samples["fovea_oom_recoveries_total"] == 0
    assert samples["fovea_canary_status"] == 1.0 and samples["fovea_canary_last_ablation_kl"] > 0
    assert "fovea_queue_depth" in samples
    # The engine worker's steps and where their time went (the two answers above took steps).
    phases = {name: value for name, value in samples.items() if name.startswith("fovea_engine_step_phase_seconds")}
    assert samples["fovea_engine_steps_total"] >= 2
    assert set(phases) == {f'fovea_engine_step_phase_seconds_total{{phase="{p}"}}'
                           for p in ("schedule", "embed", "forward", "sample_wait", "emit")}
    assert phases['fovea_engine_step_phase_seconds_total{phase="embed"}'] > 0  # two images were embedded
    assert samples["fovea_encoder_cache_hits_total"] + samples["fovea_encoder_cache_misses_total"] >= 1


def test_the_encoder_cache_encodes_a_repeated_image_once(guarded):
    def counts():
        text = httpx.get(guarded + "/metrics").text
        get = lambda name: next(float(l.split()[1]) for l in text.splitlines() if l.startswith(name + " "))
        return get("fovea_encoder_cache_hits_total"), get("fovea_encoder_cache_misses_total")

    image = scenes.render(fresh_scene(33))
    hits0, misses0 = counts()
    ask(guarded, "How many shapes are there?", image)
    ask(guarded, "Describe the image.", image)
    hits1, misses1 = counts()
    assert misses1 - misses0 == 1 and hits1 - hits0 == 1


def test_blind_model_degrades_health_and_strict_answers_503():
    loaded = load_model(None, device="cpu", dtype="float32")
    live, server, thread = start_server(settings(), loaded)
    try:
        assert httpx.get(live.base_url + "/health").json()["status"] == "ok"
        with torch.no_grad():  # the projector dies while serving; the next canary run notices
            vision_modules(loaded)[1].linear_2.weight.zero_()
            vision_modules(loaded)[1].linear_2.bias.zero_()
        state = live.app.state.fovea
        state.engine.encoder_cache.clear()
        run = httpx.post(live.base_url + "/fovea/canary", timeout=60).json()
        assert run["ok"] is False and run["min_ablation_kl"] <= run["threshold"]
        health = httpx.get(live.base_url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert any("image ignored" in r for r in health.json()["reasons"])
        state.settings.strict = True
        assert httpx.get(live.base_url + "/health").status_code == 503
    finally:
        stop_server(server, thread)


# uvicorn's thread ends with SystemExit when the app's start-up fails: that is the refusal.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_strict_refuses_to_start_with_a_blind_model():
    from fovea.serve.app import create_app
    from fovea.serve.canary_lifecycle import CanaryFailed

    loaded = load_model(None, device="cpu", dtype="float32")
    with torch.no_grad():
        for p in vision_modules(loaded)[1].parameters():
            p.zero_()

    async def start_up() -> None:
        app = create_app(settings(strict=True), loaded)
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(CanaryFailed, match="--strict: the grounding canary failed at start-up"):
        asyncio.run(start_up())
    with pytest.raises(RuntimeError, match="did not start"):
        start_server(settings(strict=True), loaded)


def test_a_forced_imagenet_override_is_reported_in_health():
    loaded = load_model(None, device="cpu", dtype="float32")
    override = {"image_mean": list(IMAGENET_DEFAULT_MEAN), "image_std": list(IMAGENET_DEFAULT_STD)}
    live, server, thread = start_server(settings(processor_override=override, force_processor_override=True), loaded)
    try:
        health = httpx.get(live.base_url + "/health").json()
        assert health["processor_override"]["image_std"] == list(IMAGENET_DEFAULT_STD)
        assert any("override forced" in w for w in health["warnings"])
    finally:
        stop_server(server, thread)
