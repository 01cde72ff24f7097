"""A quantized checkpoint in ``--topology e_pd``: the encode workers read the vision part (never
quantized) from the same directory, and the answers equal agg's."""

from __future__ import annotations

import httpx
from PIL import Image
from scene_helpers import data_url, free_port, run_all, start_server, stop_server

from fovea.config import ServerSettings
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat

QUESTION = "What is in the image?"


def test_e_pd_answers_equal_agg_on_a_quantized_checkpoint(quantized_dir):
    path = quantized_dir("qwen2_5_vl", "fp8-dynamic")
    loaded = load_model(path, "cpu", "float32")
    images = [Image.effect_noise((96, 80), 40 + i).convert("RGB") for i in range(3)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    agg = [finish.text for _, finish in run_all(PagedEngine(loaded, PagedEngineConfig(num_blocks=256)), [
        (encode_prompt(loaded, render_chat(loaded, messages), [image]), params) for image in images])]
    settings = ServerSettings(model=path, host="127.0.0.1", port=free_port(), device="cpu", dtype="float32",
                              canary=False, topology="e_pd", encode_workers=1)
    live, server, thread = start_server(settings, loaded)
    try:
        answers = []
        for image in images:
            reply = httpx.post(live.base_url + "/v1/chat/completions", timeout=120, json={
                "max_tokens": 8, "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": QUESTION}]}]})
            assert reply.status_code == 200, reply.text[:300]
            answers.append(reply.json()["choices"][0]["message"]["content"])
        health = httpx.get(live.base_url + "/health", timeout=30).json()
    finally:
        stop_server(server, thread)
    assert answers == agg and all(agg)
    assert health["quantization"] == loaded.quantization.label and health["topology"] == "e_pd"
