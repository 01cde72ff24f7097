"""``image_url.detail``: "low" caps a dynamic-resolution family's image at OpenAI's low-detail
size (512 x 512 pixels: fewer image tokens, and another cache key, since the pixels differ);
"high" and "auto" keep the model's own range; a fixed-resolution family (the demo) gets the
same prompt whatever the detail."""

from __future__ import annotations

import random

import httpx
import pytest
from PIL import Image
from scene_helpers import data_url, free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat
from fovea.models.base import LOW_DETAIL_PIXELS, EncodeOptions
from fovea.testing import random_qwen2_5_vl, random_qwen3_vl

FAMILIES = {"qwen2_5_vl": random_qwen2_5_vl.write_model_dir, "qwen3_vl": random_qwen3_vl.write_model_dir}
# The tiny models' processors allow 4 times the low-detail size, so a large image is cut by "low".
MAX_PIXELS = 4 * LOW_DETAIL_PIXELS


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))


BIG = noise(1024, 768, 1)  # 786,432 pixels: within the models' range, three times the low-detail size
SMALL = noise(160, 120, 2)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qwen(request, tmp_path_factory):
    path = FAMILIES[request.param](tmp_path_factory.mktemp(request.param) / "tiny", arch="tiny", seed=3,
                                   max_pixels=MAX_PIXELS)
    return load_model(path, "cpu", "float32")


def pixels_seen(qwen, image) -> int:
    _, h, w = image.grid
    return h * w * int(qwen.codec.image_processor.patch_size) ** 2


def test_low_detail_caps_only_its_own_image(qwen):
    text = render_chat(qwen, [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "image"},
                                                           {"type": "text", "text": "you are"}]}])
    images = [BIG, BIG, SMALL]
    full = encode_prompt(qwen, text, images)
    mixed = encode_prompt(qwen, text, images, options=EncodeOptions(low_detail=(False, True, True)))
    assert pixels_seen(qwen, full.images[1]) > 2 * LOW_DETAIL_PIXELS  # the model's own range keeps it large
    assert pixels_seen(qwen, mixed.images[1]) <= LOW_DETAIL_PIXELS
    assert mixed.images[1].num_tokens < full.images[1].num_tokens / 2
    assert mixed.images[1].hash != full.images[1].hash  # other pixels: another encoder-cache entry
    # The image sent without "low" is untouched, and a small image is under the cap already.
    for index in (0, 2):
        assert mixed.images[index].hash == full.images[index].hash
        assert mixed.images[index].num_tokens == full.images[index].num_tokens
    assert len(mixed.input_ids) == len(full.input_ids) - (full.images[1].num_tokens - mixed.images[1].num_tokens)


def test_detail_over_http_chat_tokenize_and_responses(qwen):
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False)
    live, server, thread = start_server(settings, qwen)
    url = data_url(BIG)
    try:
        with httpx.Client(base_url=live.base_url, timeout=300) as http:
            def chat_tokens(**detail) -> int:
                messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **detail}},
                                                         {"type": "text", "text": "you are"}]}]
                reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
                assert reply.status_code == 200, reply.text
                counted = http.post("/tokenize", json={"messages": messages}).json()["count"]
                assert counted == reply.json()["usage"]["prompt_tokens"]
                return counted

            def responses_tokens(detail: str) -> int:
                content = [{"type": "input_image", "image_url": url, "detail": detail},
                           {"type": "input_text", "text": "you are"}]
                reply = http.post("/v1/responses", json={"input": [{"role": "user", "content": content}],
                                                         "max_output_tokens": 1})
                assert reply.status_code == 200, reply.text
                return reply.json()["usage"]["input_tokens"]

            default = chat_tokens()
            assert chat_tokens(detail="high") == chat_tokens(detail="auto") == default
            low = chat_tokens(detail="low")
            assert low < default
            assert responses_tokens("low") == low and responses_tokens("high") == default
            assert responses_tokens("original") == default
    finally:
        stop_server(server, thread)


def test_a_fixed_resolution_model_takes_detail_with_no_effect(live_server):
    url = data_url(BIG)
    bodies = {}
    with httpx.Client(base_url=live_server.base_url, timeout=120) as http:
        for detail in ("low", "high", "auto"):
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": detail}},
                                                     {"type": "text", "text": "Describe the image."}]}]
            reply = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0})
            assert reply.status_code == 200, reply.text
            bodies[detail] = reply.json()
    answers = {(b["choices"][0]["message"]["content"], b["usage"]["prompt_tokens"]) for b in bodies.values()}
    assert len(answers) == 1
