"""Issue 11: the demo's prompts carry exactly one BOS on every path, and its checkpoint uses the
llava-hf weight names that both transformers and vLLM load."""

import random

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoProcessor, LlavaForConditionalGeneration

from fovea.demo import scenes
from fovea.demo.build import (
    BOS,
    CHAT_TEMPLATE,
    DemoArchitecture,
    build_model,
    build_model_dir,
    build_tokenizer,
)
from fovea.demo.checkpoint_layout import LLAVA_HF_PREFIXES, llava_hf_name, to_llava_hf
from fovea.demo.dataset import encode_rendered, prompt_table
from fovea.loading.loader import default_model_dir
from fovea.loading.prompt import encode_prompt, render_chat

BOS_ID, IMAGE_ID = 1, 4
# The ids the shipped weights were trained on for "Describe the image." (before issue 11 as after):
# <s> user : <image>x64 describe the image . assistant :
DESCRIBE_IDS = [BOS_ID, 43, 7] + [IMAGE_ID] * 64 + [19, 37, 22, 6, 12, 7]

CONVERSATIONS = {
    "one image": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
    "text only": [{"role": "user", "content": "How many shapes are there?"}],
    "multi-turn": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes are there?"}]},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "text", "text": "Describe the image."}]},
    ],
    "system first": [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Is there a red circle?"}]}],
}


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(default_model_dir(), local_files_only=True)


def scene_image(seed: int = 0) -> Image.Image:
    return scenes.render(scenes.SceneSampler().sample(random.Random(seed)))


def with_images(messages, image):
    return [m if isinstance(m["content"], str) else
            dict(m, content=[dict(p, image=image) if p["type"] == "image" else p for p in m["content"]])
            for m in messages]


def one_bos_at_start(ids) -> bool:
    ids = list(ids)
    return ids[:1] == [BOS_ID] and ids.count(BOS_ID) == 1


def test_shipped_template_is_the_built_one_and_writes_the_bos():
    assert (default_model_dir() / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert CHAT_TEMPLATE.startswith("{{ bos_token }}")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_template_renders_exactly_one_bos_at_the_start(processor, name):
    for render in (processor.apply_chat_template, build_tokenizer().apply_chat_template):
        text = render(CONVERSATIONS[name], add_generation_prompt=True, tokenize=False)
        assert text.startswith(BOS) and text.count(BOS) == 1, text


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_the_one_bos_tokenizations(processor, name):
    messages = CONVERSATIONS[name]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [scene_image()] * text.count("<image>")
    if images:
        # transformers' own tokenizing path skips the post-processor's BOS for this template
        ids = processor.apply_chat_template(with_images(messages, images[0]), add_generation_prompt=True,
                                            tokenize=True)[0]
        assert one_bos_at_start(ids)
        single = processor(text=text, images=images, add_special_tokens=False)["input_ids"][0]
        doubled = processor(text=text, images=images)["input_ids"][0]
    else:
        single = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        doubled = processor.tokenizer(text)["input_ids"]
    assert one_bos_at_start(single)
    assert doubled[:2] == [BOS_ID, BOS_ID]  # the post-processor's BOS on top: why the rule exists
    assert encode_rendered(processor, text, images) == list(single)


def test_a_raw_prompt_still_gets_its_bos_from_the_tokenizer(processor):
    assert one_bos_at_start(processor.tokenizer("user: how many shapes are there? assistant:")["input_ids"])


def test_describe_prompt_ids_are_the_trained_ones(processor):
    text = processor.apply_chat_template(CONVERSATIONS["one image"], add_generation_prompt=True, tokenize=False)
    assert processor(text=text, images=scene_image(), add_special_tokens=False)["input_ids"][0] == DESCRIBE_IDS
    assert prompt_table(processor)["Describe the image."] == DESCRIBE_IDS


def test_training_prompts_do_not_depend_on_who_writes_the_bos(processor):
    """The template without its BOS (the pre-issue-11 one) gives the same training ids."""
    old = AutoProcessor.from_pretrained(default_model_dir(), local_files_only=True)
    old.chat_template = CHAT_TEMPLATE.removeprefix("{{ bos_token }}")
    new_table, old_table = prompt_table(processor), prompt_table(old)
    assert new_table == old_table
    assert all(one_bos_at_start(ids) for ids in new_table.values())


def test_fovea_serving_path_builds_the_trained_ids(demo_model):
    text = render_chat(demo_model, CONVERSATIONS["one image"])
    assert text.startswith(BOS)
    assert encode_prompt(demo_model, text, [scene_image(3)]).input_ids == DESCRIBE_IDS


def test_encode_rendered_refuses_a_second_bos(processor):
    with pytest.raises(ValueError, match="2 BOS"):
        encode_rendered(processor, BOS + " " + BOS + "user: <image> describe the image. assistant:", [scene_image()])


# --- checkpoint layout ---------------------------------------------------------------------------

def test_shipped_checkpoint_uses_the_llava_hf_names():
    with safe_open(str(default_model_dir() / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert all(k.startswith(LLAVA_HF_PREFIXES) for k in keys), sorted(k for k in keys if not k.startswith(LLAVA_HF_PREFIXES))
    for key in ("vision_tower.vision_model.embeddings.patch_embedding.weight",
                "vision_tower.vision_model.embeddings.class_embedding",
                "vision_tower.vision_model.encoder.layers.3.self_attn.q_proj.weight",
                "vision_tower.vision_model.pre_layrnorm.weight",
                "multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_2.bias",
                "language_model.model.embed_tokens.weight", "language_model.model.layers.0.mlp.gate_proj.weight",
                "language_model.model.norm.weight", "language_model.lm_head.weight"):
        assert key in keys, key
    assert len(keys) == 114


def test_transformers_loads_every_shipped_weight():
    model, info = LlavaForConditionalGeneration.from_pretrained(default_model_dir(), local_files_only=True,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with safe_open(str(default_model_dir() / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    loaded = to_llava_hf(model.state_dict())
    assert loaded.keys() == stored.keys()
    assert all(torch.equal(loaded[k], stored[k]) for k in stored)


def test_built_directories_use_the_layout_and_round_trip(tmp_path):
    arch = DemoArchitecture(image_size=32, patch_size=16, vision_hidden=16, vision_layers=1, vision_heads=2,
                            vision_intermediate=32, text_hidden=16, text_layers=1, text_heads=2, text_intermediate=32)
    model, _ = build_model(arch, seed=3)
    path = build_model_dir(tmp_path / "tiny", arch, seed=3)
    assert not (path / "model.safetensors.index.json").exists()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert all(k.startswith(LLAVA_HF_PREFIXES) for k in f.keys())  # noqa: SIM118
        assert f.metadata() == {"format": "pt"}
    again, info = LlavaForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    before, after = model.state_dict(), again.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("key,expected", [
    ("model.vision_tower.embeddings.patch_embedding.weight", "vision_tower.vision_model.embeddings.patch_embedding.weight"),
    ("vision_tower.embeddings.patch_embedding.weight", "vision_tower.vision_model.embeddings.patch_embedding.weight"),
    ("vision_tower.vision_model.post_layernorm.bias", "vision_tower.vision_model.post_layernorm.bias"),
    ("model.multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_1.weight"),
    ("model.language_model.layers.0.self_attn.q_proj.weight", "language_model.model.layers.0.self_attn.q_proj.weight"),
    ("language_model.model.norm.weight", "language_model.model.norm.weight"),
    ("lm_head.weight", "language_model.lm_head.weight"),
    ("language_model.lm_head.weight", "language_model.lm_head.weight"),
])
def test_names(key, expected):
    assert llava_hf_name(key) == expected


def test_unknown_names_are_refused():
    with pytest.raises(ValueError):
        llava_hf_name("image_newline")
    with pytest.raises(ValueError, match="two weights"):
        to_llava_hf({"lm_head.weight": torch.zeros(1), "language_model.lm_head.weight": torch.zeros(1)})


def test_training_writes_the_llava_hf_layout(tmp_path):
    from fovea.demo.train import TrainConfig, train

    arch = DemoArchitecture(image_size=32, patch_size=16, vision_hidden=16, vision_layers=1, vision_heads=2,
                            vision_intermediate=32, text_hidden=16, text_layers=1, text_heads=2, text_intermediate=32)
    train(TrainConfig(out=str(tmp_path / "model"), steps=2, batch_size=4, warmup=1, train_scenes=8,
                      heldout_scenes=4, eval_every=2, workers=1, device="cpu", compile=False, arch=arch))
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(LLAVA_HF_PREFIXES) for k in keys)
    assert (tmp_path / "model" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    _, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
