"""Qwen2.5-VL on the one engine, against transformers, on a tiny random-weight checkpoint.

The checkpoint is written by ``fovea.testing.random_qwen2_5_vl`` (transformers' own config
class, Qwen's special-token ids, chat template and ``Qwen2VLImageProcessor``): window and full
attention in the tower, M-RoPE sections, images of different sizes within the model's own
min_pixels/max_pixels.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from PIL import Image
from scene_helpers import data_url, free_port, start_server, stop_server

from fovea.config import ServerSettings
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, FinishEvent, TokenEvent
from fovea.engine.reference import reference_generate, reference_logits
from fovea.engine.runner.model_runner import chunk_positions
from fovea.engine.sampling.params import SamplingParams
from fovea.errors import InvalidRequest
from fovea.loading.contract import check_contract
from fovea.loading.loader import load_model
from fovea.loading.prompt import PlaceholderMismatch, encode_prompt, render_chat
from fovea.models.qwen2_5_vl import mrope_positions
from fovea.models.qwen_pixels import vision_pixels
from fovea.testing.random_qwen2_5_vl import write_model_dir
from fovea.testing.tolerance import assert_close_to_model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("qwen") / "tiny-qwen2.5-vl", arch="tiny", seed=3)
    return load_model(path, "cpu", "float32")


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = random.Random(seed)
    image = Image.effect_noise((width, height), 40 + seed % 30).convert("RGB")
    shifts = [rng.randrange(60) for _ in range(3)]
    return Image.merge("RGB", [band.point(lambda v, s=shift: (v + s) % 256) for band, shift in zip(image.split(), shifts)])


def patched(model, images) -> torch.Tensor:
    """The tower's rows for a prompt's images: resized uint8 images patched as the vision stage does."""
    return vision_pixels(images, lambda: model.adapter.patch_recipe(model), torch.device("cpu"), torch.float32)


def chat(model, images: list[Image.Image], text: str = "you are a helpful"):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return encode_prompt(model, render_chat(model, [{"role": "user", "content": content}]), images)


def run(engine: PagedEngine, jobs: list) -> list[tuple[list[int], FinishEvent]]:
    async def one(prompt, params, logprobs):
        tokens = []
        async for event in engine.generate(prompt, params, want_first_logprobs=logprobs):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                tokens.append(event.token_id)
            elif isinstance(event, ErrorEvent):
                raise event.error
            elif isinstance(event, FinishEvent):
                return tokens, event
        raise AssertionError("no finish event")

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(one(p, s, True) for p, s in jobs))
        finally:
            engine.stop()

    return asyncio.run(main())


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SIZES = [(300, 200), (64, 90), (1, 1), (5, 300), (900, 700)]


def test_the_registry_loads_it_and_the_contract_holds(qwen):
    assert qwen.adapter.family.name == "qwen2_5_vl" and qwen.image_token == "<|image_pad|>"
    contract = check_contract(qwen)
    # Dynamic resolution: the two probe images of different sizes fill different token counts.
    assert len(set(contract.probe_image_tokens)) == 2
    assert contract.recipe["size"]["longest_edge"] == 200_704  # the model's own max_pixels


def test_token_counts_follow_the_grid_and_max_pixels(qwen):
    prompt = chat(qwen, [noise(w, h, i) for i, (w, h) in enumerate(SIZES)])
    grids = [image.grid for image in prompt.images]
    assert [image.num_tokens for image in prompt.images] == [t * h * w // 4 for t, h, w in grids]
    assert sum(prompt.image_token_counts) == prompt.input_ids.count(qwen.image_token_id)
    assert grids[2] == (1, 4, 4)  # a 1-px image is resized up to the model's minimum (56 x 56 px)
    for t, h, w in grids:
        assert h * w * 14 * 14 <= 200_704  # within max_pixels
    assert prompt.positions is not None and len(prompt.positions[0]) == len(prompt.input_ids)


def test_the_prompt_equals_transformers_apply_chat_template(qwen):
    images = [noise(300, 200, 1), noise(64, 90, 2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "you"}, {"type": "image"}]}]
    ours = encode_prompt(qwen, render_chat(qwen, messages), images).input_ids
    assert ours == qwen.codec.reference_ids(messages, images)
    plain = qwen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    plain = plain["input_ids"] if hasattr(plain, "keys") else plain
    # Collapsing each image's run back to one placeholder gives transformers' unexpanded ids.
    collapsed = [t for i, t in enumerate(ours) if t != qwen.image_token_id or ours[i - 1] != qwen.image_token_id]
    assert collapsed == list(plain)


def test_mrope_positions_equal_transformers_get_rope_index(qwen):
    prompt = chat(qwen, [noise(300, 200, 5), noise(64, 90, 6)])
    ids = torch.tensor([prompt.input_ids])
    grid = torch.tensor([image.grid for image in prompt.images])
    inner = qwen.model.model
    try:
        theirs, delta = inner.get_rope_index(ids, mm_token_type_ids=(ids == qwen.image_token_id).int(),
                                            image_grid_thw=grid)
    except TypeError:  # transformers before the mm_token_type_ids argument
        theirs, delta = inner.get_rope_index(ids, image_grid_thw=grid)
    assert theirs[:, 0].tolist() == prompt.positions
    assert int(delta) == prompt.position_delta < 0  # images compress positions


def test_positions_past_the_prompt_shift_by_the_delta():
    ids = [7, 1, 1, 1, 1, 8]  # text, a 2x2-token image, text
    rows, delta = mrope_positions(ids, 1, [(1, 4, 4)], 2)
    assert rows == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]] and delta == 4 - 6

    class Seq:
        mrope, position_delta, prompt_len = rows, delta, 6

    # A chunk that straddles the prompt's end (recomputed after a preemption): prompt rows, then i + delta.
    assert chunk_positions(Seq, 4, 8) == [[1, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5]]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_greedy_tokens_equal_transformers_generate(qwen, overlap):
    """Several images per prompt, of different sizes, through chunked prefill (24-token steps
    split the image runs) and decode; first-token log-probs against transformers' forward."""
    prompts = [chat(qwen, [noise(w, h, 10 + i), noise(h, w, 20 + i)], text)
               for i, ((w, h), text) in enumerate(zip(SIZES, ["you", "a helpful", "are you", "assistant", "a"]))]
    engine = PagedEngine(qwen, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=24, overlap_steps=overlap))
    results = run(engine, [(p, GREEDY) for p in prompts])
    for prompt, (tokens, finish) in zip(prompts, results):
        ref_tokens = reference_generate(qwen, prompt, 12)  # stops at EOS; the engine ignores it
        assert ref_tokens and tokens[:len(ref_tokens)] == ref_tokens
        ref = torch.log_softmax(reference_logits(qwen, prompt), -1)
        assert_close_to_model(finish.first_logprobs, ref, qwen.model.config, len(prompt.input_ids))
        assert finish.finish_reason == "length"


def test_greedy_parity_without_eos_shortcuts(qwen):
    """The reference stops at EOS; with ignore_eos the engine does not. Compare where both run."""
    prompt = chat(qwen, [noise(300, 200, 40), noise(1, 1, 41), noise(64, 90, 42)])
    (tokens, _), = run(PagedEngine(qwen, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=32)),
                       [(prompt, GREEDY)])
    ref = reference_generate(qwen, prompt, 12)
    assert tokens[:len(ref)] == ref and len(ref) >= 1


def test_the_prefix_cache_keeps_positions_right(qwen):
    """The same images again: the second request's prefill starts from cached blocks, whose
    keys were rotated by M-RoPE positions; its answer must still equal transformers'."""
    images = [noise(300, 200, 50), noise(64, 90, 51)]
    first, second = chat(qwen, images, "you are"), chat(qwen, images, "you are a helpful assistant")
    engine = PagedEngine(qwen, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=64))
    run(engine, [(first, GREEDY)])
    hits = engine.block_manager.hits if hasattr(engine.block_manager, "hits") else None
    (tokens, finish), = run(engine, [(second, GREEDY)])
    ref = reference_generate(qwen, second, 12)
    assert tokens[:len(ref)] == ref
    assert_close_to_model(finish.first_logprobs, torch.log_softmax(reference_logits(qwen, second), -1),
                          qwen.model.config, len(second.input_ids))
    if hits is not None:
        assert engine.block_manager.hits > hits


def test_a_strip_past_the_processors_aspect_limit_is_a_400(qwen):
    with pytest.raises(InvalidRequest) as info:
        chat(qwen, [noise(3000, 10, 1)])
    assert info.value.status == 400 and info.value.code == "invalid_image" and "aspect ratio" in info.value.message


def test_placeholder_counts_are_checked_before_the_engine(qwen):
    text = render_chat(qwen, [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                            {"type": "text", "text": "you"}]}])
    with pytest.raises(PlaceholderMismatch):
        encode_prompt(qwen, text, [noise(64, 64, 1)], template_rendered=False)


def test_the_engine_refuses_an_image_prompt_without_mrope_positions(qwen):
    import dataclasses

    prompt = dataclasses.replace(chat(qwen, [noise(64, 64, 3)]), positions=None, position_delta=0)

    async def main():
        engine = PagedEngine(qwen, PagedEngineConfig(num_blocks=64))
        engine.start()
        try:
            return [e async for e in engine.generate(prompt, GREEDY)]
        finally:
            engine.stop()

    (event,) = asyncio.run(main())
    assert isinstance(event, ErrorEvent) and isinstance(event.error, PlaceholderMismatch)
    assert "M-RoPE" in str(event.error)


def test_fovea_serve_answers_a_qwen_chat_over_http(qwen):
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False)
    live, server, thread = start_server(settings, qwen)
    try:
        body = {"model": qwen.name, "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(noise(120, 80, 7))}},
                    {"type": "text", "text": "you are"}]}]}
        reply = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        prompt = chat(qwen, [noise(120, 80, 7)], "you are")
        assert usage["prompt_tokens"] == len(prompt.input_ids)
        health = httpx.get(live.base_url + "/health", timeout=30).json()
        assert health["model_family"] == "qwen2_5_vl"
    finally:
        stop_server(server, thread)


def test_served_greedy_answers_equal_those_from_the_whole_processor(qwen, monkeypatch):
    """The engine core in its own process: images resized in the API process cross /dev/shm as
    uint8 and are patched in the core. The served greedy answer and its log-probabilities equal
    the engine's on the same prompt with the processor's own patches (the path before)."""
    import fovea.models.qwen2_5_vl as family

    images = [noise(1280, 720, 11), noise(333, 517, 12)]
    assert all(image.pixels.dtype == torch.uint8 for image in chat(qwen, images).images)  # what the server sends
    settings = ServerSettings(model=str(qwen.path), host="127.0.0.1", port=free_port(), device="cpu", dtype="float32",
                              canary=False, engine_core="process")
    live, server, thread = start_server(settings, None)
    try:
        body = {"model": qwen.name, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True,
                "top_logprobs": 2, "messages": [{"role": "user", "content": [
                    *({"type": "image_url", "image_url": {"url": data_url(image)}} for image in images),
                    {"type": "text", "text": "you are"}]}]}
        reply = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        served = reply.json()["choices"][0]
    finally:
        stop_server(server, thread)
    monkeypatch.setattr(family, "host_resize_supported", lambda ip: False)  # the whole processor on the host
    before = chat(qwen, images, "you are")
    assert all(image.pixels.dim() == 2 and image.pixels.dtype == torch.float32 for image in before.images)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)

    async def answer():
        engine = PagedEngine(qwen, PagedEngineConfig(num_blocks=256))
        engine.start()
        try:
            return [event async for event in engine.generate(before, params)]
        finally:
            engine.stop()

    events = asyncio.run(answer())
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and len(tokens) == 8
    assert served["message"]["content"] == finish.text
    ref = reference_generate(qwen, before, 8)  # transformers on the processor's own patches
    assert [t.token_id for t in tokens][:len(ref)] == ref
    content = served["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == pytest.approx([t.logprob.logprob for t in tokens], abs=1e-6)
    assert [top["logprob"] for entry in content for top in entry["top_logprobs"]] == pytest.approx(
        [lp for t in tokens for _, lp in t.logprob.top], abs=1e-6)


def test_the_contract_catches_positions_that_differ_from_transformers(qwen, monkeypatch):
    import fovea.models.qwen2_5_vl as family
    from fovea.loading.contract import ContractError

    real = family.mrope_positions

    def swapped(*args):  # height and width rows exchanged: a transposed image
        rows, delta = real(*args)
        return [rows[0], rows[2], rows[1]], delta

    monkeypatch.setattr(family, "mrope_positions", swapped)
    with pytest.raises(ContractError) as info:
        check_contract(qwen)
    assert [v.part for v in info.value.violations] == ["position ids"]


def test_the_canary_runs_on_this_family(qwen):
    """Random weights cannot name colours, so the canary must fail here, and say why, not crash."""
    from fovea.guard.canary import Canary

    async def main():
        engine = PagedEngine(qwen, PagedEngineConfig(num_blocks=256))
        engine.start()
        try:
            return await Canary(qwen, engine).run()
        finally:
            engine.stop()

    result = asyncio.run(main())
    assert not result.ok and result.reasons


def test_the_profile_images_fit_a_prompt_of_max_tokens(qwen):
    """The memory profile encodes only images a prompt can hold: at most max_tokens image tokens."""
    codec, adapter = qwen.codec, qwen.adapter
    largest = adapter.dummy_images(None, codec, 1)[0]
    capped = adapter.dummy_images(None, codec, 2, max_tokens=largest.num_tokens // 4)
    assert len(capped) == 2
    for image in capped:
        _, h, w = image.grid
        assert image.num_tokens <= largest.num_tokens // 4 < largest.num_tokens
        # As the codec sends them: resized uint8 images, which the vision stage patches into h * w rows.
        assert image.num_tokens == h * w // 4 and image.pixels.shape == (h * 14, w * 14, 3)
        assert adapter.patch_recipe(qwen).patches(image.pixels).shape[0] == h * w
    assert adapter.dummy_images(None, codec, 1, max_tokens=10 ** 9)[0].grid == largest.grid
    on_meta = adapter.dummy_images(None, codec, 1, device="meta")[0]  # made where asked: no host pixels
    assert on_meta.pixels.device.type == "meta" and on_meta.pixels.shape == largest.pixels.shape
