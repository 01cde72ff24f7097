"""``fovea serve --topology e_pd`` on the demo model: encode workers apart, the same answers as agg.

The encode workers are real processes (spawned, vision weights only). Requests go over HTTP
with drawn scenes; the reference answers come from the aggregated engine on the same pixels.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
from scene_helpers import data_url, free_port, fresh_scene, run_all, start_server, stop_server

from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.prompt import encode_prompt, render_chat

QUESTION = "Describe the image."


def body(image) -> dict:
    return {"model": "fovea-shapes", "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": QUESTION}]}]}


@pytest.fixture(scope="module")
def e_pd(demo_model):
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False,
                              topology="e_pd", encode_workers=2, encode_timeout_s=5.0, max_queue=1024)
    live, server, thread = start_server(settings, demo_model)
    yield live
    stop_server(server, thread)


def agg_answers(model, images) -> list[str]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompts = [encode_prompt(model, render_chat(model, messages), [image]) for image in images]
    results = run_all(PagedEngine(model, PagedEngineConfig(num_blocks=512)),
                      [(p, SamplingParams(max_tokens=40, temperature=0)) for p in prompts])
    return [finish.text for _, finish in results]


async def ask_all(base: str, images) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body(im)) for im in images))


def health(live) -> dict:
    return httpx.get(live.base_url + "/health", timeout=30).json()


def test_256_concurrent_requests_all_answered_each_as_agg_answers_it(e_pd, demo_model):
    images = [scenes.render(fresh_scene(20_000 + i)) for i in range(256)]
    replies = asyncio.run(ask_all(e_pd.base_url, images))
    assert [r.status_code for r in replies] == [200] * 256, [r.text for r in replies if r.status_code != 200][:3]
    got = [r.json()["choices"][0]["message"]["content"] for r in replies]
    assert got == agg_answers(demo_model, images)
    workers = health(e_pd)["encode_workers"]
    assert len(workers) == 2 and all(w["state"] == "ready" for w in workers)
    assert sum(w["batches"] for w in workers) >= 2 and all(w["batches"] > 0 for w in workers)  # both used
    # Their images were sent to the encoders when each request was admitted, not at its prefill.
    assert e_pd.app.state.fovea.engine.runner.embedder.images.prefetch_hits >= 200


def _wait_ready(live, restarts: int, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = health(live)["encode_workers"]
        if sum(w["restarts"] for w in workers) >= restarts and all(w["state"] == "ready" for w in workers):
            return workers
        time.sleep(0.2)
    raise AssertionError(f"the encode workers did not come back: {workers}")


def test_a_killed_encode_worker_loses_no_request_and_rejoins(e_pd, demo_model):
    before = sum(w["restarts"] for w in health(e_pd)["encode_workers"])
    images = [scenes.render(fresh_scene(30_000 + i)) for i in range(48)]

    async def main():
        pending = asyncio.ensure_future(ask_all(e_pd.base_url, images))
        await asyncio.sleep(0.3)  # requests in flight, images being encoded
        os.kill(health(e_pd)["encode_workers"][0]["pid"], signal.SIGKILL)
        return await pending

    replies = asyncio.run(main())
    ok = [r for r in replies if r.status_code == 200]
    # Each request is answered, or refused with 503 encoder_unavailable: never dropped, never text-only.
    assert all(r.status_code == 200 or r.json()["error"]["code"] == "encoder_unavailable" for r in replies)
    assert len(ok) >= len(images) - 8  # its batch went to the other worker
    expected = dict(zip(range(len(images)), agg_answers(demo_model, images)))
    for index, reply in enumerate(replies):
        if reply.status_code == 200:
            assert reply.json()["choices"][0]["message"]["content"] == expected[index]
    _wait_ready(e_pd, before + 1)
    again = asyncio.run(ask_all(e_pd.base_url, images[:4]))
    assert [r.status_code for r in again] == [200] * 4


def test_a_hung_encode_worker_is_timed_out_and_replaced(e_pd, demo_model):
    before = sum(w["restarts"] for w in health(e_pd)["encode_workers"])
    workers = health(e_pd)["encode_workers"]
    # The worker the router picks next (fewest batches, then lowest index): alive, never answers.
    next_up = min(workers, key=lambda w: (w["batches"], w["index"]))
    os.kill(next_up["pid"], signal.SIGSTOP)
    images = [scenes.render(fresh_scene(40_000 + i)) for i in range(8)]
    started = time.monotonic()
    replies = asyncio.run(ask_all(e_pd.base_url, images))
    assert time.monotonic() - started < 60  # bounded by the 5 s encode timeout, not hung
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200][:2]
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == agg_answers(demo_model, images)
    _wait_ready(e_pd, before + 1)


def test_the_pool_refuses_embeddings_from_other_vision_weights(demo_model):
    from fovea.disagg.encoder_pool import EncoderPool
    from fovea.disagg.handoff import HandoffMismatch
    from fovea.loading.contract import check_contract

    contract = check_contract(demo_model)
    pool = EncoderPool(demo_model.path, workers=1, device="cpu", dtype="float32", model_id=contract.model_fingerprint,
                       recipe_fingerprint=contract.recipe_fingerprint, hidden=contract.lm_hidden).start()
    try:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        prompt = encode_prompt(demo_model, render_chat(demo_model, messages), [scenes.render(fresh_scene(50_000))])
        rows = pool.encode(prompt.images)
        assert rows[0].shape == (64, contract.lm_hidden)
        plan = pool.status()[0]["plan"]  # the worker's own plan: its vision weights, on CPU no measured peak
        vision = sum(t.numel() * t.element_size() for m in demo_model.adapter.vision_modules(demo_model.model)
                     for t in [*m.parameters(), *m.buffers()])
        assert plan["weights_bytes"] == vision and plan["activation_bytes"] is None
        pool.vision_fingerprint = "weights-of-another-model"  # what this PD side expects from now on
        with pytest.raises(HandoffMismatch) as info:
            pool.encode(prompt.images)
        assert info.value.reason == "vision_weights"
    finally:
        pool.stop()


def test_a_worker_killed_between_batches_is_restarted_without_traffic(e_pd):
    before = sum(w["restarts"] for w in health(e_pd)["encode_workers"])
    os.kill(health(e_pd)["encode_workers"][1]["pid"], signal.SIGKILL)
    workers = _wait_ready(e_pd, before + 1)  # no request is sent meanwhile: the supervisor notices
    assert workers[1]["restarts"] >= 1


def test_the_metrics_count_each_images_hand_off(e_pd):
    text = httpx.get(e_pd.base_url + "/metrics", timeout=30).text
    count = next(float(line.split()[1]) for line in text.splitlines()
                 if line.startswith("fovea_embedding_handoff_seconds_count"))
    assert count >= 256  # the 256 concurrent requests' images at least, each measured


def test_an_encode_worker_patches_qwen_images_as_the_engine_does(tmp_path):
    """Qwen-VL images reach an encode worker as the API process resized them (uint8), or at their
    decoded size (the resize deferred, as on CUDA): the worker resizes them to their grid,
    rescales, normalises and patches them as the engine's own vision stage does, and refuses
    images resized under a recipe other than its own reading of the model directory."""
    from PIL import Image

    from fovea.disagg.encoder_pool import EncoderFailed, EncoderPool
    from fovea.loading.contract import check_contract, probe_chat, vision_row_width
    from fovea.loading.loader import load_model
    from fovea.testing.random_qwen2_5_vl import write_model_dir
    from fovea.testing.tolerance import assert_close_for

    qwen = load_model(write_model_dir(tmp_path / "qwen", arch="tiny", seed=3), "cpu", "float32")
    contract = check_contract(qwen)
    images = [Image.effect_noise((300, 200), 50).convert("RGB"), Image.effect_noise((64, 90), 70).convert("RGB")]
    prompt = qwen.codec.encode(qwen.codec.render(probe_chat(2)), images)
    assert all(image.pixels.dtype == torch.uint8 for image in prompt.images)
    pool = EncoderPool(qwen.path, workers=1, device="cpu", dtype="float32", model_id=contract.model_fingerprint,
                       recipe_fingerprint=contract.recipe_fingerprint, hidden=vision_row_width(qwen)).start()
    try:
        rows = pool.encode(prompt.images)
        local = qwen.adapter.vision_forward(qwen)(prompt.images)
        for ours, theirs in zip(rows, local, strict=True):
            assert ours.shape == theirs.shape
            assert_close_for(ours, theirs, torch.float32, 64)
        # As served on a GPU: the images cross at their decoded size and the worker resizes them first.
        qwen.codec.resize_on_device = True
        deferred = qwen.codec.encode(qwen.codec.render(probe_chat(2)), images).images
        assert [tuple(image.pixels.shape) for image in deferred] == [(200, 300, 3), (90, 64, 3)]
        assert [image.grid for image in deferred] == [image.grid for image in prompt.images]
        for ours, theirs in zip(pool.encode(deferred), local, strict=True):
            assert ours.shape == theirs.shape
            assert_close_for(ours, theirs, torch.float32, 64)
        pool.recipe_fingerprint = "a-recipe-with-another-mean"  # e.g. a --processor-override on the PD side
        for sent in (prompt.images, deferred):
            with pytest.raises(EncoderFailed, match="processor-override"):
                pool.encode(sent)
    finally:
        pool.stop()


def test_a_processor_override_with_qwen_in_e_pd_is_refused_at_start_up(tmp_path, demo_model, monkeypatch):
    """Encode workers patch Qwen-VL's resized images with the model directory's recipe, so an
    override would fail every image request there: the server refuses it before any worker starts.
    LLaVA-style models send pixels normalised in the API process, override applied, and start."""
    from fovea.config import ServerSettings
    from fovea.disagg import encoder_pool
    from fovea.errors import ModelLoadError
    from fovea.loading.contract import check_contract
    from fovea.loading.loader import load_model
    from fovea.serve.app import sends_resized_images, start_encode_workers
    from fovea.testing.random_qwen2_5_vl import write_model_dir

    qwen = load_model(write_model_dir(tmp_path / "qwen", arch="tiny", seed=3), "cpu", "float32")
    override = {"max_pixels": 200_000}
    contract = check_contract(qwen, override=override)
    assert contract.processor_override  # the override took
    started = []
    monkeypatch.setattr(encoder_pool, "EncoderPool", lambda *a, **k: started.append(1))
    settings = ServerSettings(model=str(qwen.path), topology="e_pd", device="cpu", processor_override=override)
    with pytest.raises(ModelLoadError, match="--processor-override .* is not applied in encode workers"):
        start_encode_workers(settings, qwen, contract, metrics=None, config=None)
    assert not started
    assert sends_resized_images(qwen) and not sends_resized_images(demo_model)
