"""fovea_vlm: a custom VLM served from its config alone, against its plain-torch reference.

Two tiny random checkpoints written by ``fovea.testing.random_fovea_vlm``: ``tiny`` (SigLIP
tower at 56 px, strategy "full", 16 image tokens; Qwen2 LM) and ``tiny-clip-llama`` (CLIP at
112 px, layers -2 and -1 concatenated, CLS dropped, 64 image tokens; Llama LM). The
reference is ``FoveaVLMForConditionalGeneration``: the tower's whole forward, the projector,
the rows scattered into transformers' own causal LM's input embeddings, and its ``generate``.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from scene_helpers import data_url, free_port, start_server, stop_server
from test_qwen2_5_vl import noise, run

from fovea.config import ServerSettings
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.reference import reference_generate, reference_logits
from fovea.engine.sampling.params import SamplingParams
from fovea.errors import ModelLoadError
from fovea.loading.contract import ContractError, check_contract
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat
from fovea.loading.vision_part import load_vision_part
from fovea.testing.random_fovea_vlm import write_model_dir
from fovea.testing.tolerance import assert_close_for, assert_close_to_model, vision_path_len

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Image tokens per image, by hand: SigLIP 56/14 = 4 -> 16 patches, all kept ("full");
# CLIP 112/14 = 8 -> 64 patches (+ CLS, dropped by "default").
TOKENS = {"tiny": 16, "tiny-clip-llama": 64}
TEXT_TYPES = {"tiny": "qwen2", "tiny-clip-llama": "llama"}
IMAGE_ID, BOS = 32000, 1


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fovea-vlm")
    return {arch: write_model_dir(root / arch, arch=arch, seed=3) for arch in TOKENS}


@pytest.fixture(scope="module", params=list(TOKENS))
def vlm(request, dirs):
    return request.param, load_model(dirs[request.param], "cpu", "float32")


def messages_for(images: int, text: str = "you are a helpful") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]}]


def chat(model, images, text: str = "you are a helpful"):
    return encode_prompt(model, render_chat(model, messages_for(len(images), text)), images)


def test_the_registry_loads_it_and_the_contract_holds(vlm):
    arch, model = vlm
    assert model.adapter.family.name == "fovea_vlm" and model.model_type == "fovea_vlm"
    assert model.model.config.text_config.model_type == TEXT_TYPES[arch]
    assert type(model.codec.image_processor).__name__.endswith("ImageProcessorPil")  # the PIL/numpy one
    contract = check_contract(model)
    assert contract.probe_image_tokens == [TOKENS[arch]] * 2
    layers = 2 if arch == "tiny-clip-llama" else 1
    assert contract.vision_width == contract.projector_in == 64 * layers and contract.lm_hidden == 128


def test_prompt_ids_equal_apply_chat_template_with_the_placeholder_expanded(vlm):
    arch, model = vlm
    tokenizer = model.tokenizer
    for n in (0, 1, 2):
        images = [noise(90 + 20 * i, 60, i) for i in range(n)]
        ours = chat(model, images, "you are").input_ids
        plain = tokenizer.apply_chat_template(messages_for(n, "you are"), add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
        assert plain.count(IMAGE_ID) == n and plain[0] == BOS and plain[1] != BOS
        expanded = [t for i in plain for t in ([i] * TOKENS[arch] if i == IMAGE_ID else [i])]
        assert ours == expanded
        assert ours.count(IMAGE_ID) == n * TOKENS[arch]


def test_vision_rows_equal_the_reference_forward(vlm):
    _, model = vlm
    prompt = chat(model, [noise(90, 60, 1), noise(40, 130, 2)])
    rows = model.adapter.vision_forward(model)(prompt.images)
    with torch.inference_mode():
        theirs = model.model.image_features(torch.stack([image.pixels for image in prompt.images]))
    assert [r.shape for r in rows] == [torch.Size([prompt.images[0].num_tokens, 128])] * 2
    for a, b in zip(rows, theirs, strict=True):
        assert_close_for(a, b, torch.float32, vision_path_len(model.model.config, 4 * a.shape[0]))
    with pytest.raises(AssertionError, match="exceeds"):  # two images, two different runs of rows
        assert_close_for(rows[0], rows[1], torch.float32,
                         vision_path_len(model.model.config, 4 * rows[0].shape[0]))


def test_the_reference_forward_sees_the_image(vlm):
    _, model = vlm
    one, other = chat(model, [noise(90, 60, 4)]), chat(model, [noise(90, 60, 5)])
    assert one.input_ids == other.input_ids
    with pytest.raises(AssertionError, match="exceeds"):  # further apart than rounding explains
        assert_close_to_model(reference_logits(model, one), reference_logits(model, other),
                              model.model.config, len(one.input_ids))


def test_greedy_tokens_equal_the_reference_generate(vlm):
    """Images in chunked prefill (32-token steps split the image runs) and decode; first-token
    log-probs against the reference forward."""
    _, model = vlm
    prompts = [chat(model, [noise(90, 60, 10), noise(60, 90, 11)], "you"), chat(model, [noise(200, 50, 12)], "a"),
               chat(model, [], "are you")]
    engine = PagedEngine(model, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=32))
    for prompt, (tokens, finish) in zip(prompts, run(engine, [(p, GREEDY) for p in prompts]), strict=True):
        ref_tokens = reference_generate(model, prompt, GREEDY.max_tokens)  # stops at EOS; the engine ignores it
        assert ref_tokens and tokens[:len(ref_tokens)] == ref_tokens
        ref = torch.log_softmax(reference_logits(model, prompt), -1)
        assert_close_to_model(finish.first_logprobs, ref, model.model.config, len(prompt.input_ids))


def test_fovea_serve_answers_a_chat_with_an_image(vlm):
    _, model = vlm
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False)
    live, server, thread = start_server(settings, model)
    try:
        body = {"model": model.name, "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(noise(120, 80, 7))}},
                    {"type": "text", "text": "you are"}]}]}
        reply = httpx.post(live.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        prompt = chat(model, [noise(120, 80, 7)], "you are")
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] == len(prompt.input_ids) and usage["completion_tokens"] >= 1
        health = httpx.get(live.base_url + "/health", timeout=30).json()
        assert health["model_family"] == "fovea_vlm"
    finally:
        stop_server(server, thread)


def test_the_encode_only_loader_reads_no_language_model_tensor(vlm, tensor_reads):
    _, model = vlm
    read = tensor_reads
    part = load_vision_part(model.path, "cpu", "float32")
    assert read and not any(name.startswith("language_model.") for name in read)
    assert {name.split(".")[0] for name in read} == {"vision_tower", "projector"}
    assert len(read) == len(part.model.state_dict())
    vision = sum(p.numel() for m in model.adapter.vision_modules(model.model) for p in m.parameters())
    assert part.parameters == vision < sum(p.numel() for p in model.model.parameters())
    images = chat(model, [noise(90, 60, 30), noise(33, 77, 31)]).images
    ours, theirs = part.adapter.vision_forward(part)(images), model.adapter.vision_forward(model)(images)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_the_contract_refuses_a_projector_for_another_tower(vlm):
    _, model = vlm
    linears = model.model.projector.linears
    original = linears[0]
    linears[0] = torch.nn.Linear(32, original.out_features)
    try:
        with pytest.raises(ContractError) as info:
            check_contract(model)
    finally:
        linears[0] = original
    assert [v.part for v in info.value.violations] == ["projector input width"]
    check_contract(model)  # restored: the real projector passes again


def edit_config(data: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        data = data[part]
    if value is DELETE:
        del data[leaf]
    else:
        data[leaf] = value


DELETE = object()
REFUSALS = [  # (file, field, new value, what the message names)
    ("config.json", "image_token_id", DELETE, "image_token_id is missing"),
    ("config.json", "image_token_id", 32001, "has id 32000 in the tokenizer, but the model expects image_token_id 32001"),
    ("config.json", "projector.input_width", 96, "projector.input_width is 96"),
    ("config.json", "projector.output_width", 64, "projector.output_width is 64"),
    ("config.json", "projector.type", "qformer", "projector.type is 'qformer'"),
    ("config.json", "projector.layers", 0, "projector.layers is 0"),
    ("config.json", "text_config.model_type", "gpt2", "text_config.model_type is 'gpt2'"),
    ("config.json", "vision_config.model_type", "no_such_tower", "vision_config.model_type 'no_such_tower'"),
    ("config.json", "vision_config", {"model_type": "bert"}, "vision_config.image_size is missing"),
    ("config.json", "vision_feature_select_strategy", "cls", "vision_feature_select_strategy is 'cls'"),
    ("config.json", "vision_feature_layer", 5, "vision_feature_layer 5 is outside"),
    ("config.json", "image_seq_length", 17, "image_seq_length is 17"),
    ("preprocessor_config.json", "size", {"height": 64, "width": 64}, "vision_config.image_size is 56"),
]


@pytest.mark.parametrize(("file", "field", "value", "named"), REFUSALS,
                         ids=[f"{field}={'deleted' if value is DELETE else value}" for _, field, value, _ in REFUSALS])
def test_each_refusal_names_its_field(dirs, tmp_path, file, field, value, named):
    copy = tmp_path / "broken"
    shutil.copytree(dirs["tiny"], copy)
    data = json.loads((copy / file).read_text())
    edit_config(data, field, value)
    (copy / file).write_text(json.dumps(data))
    with pytest.raises(ModelLoadError) as info:
        load_model(copy, "cpu", "float32")
    assert named in str(info.value)


def test_the_unedited_copy_loads(dirs, tmp_path):
    """The refusals above come from their edits: the same copy, unedited, loads."""
    copy = tmp_path / "intact"
    shutil.copytree(dirs["tiny"], copy)
    assert load_model(copy, "cpu", "float32").processor.tokens_per_image == 16


def test_tied_embeddings_need_no_lm_head_tensor(dirs, tmp_path):
    """text_config.tie_word_embeddings: the checkpoint without language_model.lm_head.weight
    loads, the engine reads the logits from the embeddings, and matches the reference."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "tied"
    shutil.copytree(dirs["tiny"], copy)
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = True
    config.pop("tie_word_embeddings", None)
    (copy / "config.json").write_text(json.dumps(config))
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    (file,) = set(index["weight_map"].values())
    tensors = {k: v for k, v in load_file(copy / file).items() if k != "language_model.lm_head.weight"}
    save_file(tensors, copy / file, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(copy, "cpu", "float32")
    lm = model.model.language_model
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    assert model.adapter.lm_spec(model.model).lm_head is None
    prompt = chat(model, [noise(90, 60, 40)], "you")
    ((tokens, finish),) = run(PagedEngine(model, PagedEngineConfig(num_blocks=64)), [(prompt, GREEDY)])
    ref_tokens = reference_generate(model, prompt, GREEDY.max_tokens)
    assert ref_tokens and tokens[:len(ref_tokens)] == ref_tokens
    assert_close_to_model(finish.first_logprobs, torch.log_softmax(reference_logits(model, prompt), -1),
                          model.model.config, len(prompt.input_ids))


def test_the_canary_runs_on_this_family(vlm):
    """Random weights cannot name colours, so the canary must fail here, and say why, not crash."""
    import asyncio

    from fovea.guard.canary import Canary

    _, model = vlm

    async def main():
        engine = PagedEngine(model, PagedEngineConfig(num_blocks=256))
        engine.start()
        try:
            return await Canary(model, engine).run()
        finally:
            engine.stop()

    result = asyncio.run(main())
    assert not result.ok and result.reasons


def test_a_tower_saved_with_its_vision_model_level_loads_the_same(dirs, tmp_path):
    """``vision_tower.vision_model.*`` (the layout transformers 4 saved CLIP/SigLIP towers in)
    loads into the same tensors, in the whole model and the encode-only loader."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "v4-names"
    shutil.copytree(dirs["tiny-clip-llama"], copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    (file,) = set(index["weight_map"].values())
    tensors = {(k.replace("vision_tower.", "vision_tower.vision_model.", 1) if k.startswith("vision_tower.") else k): v
               for k, v in load_file(copy / file).items()}
    assert any(k.startswith("vision_tower.vision_model.") for k in tensors)
    save_file(tensors, copy / file, metadata={"format": "pt"})
    index["weight_map"] = dict.fromkeys(tensors, file)
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    renamed, original = load_model(copy, "cpu", "float32"), load_model(dirs["tiny-clip-llama"], "cpu", "float32")
    ours, theirs = renamed.model.state_dict(), original.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    part = load_vision_part(copy, "cpu", "float32")
    images = chat(original, [noise(90, 60, 50)]).images
    assert torch.equal(part.adapter.vision_forward(part)(images)[0], original.adapter.vision_forward(original)(images)[0])


def test_a_torchvision_image_processor_is_refused(dirs, monkeypatch):
    import fovea.models.fovea_vlm as family

    class SiglipImageProcessorFast:  # what an older transformers with torchvision resolves to
        pass

    monkeypatch.setattr(family.AutoImageProcessor, "from_pretrained", lambda *a, **k: SiglipImageProcessorFast())
    with pytest.raises(ModelLoadError, match="torchvision"):
        load_model(dirs["tiny"], "cpu", "float32")


def test_the_codec_survives_pickling_for_preprocessing_workers(vlm):
    import pickle

    _, model = vlm
    copy = pickle.loads(pickle.dumps(model.codec))
    images = [noise(50, 70, 60)]
    ours, theirs = copy.encode(copy.render(messages_for(1)), images), chat(model, images)
    assert ours.input_ids == theirs.input_ids and ours.image_hashes == theirs.image_hashes
