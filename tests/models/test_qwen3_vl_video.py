"""Qwen3-VL videos against transformers on the tiny random checkpoint: frame sampling
(Qwen3VLVideoProcessor.sample_frames), the timestamped prompt (Qwen3VLProcessor.replace_video_token),
M-RoPE positions (get_rope_index on the unsplit video grid), the tower's rows (get_video_features)
and greedy tokens; a video_url over HTTP, and a corrupt one refused with its code. transformers'
video processor needs torchvision, so its methods run on the frames prepared here."""

from __future__ import annotations

import base64
import re
import types

import httpx
import pytest
import torch
from PIL import Image
from scene_helpers import free_port, start_server, stop_server
from test_qwen2_5_vl import noise, run
from transformers import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from fovea.config import ServerSettings
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.reference import reference_generate, reference_logits
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.loading.prompt import render_chat
from fovea.media import MediaConfig
from fovea.media.video import DecodedVideo, decode_video_bytes
from fovea.models.qwen3_vl import sample_indices
from fovea.testing.random_qwen3_vl import write_model_dir
from fovea.testing.tolerance import assert_close_for, assert_close_to_model, vision_path_len
from fovea.testing.videos import make_mp4

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (250, 250, 0)] * 3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-vl", arch="tiny", seed=3)
    return load_model(path, "cpu", "float32")


def clip(frames: list[Image.Image], source_fps: float = 4.0, step: int = 2) -> DecodedVideo:
    return DecodedVideo(frames, list(range(0, len(frames) * step, step)), len(frames) * step, source_fps)


def chat(model, parts: list[str], images=(), videos=(), text: str = "you are a helpful"):
    content = [{"type": p} for p in parts] + [{"type": "text", "text": text}]
    return model.codec.encode(render_chat(model, [{"role": "user", "content": content}]), list(images),
                              videos=list(videos))


def transformers_video_text(model, rendered: str, video: DecodedVideo, grid: tuple[int, int, int]) -> str:
    """The text Qwen3VLProcessor builds: replace_video_token's expansion in place of <|video_pad|>."""
    recipe = model.codec.video
    shim = types.SimpleNamespace(video_processor=types.SimpleNamespace(merge_size=recipe.merge_size,
                                                                       temporal_patch_size=recipe.temporal_patch_size),
                                 video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                                 vision_end_token="<|vision_end|>")
    shim._calculate_timestamps = types.MethodType(Qwen3VLProcessor._calculate_timestamps, shim)
    metadata = VideoMetadata(total_num_frames=video.total_frames, fps=video.source_fps,
                             frames_indices=list(video.indices))
    expansion = Qwen3VLProcessor.replace_video_token(shim, {"video_grid_thw": torch.tensor([grid]),
                                                            "video_metadata": [metadata]}, 0)
    return rendered.replace("<|video_pad|>", expansion, 1)


def test_the_video_recipe_is_read_from_the_video_preprocessor_config(qwen3):
    recipe = qwen3.codec.video
    assert (recipe.min_pixels, recipe.max_pixels, recipe.fps, recipe.patch_size) == (4096, 200_704, 2.0, 16)
    assert recipe.token_id == qwen3.model.config.video_token_id


@pytest.mark.parametrize("total,source_fps", [(12, 4.0), (9, 30.0), (300, 24.0), (3, 1.0)])
def test_frames_are_sampled_as_the_video_processor_samples(qwen3, total, source_fps):
    shim = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768, num_frames=None)
    theirs = Qwen3VLVideoProcessor.sample_frames(shim, VideoMetadata(total_num_frames=total, fps=source_fps))
    assert sample_indices(total, source_fps, 2.0, 768, 4, 2) == theirs.tolist()


@pytest.mark.parametrize("frames", [4, 5])
def test_the_prompt_is_transformers_timestamped_text(qwen3, frames):
    video = clip([noise(120, 80, 40 + i) for i in range(frames)])
    parts = ["image", "video"]
    rendered = render_chat(qwen3, [{"role": "user", "content": [{"type": p} for p in parts]
                                    + [{"type": "text", "text": "you"}]}])
    prompt = qwen3.codec.encode(rendered, [noise(64, 90, 3)], videos=[video])
    frames_in = [i for i in prompt.images if i.token_id is not None]
    (_, gh, gw), groups = frames_in[0].grid, len(frames_in)
    assert groups == -(-frames // 2)  # one group per temporal patch, the last padded
    expected = transformers_video_text(qwen3, rendered, video, (groups, gh, gw))
    assert "<1.2 seconds>" in expected  # frames 4 and 6 at 4 fps
    # fovea's text holds one <|video_pad|> per group (expanded as ids); otherwise the same text.
    assert prompt.prompt_text == re.sub(r"(<\|video_pad\|>)+", "<|video_pad|>", expected)
    # transformers' ids: that text tokenized, with the image's placeholder expanded.
    ids = qwen3.tokenizer(expected, add_special_tokens=False)["input_ids"]
    image = qwen3.image_token_id
    expanded = [t for token in ids for t in ([token] * prompt.images[0].num_tokens if token == image else [token])]
    assert qwen3.adapter.reference_ids(prompt, image) == expanded
    assert ids.count(qwen3.model.config.video_token_id) == groups * gh * gw // 4


def test_positions_equal_get_rope_index_on_the_unsplit_grid(qwen3):
    video = clip([noise(120, 80, 50 + i) for i in range(6)])
    prompt = chat(qwen3, ["image", "video", "image"], [noise(300, 200, 5), noise(64, 90, 6)], [video])
    ids = torch.tensor([qwen3.adapter.reference_ids(prompt, qwen3.image_token_id)])
    types_ = qwen3.adapter._token_types(ids, prompt, qwen3.image_token_id)
    images = [i for i in prompt.images if i.token_id is None]
    frames = [i for i in prompt.images if i.token_id is not None]
    grid = (len(frames), *frames[0].grid[1:])
    rows, delta = qwen3.model.model.get_rope_index(ids, mm_token_type_ids=types_,
                                                   image_grid_thw=torch.tensor([i.grid for i in images]),
                                                   video_grid_thw=torch.tensor([grid]))
    assert prompt.positions == rows[:, 0].tolist() and prompt.position_delta == int(delta)


def test_the_towers_rows_equal_get_video_features_on_the_whole_video(qwen3):
    """fovea encodes a video's temporal patches as separate (1, h, w) images; transformers takes
    the (t, h, w) grid at once. The tower attends within a temporal patch, so the rows (and each
    DeepStack level's) agree."""
    video = clip([noise(120, 80, 60 + i) for i in range(6)])
    prompt = chat(qwen3, ["video"], videos=[video])
    ours = torch.cat(qwen3.adapter.vision_forward(qwen3)(prompt.images))
    pixels = torch.cat([i.pixels for i in prompt.images])
    grid = torch.tensor([[len(prompt.images), *prompt.images[0].grid[1:]]])
    with torch.inference_mode():
        out = qwen3.model.model.get_video_features(pixels, grid)
    theirs = torch.cat([torch.cat(out.pooler_output)] + [torch.cat(level) for level in out.deepstack_features], -1)
    assert_close_for(ours, theirs, torch.float32, vision_path_len(qwen3.model.config, 4 * ours.shape[0]))


def test_greedy_tokens_equal_transformers_generate(qwen3):
    mp4 = make_mp4(COLOURS, width=96, height=64, fps=4)
    recipe = qwen3.codec.video
    decoded = decode_video_bytes(mp4, MediaConfig(), fps=recipe.fps, sampler=recipe.sample_indices)
    assert decoded.indices == sample_indices(12, 4.0, 2.0, 768)
    prompts = [chat(qwen3, ["video"], videos=[decoded], text="you"),
               chat(qwen3, ["image", "video"], [noise(300, 200, 8)], [clip([noise(64, 64, 70 + i) for i in range(5)])],
                    text="a helpful")]
    engine = PagedEngine(qwen3, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=24))
    for prompt, (tokens, finish) in zip(prompts, run(engine, [(p, GREEDY) for p in prompts])):
        ref = reference_generate(qwen3, prompt, 10)
        assert ref and tokens[:len(ref)] == ref
        assert_close_to_model(finish.first_logprobs, torch.log_softmax(reference_logits(qwen3, prompt), -1),
                              qwen3.model.config, len(prompt.input_ids))


def test_video_url_over_http_and_a_corrupt_one_refused(qwen3):
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False,
                              media=MediaConfig(max_video_bytes=200_000, max_video_seconds=30))
    live, server, thread = start_server(settings, qwen3)

    def post(data: bytes) -> httpx.Response:
        url = "data:video/mp4;base64," + base64.b64encode(data).decode()
        body = {"max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "you are"}]}]}
        return httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)

    try:
        mp4 = make_mp4(COLOURS[:8], width=96, height=64, fps=4)
        reply = post(mp4)
        assert reply.status_code == 200, reply.text
        recipe = qwen3.codec.video
        decoded = decode_video_bytes(mp4, MediaConfig(), fps=recipe.fps, sampler=recipe.sample_indices)
        assert reply.json()["usage"]["prompt_tokens"] == len(chat(qwen3, ["video"], videos=[decoded],
                                                                  text="you are").input_ids)
        bad = post(mp4[:200])
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_video"
        assert post(mp4).status_code == 200  # and it keeps serving
    finally:
        stop_server(server, thread)
