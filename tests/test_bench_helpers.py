"""What the GPU benchmarks (bench/) rely on and can check on the CPU: the offline engine's prompt is
the server's for the same request, the quantized benchmark's tiny shapes load in every format, and
the Poisson load makes as many requests as arrive."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_quantized
import load_procs
import serve_load
from gpu_serve import body_prompt

from fovea.loading.loader import load_model
from fovea.loading.prompt import render_chat
from fovea.media import MediaConfig
from fovea.serve.preprocess import build_prompts
from fovea.testing import random_qwen2_5_vl


def test_the_offline_prompt_of_a_body_is_the_servers(tmp_path):
    loaded = load_model(random_qwen2_5_vl.write_model_dir(tmp_path / "q", arch="tiny"), "cpu", "auto")
    body = serve_load.chat_body("m", 5, random_qwen2_5_vl.prompt_words("tiny", 64, 5), 128, images=2,
                                size=(1280, 720))
    ours = body_prompt(loaded, body)
    parts = body["messages"][0]["content"]
    images = [(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]), f"content[{i}]")
              for i, p in enumerate(parts) if p["type"] == "image_url"]
    text = render_chat(loaded, [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, parts[-1]]}])
    server, _ = build_prompts(loaded.codec, MediaConfig(), loaded.codec.target_short_side(), text, images,
                              template_rendered=True, blank_twin=False)
    assert ours.input_ids == server.input_ids and len(ours.images) == 2
    assert all(torch.equal(a.pixels, b.pixels) for a, b in zip(ours.images, server.images, strict=True))


@pytest.mark.parametrize("fmt, scheme", [("fp8", "fp8-channel"), ("fp8-block", "fp8-block"), ("w4a16", "w4a16"),
                                         ("awq", "awq")])
def test_the_tiny_shape_loads_in_each_format_with_dummy_weights(tmp_path, fmt, scheme):
    """The tiny shape's groups and blocks are the tests' 32, not the releases' 128 (its layers are 64 wide)."""
    loaded = load_model(gpu_quantized.shape_dir(tmp_path, "tiny", fmt), "cpu", "float32", load_format="dummy")
    assert loaded.quantization.scheme == scheme
    assert loaded.quantization.group_size in (None, 32) and loaded.quantization.block in (None, (32, 32))


def test_poisson_sends_exactly_the_arrivals():
    times = load_procs.arrivals(20.0, 3.0, seed=80)
    assert times == sorted(times) and all(0 < t < 3.0 for t in times) and 30 < len(times) < 90
    assert load_procs.arrivals(20.0, 3.0, seed=80, limit=5) == times[:5]
