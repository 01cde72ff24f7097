"""The grounding canary fits the server's per-sequence limit and image limits, or start-up refuses in one line."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from scene_helpers import free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.guard.canary import Canary
from fovea.guard.canary_fit import (
    ANSWER_TOKENS,
    PROBE_SIZES,
    CanaryFit,
    CanaryImagesRefused,
    CanaryTooLong,
    canary_prompt,
    fit_canary,
)
from fovea.guard.probe_images import DEFAULT_CASES
from fovea.loading.loader import load_codec, load_model
from fovea.media.config import MediaConfig
from fovea.serve.app import create_app
from fovea.serve.startup_checks import StartupRefused
from fovea.testing.random_qwen2_5_vl import write_model_dir


def longest_prompt(codec, size: int) -> int:
    return max(len(canary_prompt(codec, case, size).input_ids) for case in DEFAULT_CASES)


def settings(**kw) -> ServerSettings:
    return ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary_interval_s=0, **kw)


# ---- the demo: a fixed image-token count ---------------------------------------------------
def test_where_the_limits_allow_the_canary_keeps_its_probe_and_answer(demo_model):
    fit = fit_canary(demo_model.codec, MediaConfig(), None)
    assert fit == CanaryFit(PROBE_SIZES[0], longest_prompt(demo_model.codec, PROBE_SIZES[0]), 64, ANSWER_TOKENS)
    assert fit_canary(demo_model.codec, MediaConfig(), demo_model.context_length) == fit


def test_a_fixed_resolution_model_keeps_its_image_and_shortens_the_answer(demo_model):
    prompt = longest_prompt(demo_model.codec, PROBE_SIZES[0])
    assert all(longest_prompt(demo_model.codec, size) == prompt for size in PROBE_SIZES)  # 64 tokens at any size
    assert fit_canary(demo_model.codec, MediaConfig(), prompt + 5) == CanaryFit(PROBE_SIZES[0], prompt, 64, 5)
    assert fit_canary(demo_model.codec, MediaConfig(), prompt + 1).answer_tokens == 1
    with pytest.raises(CanaryTooLong) as refused:
        fit_canary(demo_model.codec, MediaConfig(), prompt)
    assert refused.value.need == prompt + 1 and refused.value.smallest.image_tokens == 64


def test_small_image_limits_get_a_smaller_probe_or_a_refusal_naming_the_flag(demo_model):
    smallest = PROBE_SIZES[-1]
    assert fit_canary(demo_model.codec, MediaConfig(max_image_pixels=smallest**2), None).size == smallest
    with pytest.raises(CanaryImagesRefused) as refused:
        fit_canary(demo_model.codec, MediaConfig(max_image_pixels=smallest**2 - 1), None)
    assert refused.value.flag == "--max-image-pixels" and refused.value.minimum == smallest**2
    assert f"use --max-image-pixels {smallest**2} or more, or --no-canary" in refused.value.message
    with pytest.raises(CanaryImagesRefused) as refused:
        fit_canary(demo_model.codec, MediaConfig(max_image_bytes=100), None)
    minimum = refused.value.minimum
    assert refused.value.flag == "--max-image-bytes"
    assert fit_canary(demo_model.codec, MediaConfig(max_image_bytes=minimum), None).size == smallest


def test_the_canary_passes_at_the_smallest_max_model_len_it_fits(demo_model):
    need = longest_prompt(demo_model.codec, PROBE_SIZES[0]) + 1
    live, server, thread = start_server(settings(max_model_len=need), demo_model)
    try:
        canary = httpx.get(live.base_url + "/health").json()["canary"]
    finally:
        stop_server(server, thread)
    assert canary["ok"] and canary["answers"] == {"red": "red", "blue": "blue", "green": "green"}
    assert (canary["probe_size"], canary["answer_tokens"]) == (PROBE_SIZES[0], 1)


def test_below_it_the_server_is_refused_before_it_starts(demo_model):
    need = longest_prompt(demo_model.codec, PROBE_SIZES[0]) + 1
    with pytest.raises(StartupRefused) as refused:
        create_app(settings(max_model_len=need - 1), loaded=demo_model)
    assert refused.value.message.startswith(f"--max-model-len {need - 1} is too small for this model: the grounding "
                                            f"canary needs {need} tokens per sequence")
    assert f"use --max-model-len {need} or more, or pass --no-canary" in refused.value.message
    create_app(settings(max_model_len=need - 1, canary=False), loaded=demo_model)  # without the canary it serves


def test_a_kv_cache_too_small_for_the_canary_names_kv_cache_memory_and_its_minimum(demo_model):
    engine = create_app(settings(canary=False), loaded=demo_model).state.fovea.engine
    per_block, block = engine.runner.kv_plan.bytes_per_block, engine.config.block_size
    need = longest_prompt(demo_model.codec, PROBE_SIZES[0]) + 1
    blocks = -(-need // block)
    with pytest.raises(StartupRefused) as refused:
        create_app(settings(kv_cache_memory=(blocks - 1) * per_block), loaded=demo_model)
    message = refused.value.message
    assert message.startswith(f"--kv-cache-memory {(blocks - 1) * per_block} ({(blocks - 1) * block} tokens of KV "
                              "cache) is too small for this model")
    assert f"use --kv-cache-memory {-(-blocks * per_block // 1024)}KiB or more, or pass --no-canary" in message
    app = create_app(settings(kv_cache_memory=blocks * per_block), loaded=demo_model)
    assert app.state.fovea.canary.answer_tokens == blocks * block - (need - 1)


# ---- a family whose image-token count follows the image's size ----------------------------
@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("qwen") / "tiny-qwen2.5-vl", arch="tiny", seed=3)


def test_a_dynamic_resolution_model_gets_a_smaller_probe_image_and_keeps_its_answer(qwen_dir):
    codec = load_codec(qwen_dir)
    full = longest_prompt(codec, PROBE_SIZES[0])
    limit = full - 1 + ANSWER_TOKENS  # one token short of the full probe with a full answer
    fit = fit_canary(codec, MediaConfig(), limit)
    assert fit.size < PROBE_SIZES[0] and fit.answer_tokens == ANSWER_TOKENS and fit.tokens <= limit
    larger = [s for s in PROBE_SIZES if s > fit.size]
    assert all(longest_prompt(codec, s) + ANSWER_TOKENS > limit for s in larger)  # the largest that fits
    assert fit.image_tokens < 81  # a 256-pixel probe is 81 tokens of this processor
    smallest = min(longest_prompt(codec, s) for s in PROBE_SIZES)
    with pytest.raises(CanaryTooLong) as refused:
        fit_canary(codec, MediaConfig(), smallest)
    assert refused.value.need == smallest + 1


def test_the_fitted_canary_runs_within_the_limit(qwen_dir):
    loaded = load_model(qwen_dir, "cpu", "float32")
    limit = longest_prompt(loaded.codec, PROBE_SIZES[0]) - 1 + ANSWER_TOKENS
    engine = PagedEngine(loaded, PagedEngineConfig(max_num_seqs=2, max_model_len=limit))
    fit = fit_canary(loaded.codec, MediaConfig(), engine.max_context)
    canary = Canary(loaded, engine)
    canary.adapt(fit.size, fit.answer_tokens)

    async def run():
        engine.start()
        try:
            return await canary.run()  # a prompt past the limit would raise context_length_exceeded
        finally:
            engine.stop()

    result = asyncio.run(run())
    assert len(result.cases) == len(DEFAULT_CASES) and result.probe_size == fit.size < PROBE_SIZES[0]
