"""fovea's grouped window attention in Qwen2.5-VL's tower against transformers' own, per chunk."""

from __future__ import annotations

import itertools

import torch
from test_qwen2_5_vl import noise, patched, qwen  # noqa: F401 - the module's fixture

from fovea.models.qwen_vision_attention import chunk_groups, grouped, grouped_attention
from fovea.testing.tolerance import assert_close_for, attention_path_len, vision_path_len


def test_groups_cover_every_token_once():
    groups = chunk_groups([0, 64, 128, 150, 214, 214, 300], torch.device("cpu"))
    assert sorted(length for length, _ in groups) == [22, 64, 86]
    covered = torch.cat([index for _, index in groups]).sort().values
    assert covered.tolist() == list(range(300))


def test_grouped_attention_equals_one_call_per_chunk():
    torch.manual_seed(0)
    bounds = [0, 16, 32, 40, 56, 61]
    q, k, v = (torch.randn(3, 61, 8) for _ in range(3))
    got = grouped_attention(q, k, v, bounds, 0.35)
    for start, end in itertools.pairwise(bounds):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, start:end][None], k[:, start:end][None], v[:, start:end][None], scale=0.35)[0]
        assert_close_for(got[start:end], want.transpose(0, 1), torch.float32,
                         attention_path_len(8, end - start))


def test_the_tower_gives_transformers_rows_and_is_restored_after(qwen):  # noqa: F811
    prompt = qwen.codec.encode(qwen.codec.render([{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "you"}]}]), [noise(300, 200, 1), noise(90, 64, 2)])
    visual = qwen.model.model.visual
    pixels = patched(qwen, prompt.images)
    grid = torch.tensor([image.grid for image in prompt.images])
    with torch.inference_mode():
        theirs = visual(pixels, grid_thw=grid).pooler_output
        with grouped(visual) as active:
            ours = visual(pixels, grid_thw=grid).pooler_output
        again = visual(pixels, grid_thw=grid).pooler_output
    assert active
    assert_close_for(ours, theirs, torch.float32, vision_path_len(qwen.model.config, 4 * ours.shape[0]))
    assert "forward" not in visual.blocks[0].attn.__dict__ and torch.equal(again, theirs)


def test_nested_use_keeps_the_swap_until_the_outer_one_ends(qwen):  # noqa: F811
    visual = qwen.model.model.visual
    with grouped(visual):
        with grouped(visual):
            pass
        assert "forward" in visual.blocks[0].attn.__dict__  # the outer call is still running grouped
    assert "forward" not in visual.blocks[0].attn.__dict__
