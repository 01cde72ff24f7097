"""Write a random-weight Qwen3-VL directory of a real architecture, as a user's model directory would be.

    python -m fovea.testing.random_qwen3_vl --arch qwen3-vl-8b --out /tmp/qwen3vl8b [--device cuda]

The directory is what Qwen/Qwen3-VL-8B-Instruct ships, with seeded random bf16 weights: its
config (a 27-block vision tower of 16 px patches with DeepStack at blocks 8, 16 and 24, a
36-layer Qwen3 language model with interleaved M-RoPE sections [24, 20, 20]), its
``preprocessor_config.json`` and ``video_preprocessor_config.json`` (Qwen's pixel budgets), and a
tokenizer with Qwen's special tokens at their real ids and Qwen3-VL's chat template (no default
system prompt). The tokenizer is word-level (every vocabulary word is one token; digits and
punctuation split, so a video's ``<0.5 seconds>`` timestamps tokenize) and is built offline.
``tiny`` keeps the processor, the special ids and the structure (DeepStack levels, q/k norms,
interleaved M-RoPE) at a few narrow layers, so the parity tests run on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from fovea.testing.random_llava import cli, write_weights
from fovea.testing.random_qwen2_5_vl import FIRST_SPECIAL, vocabulary, word_level_tokenizer
from fovea.testing.random_qwen2_5_vl import SPECIAL_IDS as QWEN2_SPECIAL_IDS

# Qwen3's tokenizer: Qwen2's special tokens, then the tool, fill-in-the-middle and thinking tokens.
SPECIAL_IDS = {**QWEN2_SPECIAL_IDS, "<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659,
               "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662, "<|repo_name|>": 151663,
               "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
               "</think>": 151668}
EMBEDDING_ROWS = 151936  # Qwen3-VL-8B's vocab_size
# What a timestamp ("<12.5 seconds>") splits into under the pre-tokenizer.
TIMESTAMP_PIECES = ["<", ">", ".", "seconds", *"0123456789"]
# Qwen3-VL-Instruct's chat template without its tool-calling branch: a system turn only when
# given, images and videos as parts of a user turn.
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}<|im_start|>system\n"
    "{%- if messages[0].content is string %}{{ messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}{{ content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' or message.role == 'assistant' %}"
    "<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{ content.text }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@dataclass(frozen=True)
class Architecture:
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    deepstack: tuple[int, ...]
    position_embeddings: int  # the learned grid (a square) the tower interpolates
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]
    vocab_words: int  # words before the special tokens (the real tokenizer has 151,643)
    max_positions: int = 262144
    min_pixels: int = 65536  # preprocessor_config.json's size.shortest_edge (64 tokens of 32 px)
    max_pixels: int = 16777216  # size.longest_edge: 16,384 tokens of 32 x 32 px
    video_min_pixels: int = 4096
    video_max_pixels: int = 25165824


ARCHITECTURES = {
    # Qwen/Qwen3-VL-8B-Instruct.
    "qwen3-vl-8b": Architecture(1152, 4304, 27, 16, (8, 16, 24), 2304, 4096, 12288, 36, 32, 8, 128, (24, 20, 20),
                                FIRST_SPECIAL),
    # Narrow and shallow, two DeepStack levels feeding the first two of three decoder layers, an
    # 8x8 learned grid (interpolated up and down), interleaved sections over 8 frequencies; a small
    # max_pixels so the tests' larger images are resized down.
    "tiny": Architecture(32, 64, 3, 2, (0, 1), 64, 64, 128, 3, 4, 2, 16, (2, 3, 3), 1000, max_positions=4096,
                         min_pixels=4096, max_pixels=200_704, video_min_pixels=4096, video_max_pixels=200_704),
}


def vocab_size(arch: Architecture) -> int:
    return EMBEDDING_ROWS if arch.vocab_words == FIRST_SPECIAL else arch.vocab_words + len(SPECIAL_IDS) + 2


def special_ids(arch: Architecture) -> dict[str, int]:
    shift = arch.vocab_words - FIRST_SPECIAL
    return {token: index + shift for token, index in SPECIAL_IDS.items()}


def words_of(arch: Architecture) -> list[str]:
    """The vocabulary: Qwen2.5-VL's test words with the timestamp pieces in place of some of them."""
    base = [w for w in vocabulary(arch.vocab_words) if w not in TIMESTAMP_PIECES]
    return base[:8] + TIMESTAMP_PIECES + base[8:arch.vocab_words - len(TIMESTAMP_PIECES)]


def build_tokenizer(arch: Architecture) -> PreTrainedTokenizerFast:
    splits = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                      pre_tokenizers.Digits(individual_digits=True)])
    return word_level_tokenizer(words_of(arch), special_ids(arch), splits, arch.max_positions, CHAT_TEMPLATE)


def build_config(arch: Architecture) -> Qwen3VLConfig:
    ids = special_ids(arch)
    vision = {"depth": arch.vision_layers, "hidden_size": arch.vision_hidden, "intermediate_size": arch.vision_intermediate,
              "num_heads": arch.vision_heads, "out_hidden_size": arch.text_hidden, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
              "num_position_embeddings": arch.position_embeddings, "deepstack_visual_indexes": list(arch.deepstack),
              "initializer_range": 0.02}
    text = {"vocab_size": vocab_size(arch), "hidden_size": arch.text_hidden, "intermediate_size": arch.text_intermediate,
            "num_hidden_layers": arch.text_layers, "num_attention_heads": arch.text_heads,
            "num_key_value_heads": arch.text_kv_heads, "head_dim": arch.head_dim,
            "max_position_embeddings": arch.max_positions, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True,
                                "mrope_section": list(arch.mrope_section)},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    return Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def processor_files(arch: Architecture) -> dict[str, dict]:
    """preprocessor_config.json and video_preprocessor_config.json as Qwen3-VL-8B-Instruct ships them."""
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
              "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"}
    return {
        "preprocessor_config.json": {"size": {"longest_edge": arch.max_pixels, "shortest_edge": arch.min_pixels},
                                     **common, "image_processor_type": "Qwen2VLImageProcessorFast"},
        "video_preprocessor_config.json": {"size": {"longest_edge": arch.video_max_pixels,
                                                    "shortest_edge": arch.video_min_pixels},
                                           **common, "video_processor_type": "Qwen3VLVideoProcessor"},
    }


def write_model_dir(out: Path, arch: str = "qwen3-vl-8b", device: str = "cpu", seed: int = 0,
                    max_pixels: int | None = None) -> Path:
    """``max_pixels``: the image processor's bound instead of the architecture's."""
    architecture = ARCHITECTURES[arch]
    if max_pixels is not None:
        architecture = dataclasses.replace(architecture, max_pixels=max_pixels)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(architecture)
    config.save_pretrained(out)
    ids = special_ids(architecture)
    GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                     pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
    # Not written through Qwen3VLProcessor, which would need torchvision for its video processor.
    build_tokenizer(architecture).save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for name, content in processor_files(architecture).items():
        (out / name).write_text(json.dumps(content, indent=2))
    write_weights(config, out, torch.device(device), seed, model_class=Qwen3VLForConditionalGeneration)
    return out


def prompt_words(arch: str, count: int, seed: int) -> str:
    """``count`` vocabulary words, each one token: a request's text of a known length."""
    import random

    rng = random.Random(seed)
    pool = words_of(ARCHITECTURES[arch])[8 + len(TIMESTAMP_PIECES):]
    return " ".join(rng.choice(pool) for _ in range(count))


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], ARCHITECTURES, "qwen3-vl-8b", write_model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
