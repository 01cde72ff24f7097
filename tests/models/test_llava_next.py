"""LLaVA-NeXT on the one engine, against transformers, on a tiny random-weight checkpoint.

The checkpoint is written by ``fovea.testing.random_llava_next`` (transformers' own config and
processor classes, the real processor config's format at 112 px tiles): anyres grids chosen
among five pinpoints, unpadding, one ``image_newline`` per row, so images of different sizes
and aspect ratios fill different token counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil

import httpx
import pytest
import torch
from scene_helpers import data_url, free_port, start_server, stop_server
from test_qwen2_5_vl import noise, run
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from fovea.config import ServerSettings
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.reference import reference_generate, reference_logits
from fovea.engine.sampling.params import SamplingParams
from fovea.errors import ModelLoadError
from fovea.loading.contract import ContractError, check_contract
from fovea.loading.loader import load_model
from fovea.loading.prompt import PlaceholderMismatch, encode_prompt, render_chat
from fovea.loading.vision_part import load_vision_part
from fovea.testing.random_llava_next import write_model_dir
from fovea.testing.tolerance import assert_close_to_model

TILE, PATCHES = 112, 8  # the tiny checkpoint's tile side in px and in 14 px patches
SIZES = [(300, 200), (64, 90), (1, 1), (500, 120), (224, 224), (90, 330)]  # (width, height)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llnext(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("llnext") / "tiny-llava-next", arch="tiny", seed=5)
    return load_model(path, "cpu", "float32")


def messages_for(images: int, text: str = "you are a helpful") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]}]


def chat(model, images, text: str = "you are a helpful"):
    return encode_prompt(model, render_chat(model, messages_for(len(images), text)), images)


def images_of(sizes, seed: int = 0):
    return [noise(w, h, seed + i) for i, (w, h) in enumerate(sizes)]


def test_the_registry_loads_it_and_the_contract_holds(llnext):
    assert llnext.adapter.family.name == "llava_next" and llnext.image_token == "<image>"
    assert type(llnext.codec.image_processor).__name__ == "LlavaNextImageProcessorPil"  # the PIL/numpy one
    contract = check_contract(llnext)
    assert len(set(contract.probe_image_tokens)) == 2  # the two probe sizes fill different counts
    assert contract.recipe["image_grid_pinpoints"] == [[112, 224], [224, 112], [224, 224], [336, 112], [112, 336]]


def test_each_image_has_its_own_tiles_and_token_count(llnext):
    prompt = chat(llnext, images_of(SIZES))
    pinpoints = llnext.model.config.image_grid_pinpoints
    for image, (w, h) in zip(prompt.images, SIZES):
        tiles = image_size_to_num_patches((h, w), pinpoints, TILE)
        assert image.grid == (tiles, h, w)
        assert tuple(image.pixels.shape) == (tiles, 3, TILE, TILE)
    counts = prompt.image_token_counts
    assert len(set(counts)) >= 4 and sum(counts) == prompt.input_ids.count(llnext.image_token_id)
    # 300x200 by hand: the 2x2 grid (224 x 224 px) keeps the most of it; its 16x16 patches lose
    # 3 rows top and bottom to padding, leaving 10 rows of 16 and a newline each, after the
    # 8x8 base tile: 64 + 10 * 16 + 10.
    assert prompt.images[0].grid[0] == 5 and counts[0] == 64 + 10 * 16 + 10
    # 224x224 is exactly the 2x2 pinpoint: nothing to unpad, 16 rows of 16 plus 16 newlines.
    assert counts[4] == 64 + 16 * 16 + 16


def test_the_prompt_equals_transformers_apply_chat_template(llnext):
    images = images_of([(300, 200), (64, 90), (500, 120)], seed=1)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "you"}, {"type": "image"},
                                             {"type": "image"}]}]
    ours = encode_prompt(llnext, render_chat(llnext, messages), images).input_ids
    pending = iter(images)
    filled = [{**m, "content": [{**part, "image": next(pending)} if part["type"] == "image" else part
                                for part in m["content"]]} for m in messages]
    theirs = llnext.codec.processor.apply_chat_template(filled, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]
    theirs = theirs[0] if theirs and isinstance(theirs[0], list) else theirs
    assert ours == list(theirs)
    counts = llnext.codec.token_counts([(h, w) for w, h in [(300, 200), (64, 90), (500, 120)]])
    assert len(set(counts)) == 3 and ours.count(llnext.image_token_id) == sum(counts)
    # Each image's run of its own count, back to one placeholder, gives the unexpanded template's
    # ids (the template writes the images back to back, so their runs touch).
    plain = llnext.tokenizer(render_chat(llnext, messages), add_special_tokens=True)["input_ids"]
    collapsed, i, pending_counts = [], 0, iter(counts)
    while i < len(ours):
        collapsed.append(ours[i])
        i += next(pending_counts) if ours[i] == llnext.image_token_id else 1
    assert collapsed == list(plain) and plain.count(llnext.image_token_id) == 3


def test_vision_rows_equal_transformers_get_image_features(llnext):
    prompt = chat(llnext, images_of(SIZES, seed=3))
    rows = llnext.adapter.vision_forward(llnext)(prompt.images)  # all images in one vision call
    with torch.inference_mode():
        out = llnext.model.model.get_image_features(
            pixel_values=torch.cat([image.pixels for image in prompt.images]),
            image_sizes=torch.tensor([image.grid[1:] for image in prompt.images]))
    theirs = out.pooler_output if hasattr(out, "pooler_output") else out
    assert [r.shape[0] for r in rows] == prompt.image_token_counts
    assert len(rows) == len(theirs) and all(torch.equal(a, b) for a, b in zip(rows, theirs))
    # One image alone gives the same rows as in the batch.
    (alone,) = llnext.adapter.vision_forward(llnext)(prompt.images[:1])
    assert torch.equal(alone, rows[0])
    # The newline embedding closes each row: 300x200's first grid row is rows 64..79, then the newline.
    newline = llnext.model.model.image_newline
    assert torch.equal(rows[0][64 + 16], newline) and not torch.equal(rows[0][64 + 15], newline)
    assert torch.equal(rows[0][-1], newline)


def test_the_largest_dummy_image_is_the_largest_pinpoint(llnext):
    (dummy,) = llnext.adapter.dummy_images(llnext.model.config, llnext.codec, 1)
    real = chat(llnext, [noise(224, 224, 9)]).images[0]  # the 2x2 pinpoint: 5 tiles, no unpadding
    assert dummy.pixels.shape == real.pixels.shape and dummy.num_tokens == real.num_tokens == 336
    assert max(chat(llnext, images_of(SIZES)).image_token_counts) <= dummy.num_tokens
    (rows,) = llnext.adapter.vision_forward(llnext)([dummy])
    assert rows.shape == (dummy.num_tokens, llnext.model.config.text_config.hidden_size)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_greedy_tokens_equal_transformers_generate(llnext, overlap):
    """Two images of different sizes per prompt, through chunked prefill (64-token steps split
    the image runs) and decode; first-token log-probs against transformers' forward."""
    texts = ["you", "a helpful", "are you"]
    prompts = [chat(llnext, [noise(w, h, 10 + i), noise(h, w, 20 + i)], text)
               for i, ((w, h), text) in enumerate(zip(SIZES, texts))]
    engine = PagedEngine(llnext, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=64, overlap_steps=overlap))
    results = run(engine, [(p, GREEDY) for p in prompts])
    for prompt, (tokens, finish) in zip(prompts, results):
        ref_tokens = reference_generate(llnext, prompt, 12)  # stops at EOS; the engine ignores it
        assert ref_tokens and tokens[:len(ref_tokens)] == ref_tokens
        ref = torch.log_softmax(reference_logits(llnext, prompt), -1)
        assert_close_to_model(finish.first_logprobs, ref, llnext.model.config, len(prompt.input_ids))
        assert finish.finish_reason == "length"


def test_placeholder_counts_are_checked_before_the_engine(llnext):
    text = render_chat(llnext, messages_for(2, "you"))
    with pytest.raises(PlaceholderMismatch):
        encode_prompt(llnext, text, [noise(64, 64, 1)], template_rendered=False)
    with pytest.raises(PlaceholderMismatch):
        encode_prompt(llnext, text, [], template_rendered=False)


def test_the_vision_part_alone_encodes_as_the_whole_model(llnext, tensor_reads):
    """The encode-only loader: tower, projector and image_newline, no language-model tensor."""
    read = tensor_reads
    part = load_vision_part(llnext.path, "cpu", "float32")
    assert read and not any("language_model" in name or name.startswith("lm_head") for name in read)
    assert "model.image_newline" in read and len(read) == len(part.model.state_dict())
    vision = sum(p.numel() for m in llnext.adapter.vision_modules(llnext.model) for p in m.parameters())
    assert part.parameters == vision < sum(p.numel() for p in llnext.model.parameters())
    prompt = chat(llnext, images_of([(300, 200), (90, 330)], seed=30))
    with torch.inference_mode():
        ours = part.adapter.vision_forward(part)(prompt.images)
        theirs = llnext.adapter.vision_forward(llnext)(prompt.images)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_checkpoint_without_its_image_newline_is_refused_by_the_encode_only_loader(llnext, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "no-newline"
    shutil.copytree(llnext.path, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    (file,) = set(index["weight_map"].values())
    tensors = {k: v for k, v in load_file(copy / file).items() if k != "model.image_newline"}
    save_file(tensors, copy / file, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="image_newline"):
        load_vision_part(copy, "cpu", "float32")


@contextlib.contextmanager
def swapped_layer(module: torch.nn.Module, name: str, layer: torch.nn.Module):
    """``module.name`` replaced for a while (pytest's monkeypatch deletes a submodule on undo)."""
    original = getattr(module, name)
    setattr(module, name, layer)
    try:
        yield
    finally:
        setattr(module, name, original)


def test_the_contract_refuses_a_projector_narrower_than_the_language_model(llnext):
    projector = llnext.model.model.multi_modal_projector
    hidden = llnext.model.config.text_config.hidden_size
    with swapped_layer(projector, "linear_2", torch.nn.Linear(hidden, hidden // 2)), \
            pytest.raises(ContractError) as info:
        check_contract(llnext)
    parts = [v.part for v in info.value.violations]
    assert "projector output width" in parts
    assert any(str(hidden // 2) in v.actual for v in info.value.violations if v.part == "projector output width")


def test_the_contract_refuses_a_projector_for_another_tower(llnext):
    projector = llnext.model.model.multi_modal_projector
    hidden = llnext.model.config.text_config.hidden_size
    with swapped_layer(projector, "linear_1", torch.nn.Linear(32, hidden)), pytest.raises(ContractError) as info:
        check_contract(llnext)
    assert [v.part for v in info.value.violations] == ["projector input width"]
    assert check_contract(llnext).projector_in == 64  # restored: the real projector passes again


def test_a_torchvision_only_image_processor_is_refused(llnext, monkeypatch):
    import fovea.models.llava_next as family

    class LlavaNextImageProcessorFast:  # what an older transformers with torchvision resolves to
        image_grid_pinpoints = ((112, 224),)

    class Loaded:
        image_processor = LlavaNextImageProcessorFast()

    monkeypatch.setattr(family.AutoProcessor, "from_pretrained", lambda *a, **k: Loaded())
    with pytest.raises(ModelLoadError, match="PIL/numpy"):
        llnext.adapter.load_processor(llnext.path)


def test_fovea_serve_answers_a_llava_next_chat_over_http(llnext):
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False)
    live, server, thread = start_server(settings, llnext)
    try:
        body = {"model": llnext.name, "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(noise(120, 80, 7))}},
                    {"type": "text", "text": "you are"}]}]}
        reply = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        prompt = chat(llnext, [noise(120, 80, 7)], "you are")
        assert reply.json()["usage"]["prompt_tokens"] == len(prompt.input_ids)
        health = httpx.get(live.base_url + "/health", timeout=30).json()
        assert health["model_family"] == "llava_next"
    finally:
        stop_server(server, thread)


def test_the_canary_runs_on_this_family(llnext):
    """Random weights cannot name colours, so the canary must fail here, and say why, not crash."""
    from fovea.guard.canary import Canary

    async def main():
        engine = PagedEngine(llnext, PagedEngineConfig(num_blocks=256))
        engine.start()
        try:
            return await Canary(llnext, engine).run()
        finally:
            engine.stop()

    result = asyncio.run(main())
    assert not result.ok and result.reasons


def test_real_size_token_counts_equal_transformers_processor():
    """The 7B checkpoint's own processor (336 px tiles, no weights needed): the counts LLaVA-1.6
    is known for, and the ids transformers' processor builds for several images in one prompt."""
    from fovea.models.llava_next import LlavaNextCodec
    from fovea.testing.random_llava_next import ARCHITECTURES, build_processor

    processor = build_processor(ARCHITECTURES["llava-v1.6-vicuna-7b"])
    codec = LlavaNextCodec(processor, "<image>", processor.image_token_id, torch.float32)
    sizes = [(672, 672), (1000, 700), (336, 1008), (50, 40)]
    images = images_of(sizes, seed=60)
    messages = messages_for(len(images), "you")
    prompt = codec.encode(codec.render(messages), images)
    assert prompt.image_token_counts[0] == 576 + 48 * 48 + 48 == 2928  # 672x672: 2x2 tiles, nothing unpadded
    assert [image.grid[0] for image in prompt.images][:3] == [5, 5, 4]
    assert prompt.input_ids == codec.reference_ids(messages, images)
    assert len(set(prompt.image_token_counts)) == 4


@pytest.fixture(scope="module")
def llnext_mistral(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("llnext-mistral") / "tiny-llava-next-mistral",
                           arch="tiny-mistral", seed=6)
    return load_model(path, "cpu", "float32")


def test_a_mistral_language_model_equals_transformers_generate(llnext_mistral):
    """llava-v1.6-mistral's structure: Mistral's layers (no sliding window) on the paged engine."""
    model = llnext_mistral
    assert model.model.config.text_config.model_type == "mistral"
    check_contract(model)
    prompts = [chat(model, [noise(300, 200, 70), noise(90, 330, 71)], "you"), chat(model, [noise(64, 90, 72)], "a")]
    engine = PagedEngine(model, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=64))
    for prompt, (tokens, finish) in zip(prompts, run(engine, [(p, GREEDY) for p in prompts])):
        ref_tokens = reference_generate(model, prompt, 12)
        assert ref_tokens and tokens[:len(ref_tokens)] == ref_tokens
        assert_close_to_model(finish.first_logprobs, torch.log_softmax(reference_logits(model, prompt), -1),
                              model.model.config, len(prompt.input_ids))


def test_a_mistral_sliding_window_shorter_than_the_context_is_refused(llnext_mistral):
    import copy
    import dataclasses

    from fovea.engine.model.llama import PagedLlama

    spec = llnext_mistral.adapter.lm_spec(llnext_mistral.model)
    windowed = copy.deepcopy(spec.config)
    windowed.sliding_window = 256
    with pytest.raises(ModelLoadError, match="sliding_window: 256"):
        PagedLlama(dataclasses.replace(spec, config=windowed), 1024, None)
    windowed.sliding_window = 1024  # as long as the context: no token is ever outside it
    PagedLlama(dataclasses.replace(spec, config=windowed), 1024, None)


def test_the_contract_refuses_processor_pinpoints_that_differ_from_the_config(llnext, tmp_path):
    copy = tmp_path / "other-pinpoints"
    shutil.copytree(llnext.path, copy)
    for name in ("preprocessor_config.json", "processor_config.json"):
        data = json.loads((copy / name).read_text())
        target = data.get("image_processor", data)
        target["image_grid_pinpoints"] = [[112, 224], [224, 112], [336, 112], [112, 336]]  # no 2x2
        (copy / name).write_text(json.dumps(data))
    broken = load_model(copy, "cpu", "float32")
    assert broken.codec.image_processor.image_grid_pinpoints == [[112, 224], [224, 112], [336, 112], [112, 336]]
    with pytest.raises(ContractError) as info:
        check_contract(broken)
    assert "image_grid_pinpoints" in str(info.value)


def test_an_encode_worker_gives_the_same_rows_as_this_process(llnext):
    """E/PD: images of different tile counts cross to a separate encode-only process (its plan
    built from the family's dummy images) and come back bit-identical, with their grids checked."""
    from fovea.disagg.encoder_pool import EncoderPool

    contract = check_contract(llnext)
    pool = EncoderPool(llnext.path, workers=1, device="cpu", dtype="float32", model_id=contract.model_fingerprint,
                       recipe_fingerprint=contract.recipe_fingerprint, hidden=contract.lm_hidden, batch_images=8)
    pool.start()
    try:
        images = chat(llnext, images_of([(300, 200), (1, 1), (90, 330), (224, 224)], seed=80)).images
        rows = pool.encode(images)
    finally:
        pool.stop()
    reference = llnext.adapter.vision_forward(llnext)(images)
    assert [r.shape[0] for r in rows] == [image.num_tokens for image in images]
    assert all(torch.equal(got, want) for got, want in zip(rows, reference, strict=True))
