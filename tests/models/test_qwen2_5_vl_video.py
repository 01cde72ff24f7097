"""Qwen2.5-VL videos against transformers on the tiny random checkpoint: the torchvision-free
frame preprocessing, M-RoPE temporal positions (get_rope_index), the tower's rows for the video
(get_video_features) and greedy tokens (generate with pixel_values_videos)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from test_qwen2_5_vl import GREEDY, noise, run

from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.reference import reference_generate, reference_logits
from fovea.loading.loader import load_model
from fovea.loading.prompt import PlaceholderMismatch, render_chat
from fovea.media import MediaConfig
from fovea.media.video import DecodedVideo, decode_video_bytes
from fovea.models.qwen2_5_vl import pixel_bounds
from fovea.testing.random_qwen2_5_vl import write_model_dir
from fovea.testing.tolerance import assert_close_for, assert_close_to_model, vision_path_len
from fovea.testing.videos import make_mp4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("qwen") / "tiny-qwen2.5-vl", arch="tiny", seed=3)
    return load_model(path, "cpu", "float32")


def clip(frames: list[Image.Image], source_fps: float = 4.0, total: int | None = None) -> DecodedVideo:
    total = total or len(frames) * 2
    return DecodedVideo(frames, list(range(0, total, 2))[:len(frames)], total, source_fps)


def chat(model, parts: list[str], images=(), videos=(), text: str = "you are a helpful"):
    content = [{"type": p} for p in parts] + [{"type": "text", "text": text}]
    rendered = render_chat(model, [{"role": "user", "content": content}])
    return model.codec.encode(rendered, list(images), videos=list(videos))


def test_the_video_recipe_falls_back_to_the_image_processors_pixels(qwen):
    recipe = qwen.codec.video
    assert recipe is not None and recipe.fps == 2.0 and recipe.temporal_patch_size == 2
    # The tiny checkpoint ships preprocessor_config.json only: transformers' video processor reads that.
    assert (recipe.min_pixels, recipe.max_pixels) == pixel_bounds(qwen.codec.image_processor)
    assert recipe.token_id == qwen.model.config.video_token_id
    assert recipe.tokens_per_second == qwen.model.config.vision_config.tokens_per_second


def test_frame_patches_are_the_image_processors_layout(qwen):
    """Two frames A, B: each patch's temporal slot 0 is A's patch, slot 1 is B's, in the order
    and normalisation transformers' image processor gives a still image (which repeats it)."""
    a, b = noise(120, 80, 1), noise(120, 80, 2)
    pixels, grid = qwen.codec.video.pixels([a, b])
    still_a = qwen.codec.image_processor(images=[a], return_tensors="pt")
    still_b = qwen.codec.image_processor(images=[b], return_tensors="pt")
    assert tuple(still_a["image_grid_thw"][0].tolist()) == grid
    shape = (-1, 3, 2, 14, 14)
    ours = pixels.view(shape)
    # Elementwise: rescale, subtract the mean, divide by the std (three roundings).
    assert_close_for(ours[:, :, 0], still_a["pixel_values"].view(shape)[:, :, 0], torch.float32, 3)
    assert_close_for(ours[:, :, 1], still_b["pixel_values"].view(shape)[:, :, 1], torch.float32, 3)
    # An odd frame count: the last frame repeated fills the last temporal patch.
    odd, grid3 = qwen.codec.video.pixels([a, b, a])
    assert grid3[0] == 2 and torch.equal(odd.view((2, -1) + shape[1:])[1, :, :, 1],
                                         odd.view((2, -1) + shape[1:])[1, :, :, 0])


def test_token_counts_and_engine_ids(qwen):
    video = clip([noise(120, 80, i) for i in range(4)])
    prompt = chat(qwen, ["video"], videos=[video])
    (item,) = prompt.images
    t, h, w = item.grid
    assert t == 2 and item.num_tokens == t * h * w // 4 and item.seconds_per_grid == 1.0
    assert prompt.input_ids.count(qwen.image_token_id) == item.num_tokens  # the engine's slot marker
    ref = qwen.adapter.reference_ids(prompt, qwen.image_token_id)
    assert ref.count(qwen.model.config.video_token_id) == item.num_tokens and qwen.image_token_id not in ref


@pytest.mark.parametrize("source_fps,frames", [(4.0, 4), (1.0, 6), (30.0, 5)])
def test_mrope_positions_equal_transformers_get_rope_index(qwen, source_fps, frames):
    video = clip([noise(90 + 10 * i, 64, 30 + i) for i in range(frames)][:1] * frames, source_fps)
    prompt = chat(qwen, ["image", "video", "image"], [noise(300, 200, 5), noise(64, 90, 6)], [video])
    theirs = qwen.adapter.reference_positions(qwen.model, prompt, qwen.image_token_id)
    ids = torch.tensor([qwen.adapter.reference_ids(prompt, qwen.image_token_id)])
    types = qwen.adapter._token_types(ids, prompt, qwen.image_token_id)
    images = [i for i in prompt.images if i.seconds_per_grid is None]
    videos = [i for i in prompt.images if i.seconds_per_grid is not None]
    rows, delta = qwen.model.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=torch.tensor([i.grid for i in images]),
        video_grid_thw=torch.tensor([v.grid for v in videos]),
        second_per_grid_ts=torch.tensor([v.seconds_per_grid for v in videos]))
    assert theirs == (rows[:, 0].tolist(), int(delta))
    assert prompt.positions == rows[:, 0].tolist() and prompt.position_delta == int(delta)
    first = prompt.input_ids.index(qwen.image_token_id) + images[0].num_tokens
    assert len(set(rows[0, 0].tolist())) > len(set(prompt.positions[0][:first]))  # the video's time steps count


def test_the_towers_rows_equal_get_video_features(qwen):
    video = clip([noise(120, 80, 60 + i) for i in range(6)])
    prompt = chat(qwen, ["image", "video"], [noise(64, 90, 7)], [video])
    ours = qwen.adapter.vision_forward(qwen)(prompt.images)
    inputs = qwen.adapter.reference_inputs(prompt, torch.device("cpu"), qwen.image_token_id)
    with torch.inference_mode():
        theirs_video = qwen.model.model.get_video_features(inputs["pixel_values_videos"],
                                                           inputs["video_grid_thw"]).pooler_output
        theirs_image = qwen.model.model.get_image_features(inputs["pixel_values"],
                                                           inputs["image_grid_thw"]).pooler_output
    config = qwen.model.config
    assert_close_for(ours[1], theirs_video[0], torch.float32, vision_path_len(config, 4 * ours[1].shape[0]))
    assert_close_for(ours[0], theirs_image[0], torch.float32, vision_path_len(config, 4 * ours[0].shape[0]))


def test_greedy_tokens_equal_transformers_generate(qwen):
    mp4 = make_mp4([(255, 0, 0), (0, 255, 0), (0, 0, 255), (250, 250, 0)] * 3, width=96, height=64, fps=4)
    decoded = decode_video_bytes(mp4, MediaConfig(), fps=qwen.codec.video.fps)
    prompts = [chat(qwen, ["video"], videos=[decoded], text="you"),
               chat(qwen, ["image", "video"], [noise(300, 200, 8)], [clip([noise(64, 64, 70 + i) for i in range(5)])],
                    text="a helpful")]
    engine = PagedEngine(qwen, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=24))
    results = run(engine, [(p, GREEDY) for p in prompts])
    for prompt, (tokens, finish) in zip(prompts, results):
        ref = reference_generate(qwen, prompt, 12)
        assert ref and tokens[:len(ref)] == ref
        logits = torch.log_softmax(reference_logits(qwen, prompt), -1)
        assert_close_to_model(finish.first_logprobs, logits, qwen.model.config, len(prompt.input_ids))


def test_video_placeholders_are_counted(qwen):
    text = render_chat(qwen, [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "you"}]}])
    with pytest.raises(PlaceholderMismatch):
        qwen.codec.encode(text, [], videos=[])
