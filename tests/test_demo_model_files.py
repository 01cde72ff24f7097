"""The shipped demo model is an ordinary transformers LLaVA directory with a CLIP processor."""

import json
import random

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from fovea.demo import scenes
from fovea.demo.build import DemoArchitecture, build_model_dir, build_tokenizer
from fovea.demo.dataset import build_pool, prompt_table, resize_like_processor
from fovea.loading.loader import default_model_dir
from fovea.testing.tolerance import assert_close_for


def test_shipped_directory_is_complete_and_small():
    path = default_model_dir()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    assert sum(f.stat().st_size for f in path.iterdir()) <= 25 * 1024 * 1024
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llava" and config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert config["text_config"]["model_type"] == "llama"
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert pre["image_mean"] == list(OPENAI_CLIP_MEAN) and pre["image_std"] == list(OPENAI_CLIP_STD)
    assert pre["image_processor_type"].startswith("CLIPImageProcessor")


def test_transformers_loads_it_without_fovea():
    path = default_model_dir()
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    model = LlavaForConditionalGeneration.from_pretrained(path, local_files_only=True)
    assert type(processor).__name__ == "LlavaProcessor"
    assert model.config.image_seq_length == 64


def test_tokenizer_round_trips_every_answer_form():
    tok = build_tokenizer()
    answer = "a red circle at the top left, a blue square in the center and a green triangle on the right"
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == answer
    for question in scenes.all_question_texts():
        assert tok.unk_token_id not in tok(question)["input_ids"]


def test_chat_template_renders_one_placeholder_per_image():
    tok = build_tokenizer()
    for n in range(4):
        content = [{"type": "image"}] * n + [{"type": "text", "text": "Describe the image."}]
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
        assert text.count("<image>") == n
        assert text.endswith("assistant:")


def test_training_preprocessing_equals_the_serving_processor():
    processor = AutoProcessor.from_pretrained(default_model_dir(), local_files_only=True)
    ip = processor.image_processor
    mean = torch.tensor(ip.image_mean).view(3, 1, 1)
    std = torch.tensor(ip.image_std).view(3, 1, 1)
    for seed in range(6):
        image = scenes.render(scenes.SceneSampler().sample(random.Random(seed)))
        served = ip(image, return_tensors="pt")["pixel_values"][0]
        trained = (torch.from_numpy(resize_like_processor(image, 128)).float() / 255 - mean) / std
        assert_close_for(served, trained, torch.float32, 3)  # elementwise: rescale, subtract, divide


def test_training_prompts_equal_the_serving_prompts(demo_model):
    pool = build_pool(demo_model.processor, 4, seed=5, workers=1)
    prompts = prompt_table(demo_model.processor)
    describe = prompts["Describe the image."]
    assert pool.tokens[0, 0, : len(describe)].tolist() == describe
    assert describe.count(demo_model.image_token_id) == 64


def test_random_weight_directories_of_any_size(tmp_path):
    arch = DemoArchitecture(image_size=64, patch_size=16, vision_hidden=32, vision_layers=1, vision_heads=2,
                            vision_intermediate=64, text_hidden=32, text_layers=1, text_heads=2, text_intermediate=64)
    path = build_model_dir(tmp_path / "tiny", arch)
    model = LlavaForConditionalGeneration.from_pretrained(path)
    assert model.config.image_seq_length == 16
    assert sum(p.numel() for p in model.parameters()) < 100_000
