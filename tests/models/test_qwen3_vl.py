"""Qwen3-VL on the one engine, against transformers, on a tiny random-weight checkpoint.

The checkpoint is written by ``fovea.testing.random_qwen3_vl``: transformers' own config class,
Qwen's special-token ids, Qwen3-VL's chat template and preprocessor files, two DeepStack levels
over three decoder layers, q/k norms and interleaved M-RoPE sections.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import httpx
import pytest
import torch
from scene_helpers import data_url, free_port, start_server, stop_server
from test_qwen2_5_vl import noise, patched, run
from transformers import Qwen3VLProcessor
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from fovea.config import ServerSettings
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.model.llama import PagedLlama
from fovea.engine.reference import reference_generate, reference_logits
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.contract import check_contract
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat
from fovea.testing.random_qwen3_vl import write_model_dir
from fovea.testing.tolerance import assert_close_for, assert_close_to_model, path_len_of

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SIZES = [(300, 200), (64, 90), (1, 1), (40, 600), (900, 700)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-vl", arch="tiny", seed=3)
    return load_model(path, "cpu", "float32")


def chat(model, images, text: str = "you are a helpful"):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return encode_prompt(model, render_chat(model, [{"role": "user", "content": content}]), images)


class NoVideoProcessor(Qwen3VLProcessor):
    """transformers' own Qwen3VLProcessor without its video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


def transformers_processor(model) -> Qwen3VLProcessor:
    tokenizer = model.processor.tokenizer
    return NoVideoProcessor(image_processor=model.processor.image_processor, tokenizer=tokenizer,
                            video_processor=None, chat_template=tokenizer.chat_template)


def test_the_registry_loads_it_and_the_contract_holds(qwen3):
    assert qwen3.adapter.family.name == "qwen3_vl" and qwen3.image_token == "<|image_pad|>"
    contract = check_contract(qwen3)
    assert len(set(contract.probe_image_tokens)) == 2  # dynamic resolution
    spec = qwen3.adapter.lm_spec(qwen3.model)
    assert spec.deepstack_layers == 2 and spec.mrope_interleaved and spec.mrope_section == [2, 3, 3]


def test_the_prompt_equals_transformers_processor_apply_chat_template(qwen3):
    images = [noise(w, h, i) for i, (w, h) in enumerate(SIZES[:4])]
    content = [{"type": "image", "image": images[0]}, {"type": "text", "text": "you"},
               {"type": "image", "image": images[1]}, {"type": "image", "image": images[2]},
               {"type": "text", "text": "a helpful"}, {"type": "image", "image": images[3]}]
    messages = [{"role": "user", "content": content}]
    theirs = transformers_processor(qwen3).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               return_dict=True, return_tensors="pt")
    ours = encode_prompt(qwen3, render_chat(qwen3, messages), images)
    assert ours.input_ids == theirs["input_ids"][0].tolist()
    assert ours.input_ids == qwen3.codec.reference_ids(messages, images)  # what the contract checks
    assert [im.grid for im in ours.images] == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
    # The resized images, patched as the vision stage patches them: the processor's pixel values, bit for bit.
    assert torch.equal(patched(qwen3, ours.images), theirs["pixel_values"].to(torch.float32))
    # M-RoPE rows as transformers' get_rope_index computes them from the processor's outputs.
    rows, delta = qwen3.model.model.get_rope_index(theirs["input_ids"], mm_token_type_ids=theirs["mm_token_type_ids"],
                                                   image_grid_thw=theirs["image_grid_thw"])
    assert rows[:, 0].tolist() == ours.positions and int(delta) == ours.position_delta < 0


def test_images_resized_on_the_device_patch_to_the_processors_pixel_values(qwen3, monkeypatch):
    """As served on a GPU (``resize_on_device``): the images cross at their decoded size and the
    vision stage resizes them to their grids (16 px patches here), bit for bit."""
    monkeypatch.setattr(qwen3.codec, "resize_on_device", True)
    images = [noise(w, h, i) for i, (w, h) in enumerate(SIZES)]
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "you"}]
    messages = [{"role": "user", "content": content}]
    theirs = transformers_processor(qwen3).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               return_dict=True, return_tensors="pt")
    ours = encode_prompt(qwen3, render_chat(qwen3, messages), images)
    assert [im.grid for im in ours.images] == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
    assert [tuple(im.pixels.shape) for im in ours.images] == [(h, w, 3) for w, h in SIZES]
    assert torch.equal(patched(qwen3, ours.images), theirs["pixel_values"].to(torch.float32))
    assert check_contract(qwen3).recipe_fingerprint  # the start-up check, on the deferred path


def test_interleaved_mrope_tables_equal_transformers(qwen3):
    """Each frequency rotates by the row transformers' Qwen3VLTextRotaryEmbedding gives it."""
    prompt = chat(qwen3, [noise(300, 200, 5)])
    llama = PagedLlama(qwen3.adapter.lm_spec(qwen3.model), 4096, None)
    positions = torch.tensor(prompt.positions)
    cos, sin, index = llama.rope_tables(positions)
    rotary = Qwen3VLTextRotaryEmbedding(qwen3.model.config.text_config)
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(1))
    # cos and sin of position · frequency: the product's rounding moves the angle by eps · |angle|.
    angle = float(positions.max()) + 1
    assert_close_for(cos[index], ref_cos[0], torch.float32, 1, scale=angle)
    assert_close_for(sin[index], ref_sin[0], torch.float32, 1, scale=angle)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_greedy_tokens_equal_transformers_generate(qwen3, overlap):
    """Several images of different sizes per prompt through 24-token chunked prefill (chunks end
    inside image runs, so a chunk holds part of an image's DeepStack rows), with prefill chunks of
    one prompt beside decode rows of another in the same step."""
    prompts = [chat(qwen3, [noise(w, h, 10 + i), noise(h, w, 20 + i)], text)
               for i, ((w, h), text) in enumerate(zip(SIZES, ["you", "a helpful", "are you", "assistant", "a"]))]
    engine = PagedEngine(qwen3, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=24, overlap_steps=overlap))
    mixed, split = [], []
    execute = engine.runner.execute

    def spy(plan, previous=None):
        prefills = plan.chunks[plan.num_decodes:]
        for c in prefills:
            inside = c.seq.image_of_pos[c.start:min(c.end, c.seq.prompt_len)]
            before = c.seq.image_of_pos[c.start - 1] if c.start else -1
            if inside and inside[0] >= 0 and before == inside[0]:
                split.append(c)  # this chunk starts in the middle of an image's tokens
            if plan.num_decodes and any(i >= 0 for i in inside):
                mixed.append(c)
        return execute(plan, previous)

    engine.runner.execute = spy
    results = run(engine, [(p, GREEDY) for p in prompts])
    assert split and mixed
    for prompt, (tokens, finish) in zip(prompts, results):
        ref_tokens = reference_generate(qwen3, prompt, 10)
        assert ref_tokens and tokens[:len(ref_tokens)] == ref_tokens
        ref = torch.log_softmax(reference_logits(qwen3, prompt), -1)
        assert_close_to_model(finish.first_logprobs, ref, qwen3.model.config, len(prompt.input_ids))


def test_vision_rows_equal_transformers_get_image_features(qwen3):
    """The adapter's rows (merged embedding, then each DeepStack level) are what transformers'
    ``get_image_features`` returns, whichever shape it returns them in (5.x: split per image)."""
    prompt = chat(qwen3, [noise(300, 200, 40), noise(64, 90, 41)])
    rows = torch.cat(qwen3.adapter.vision_forward(qwen3)(prompt.images))
    with torch.inference_mode():
        out = qwen3.model.model.get_image_features(
            pixel_values=patched(qwen3, prompt.images),
            image_grid_thw=torch.tensor([image.grid for image in prompt.images]))
    theirs = qwen3.adapter.vision_rows(out)
    levels = len(qwen3.model.config.vision_config.deepstack_visual_indexes)
    assert theirs.shape == rows.shape == (sum(prompt.image_token_counts),
                                          (1 + levels) * qwen3.model.config.text_config.hidden_size)
    assert torch.equal(theirs, rows)


def test_deepstack_features_reach_the_language_model(qwen3, monkeypatch):
    """Without the DeepStack adds the engine's answer moves away from transformers': the parity
    above depends on them."""
    prompt = chat(qwen3, [noise(300, 200, 30), noise(64, 90, 31)])
    ref = torch.log_softmax(reference_logits(qwen3, prompt), -1)
    monkeypatch.setattr(PagedLlama, "add_deepstack", staticmethod(lambda hidden, deepstack, layer: None))
    (_, finish), = run(PagedEngine(qwen3, PagedEngineConfig(num_blocks=128)), [(prompt, GREEDY)])
    with pytest.raises(AssertionError, match="exceeds"):  # beyond what rounding explains
        assert_close_to_model(finish.first_logprobs, ref, qwen3.model.config, len(prompt.input_ids))


def test_a_prefix_cache_hit_starts_inside_an_image(qwen3):
    """The same images again: the second prefill starts from cached blocks (the first ones end
    inside the first image), so its first chunk holds only the rest of that image's DeepStack
    rows; its answer must still equal transformers'."""
    images = [noise(300, 200, 50), noise(64, 90, 51)]
    first, second = chat(qwen3, images, "you are"), chat(qwen3, images, "you are a helpful assistant")
    engine = PagedEngine(qwen3, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=64))
    run(engine, [(first, GREEDY)])
    starts = []
    execute = engine.runner.execute

    def spy(plan, previous=None):
        starts.extend((c.start, c.seq.image_of_pos[c.start]) for c in plan.chunks[plan.num_decodes:]
                      if c.start < c.seq.prompt_len)
        return execute(plan, previous)

    engine.runner.execute = spy
    (tokens, finish), = run(engine, [(second, GREEDY)])
    assert starts[0][0] > 0 and starts[0][1] >= 0  # a cache hit, resuming within an image run
    ref = reference_generate(qwen3, second, 10)
    assert tokens[:len(ref)] == ref
    assert_close_to_model(finish.first_logprobs, torch.log_softmax(reference_logits(qwen3, second), -1),
                          qwen3.model.config, len(second.input_ids))


def test_fovea_serve_answers_a_qwen3_chat_over_http(qwen3):
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False)
    live, server, thread = start_server(settings, qwen3)
    image = noise(120, 80, 7)  # one object: effect_noise draws new noise on every call
    try:
        body = {"model": qwen3.name, "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": "you are"}]}]}
        reply = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        prompt = chat(qwen3, [image], "you are")
        assert reply.json()["usage"]["prompt_tokens"] == len(prompt.input_ids)
        ref = reference_generate(qwen3, prompt, 5)  # the served answer is transformers'
        # The server leaves special tokens out of the text (skip_special_tokens, on by default).
        assert reply.json()["choices"][0]["message"]["content"] == qwen3.tokenizer.decode(ref, skip_special_tokens=True)
        assert httpx.get(live.base_url + "/health", timeout=30).json()["model_family"] == "qwen3_vl"
    finally:
        stop_server(server, thread)


def test_the_canary_runs_on_this_family(qwen3):
    """Random weights cannot name colours, so the canary must fail here, and say why, not crash."""
    import asyncio

    from fovea.guard.canary import Canary

    async def main():
        engine = PagedEngine(qwen3, PagedEngineConfig(num_blocks=256))
        engine.start()
        try:
            return await Canary(qwen3, engine).run()
        finally:
            engine.stop()

    result = asyncio.run(main())
    assert not result.ok and result.reasons


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
def test_the_fused_forward_runs_qwen3_norms_mrope_and_deepstack(qwen3):
    """The CUDA configuration (fused weights, Triton norm/rotary kernels) against the torch one on a
    prefill with interleaved M-RoPE rows and DeepStack rows, then a decode step."""
    from fovea.engine.model.attention import AttnMeta, PrefillSpan, attention_backend
    from fovea.engine.model.kv_cache import KVCache

    prompt = chat(qwen3, [noise(64, 90, 60)])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else the interpreter
    n = len(prompt.input_ids)
    gen = torch.Generator().manual_seed(0)
    image_rows = torch.tensor([i for i, t in enumerate(prompt.input_ids) if t == qwen3.image_token_id],
                              device=device)
    features = (torch.randn((len(image_rows), 2, 64), generator=gen) * 0.5).to(device)

    def logits(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        llama = PagedLlama(qwen3.adapter.lm_spec(copy.deepcopy(qwen3.model).to(device)), 4096, attention_backend("torch"),
                           fused=fused)
        cache = KVCache(llama.kv_shape(16), 16, device)
        blocks = torch.arange(16, device=device)
        meta = AttnMeta(slot_mapping=torch.arange(n, device=device), prefills=[PrefillSpan(0, n, 0, blocks)])
        with torch.inference_mode():
            first = llama.forward(llama.embed_ids(torch.tensor(prompt.input_ids, device=device)),
                                  torch.tensor(prompt.positions, device=device),
                                  meta, cache, torch.tensor([n - 1], device=device), (image_rows, features)).float()
            decode = AttnMeta(slot_mapping=torch.tensor([n], device=device), num_decodes=1,
                              block_tables=blocks.view(1, -1).to(torch.int32),
                              context_lens=torch.tensor([n + 1], dtype=torch.int32, device=device))
            second = llama.forward(llama.embed_ids(torch.tensor([5], device=device)),
                                   torch.tensor([n + prompt.position_delta], device=device),
                                   decode, cache).float()
        return first, second

    ref_first, ref_second = logits(False)
    got_first, got_second = logits(True)
    path = path_len_of(qwen3.model.config.text_config, len(prompt.input_ids) + 1)
    assert_close_for(got_first, ref_first, torch.float32, path, what="prefill")
    assert_close_for(got_second, ref_second, torch.float32, path, what="decode")


def test_e_pd_hands_deepstack_rows_over_and_answers_as_agg(qwen3):
    """An encode worker process (vision weights only) returns each image's embedding and DeepStack
    levels; the PD side's answer is transformers' own."""
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False,
                              topology="e_pd", encode_workers=1, encode_timeout_s=30.0)
    live, server, thread = start_server(settings, qwen3)
    image = noise(200, 120, 9)
    try:
        body = {"model": qwen3.name, "max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "you are"}]}]}
        reply = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        ref = reference_generate(qwen3, chat(qwen3, [image], "you are"), 5)
        # The server leaves special tokens out of the text (skip_special_tokens, on by default).
        assert reply.json()["choices"][0]["message"]["content"] == qwen3.tokenizer.decode(ref, skip_special_tokens=True)
    finally:
        stop_server(server, thread)


def test_preempted_sequences_recompute_their_deepstack_rows(qwen3):
    """A KV cache too small for every request at once: sequences are preempted and recomputed
    (their prompt, DeepStack rows included, and the tokens they had generated); answers still
    equal transformers'."""
    prompts = [chat(qwen3, [noise(300, 200, 80 + i)], "you are") for i in range(3)]
    need = max(len(p.input_ids) for p in prompts) + GREEDY.max_tokens
    engine = PagedEngine(qwen3, PagedEngineConfig(num_blocks=-(-need // 16) * 2, max_num_batched_tokens=64))
    results = run(engine, [(p, GREEDY) for p in prompts])
    assert engine.scheduler.num_preemptions > 0
    for prompt, (tokens, _) in zip(prompts, results):
        ref = reference_generate(qwen3, prompt, GREEDY.max_tokens)
        assert ref and tokens[:len(ref)] == ref
