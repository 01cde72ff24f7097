"""video_url parts end to end over HTTP: a Qwen2.5-VL server answers a small MP4, refuses a
corrupt or oversized one with its code and keeps serving; a model without video refuses the part."""

from __future__ import annotations

import base64

import httpx
import pytest
from scene_helpers import data_url, free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.loading.loader import load_model
from fovea.loading.prompt import render_chat
from fovea.media import MediaConfig
from fovea.media.video import decode_video_bytes
from fovea.testing.random_qwen2_5_vl import write_model_dir
from fovea.testing.videos import make_mp4

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)] * 2


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def body(parts: list[dict], text: str = "you are") -> dict:
    return {"max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("qwen") / "tiny-qwen2.5-vl", arch="tiny", seed=3)
    return load_model(path, "cpu", "float32")


@pytest.fixture(scope="module")
def qwen_server(qwen, tmp_path_factory):
    files = tmp_path_factory.mktemp("videos")
    media = MediaConfig(allowed_media_dirs=(files,), max_video_bytes=200_000, max_video_seconds=30)
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False,
                              media=media)
    live, server, thread = start_server(settings, qwen)
    yield live.base_url, files
    stop_server(server, thread)


def post(base: str, payload: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=payload, timeout=120)


def test_a_small_mp4_is_answered(qwen, qwen_server):
    base, _ = qwen_server
    mp4 = make_mp4(COLOURS, width=96, height=64, fps=4)
    reply = post(base, body([{"type": "video_url", "video_url": {"url": video_url(mp4)}}]))
    assert reply.status_code == 200, reply.text
    # The prompt the server ran is the video's: its token count is the codec's for these frames.
    clip = decode_video_bytes(mp4, MediaConfig(), fps=qwen.codec.video.fps)
    text = render_chat(qwen, [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "you are"}]}])
    prompt = qwen.codec.encode(text, [], videos=[clip])
    assert reply.json()["usage"]["prompt_tokens"] == len(prompt.input_ids)
    assert prompt.images[0].grid[0] == 2 and prompt.images[0].num_tokens >= 8  # 4 frames sampled of 8 at 2 fps


def test_a_video_from_an_allowed_file_with_an_image(qwen_server):
    from PIL import Image

    base, files = qwen_server
    path = files / "clip.mp4"
    path.write_bytes(make_mp4(COLOURS[:4], fps=2))
    image = Image.new("RGB", (80, 60), (10, 200, 30))
    reply = post(base, body([{"type": "image_url", "image_url": {"url": data_url(image)}},
                             {"type": "video_url", "video_url": {"url": path.as_uri()}}]))
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("url,code", [
    (video_url(b"\x00\x00\x00\x18ftypmp42" + b"\x13" * 500), "invalid_video"),
    (video_url(make_mp4(COLOURS)[:200]), "invalid_video"),
    ("data:video/mp4;base64,", "invalid_video"),
    (video_url(make_mp4(COLOURS * 40, fps=4)), "video_too_large"),  # 80 s, over max_video_seconds
    (video_url(b"\x00" * 250_000), "video_too_large"),  # over max_video_bytes
    ("file:///etc/passwd", "media_source_forbidden"),
])
def test_bad_videos_get_their_code_and_the_server_stays_up(qwen_server, url, code):
    base, _ = qwen_server
    reply = post(base, body([{"type": "video_url", "video_url": {"url": url}}]))
    assert reply.status_code in (400, 403), reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == "messages[0].content[0]" and error["message"]
    # Another request is unharmed.
    from PIL import Image

    ok = post(base, body([{"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (64, 64)))}}]))
    assert ok.status_code == 200, ok.text


def test_the_video_token_typed_as_text_is_refused(qwen_server):
    base, _ = qwen_server
    reply = post(base, body([], text="look <|video_pad|> here"))
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "image_placeholder_mismatch"


def test_the_video_token_is_refused_in_generate_and_completions(qwen_server):
    base, _ = qwen_server
    generate = httpx.post(base + "/generate", json={"prompt": "you <|video_pad|>", "max_tokens": 2}, timeout=60)
    assert generate.status_code == 400 and generate.json()["error"]["code"] == "image_placeholder_mismatch"
    raw = httpx.post(base + "/v1/completions", json={"prompt": "you <|video_pad|>", "max_tokens": 2}, timeout=60)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "image_placeholder_mismatch"


def test_grounding_runs_on_a_video_prompt(qwen_server):
    base, _ = qwen_server
    payload = body([{"type": "video_url", "video_url": {"url": video_url(make_mp4(COLOURS, fps=4))}}])
    payload["fovea"] = {"grounding": True}
    reply = post(base, payload)
    assert reply.status_code == 200, reply.text
    assert "grounding" in reply.json().get("fovea", {}), reply.json()


def test_modality_errors_are_counted(qwen_server):
    base, _ = qwen_server
    post(base, body([{"type": "video_url", "video_url": {"url": video_url(b"junk" * 50)}}]))
    metrics = httpx.get(base + "/metrics", timeout=30).text
    assert 'reason="invalid_video"' in metrics


def test_a_model_without_video_refuses_the_part(live_server):
    reply = httpx.post(live_server.base_url + "/v1/chat/completions", timeout=60,
                       json=body([{"type": "video_url", "video_url": {"url": video_url(make_mp4(COLOURS))}}]))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "videos_not_supported" and error["param"] == "messages[0].content[0]"


def test_videos_cross_preprocessing_worker_processes(qwen):
    """With --preprocess-workers the codec (and its video recipe) runs in a spawned process:
    the prompt it returns is the in-process one."""
    import asyncio

    from fovea.loading.contract import check_contract
    from fovea.serve.preprocess import Preprocessor, build_prompts

    media = MediaConfig()
    mp4 = make_mp4(COLOURS, fps=4)
    text = render_chat(qwen, [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "you"}]}])
    local, _ = build_prompts(qwen.codec, media, None, text, [], True, False, [(mp4, "v")])
    pre = Preprocessor(qwen, media, 1, check_contract(qwen).recipe_fingerprint)
    try:
        remote, _ = asyncio.run(pre.prompts(text, [], videos=[(mp4, "v")]))
    finally:
        pre.close()
    assert remote.input_ids == local.input_ids and remote.positions == local.positions
    assert remote.images[0].hash == local.images[0].hash and remote.images[0].seconds_per_grid == 1.0
