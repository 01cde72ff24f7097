"""Write a random-weight Qwen2.5-VL directory of a real architecture, as a user's model directory would be.

    python -m fovea.testing.random_qwen2_5_vl --arch qwen2.5-vl-7b --out /tmp/qwen7b [--device cuda]

The directory is what Qwen/Qwen2.5-VL-7B-Instruct ships, with seeded random bf16 weights: its
config (window-attention vision tower, M-RoPE sections [16, 24, 24], 4 full-attention
blocks), a ``Qwen2VLImageProcessor`` with the model's own ``min_pixels``/``max_pixels``, and a
tokenizer with Qwen's special tokens at their real ids and Qwen's chat template (system
prompt, ``<|vision_start|><|image_pad|><|vision_end|>`` per image). The tokenizer is
word-level (every vocabulary word is one token), so a request's text has a known length.
``tiny`` keeps the processor, the tokenizer's special ids and the structure (window and full
attention, M-RoPE) at a few narrow layers, so the parity tests run on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessor,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from fovea.testing.random_llava import cli, words, write_weights

# Qwen2's tokenizer: 151,643 BPE tokens, then its special tokens at these ids.
SPECIAL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}
FIRST_SPECIAL = 151643
EMBEDDING_ROWS = 152064  # Qwen2.5-VL-7B's vocab_size (the table has spare rows past the tokenizer)
# Qwen2.5-VL-Instruct's chat template, as shipped (images and videos as parts of a user turn).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Architecture:
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    fullatt_blocks: tuple[int, ...]
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    vocab_words: int  # words before the special tokens (the real tokenizer has 151,643)
    max_positions: int = 128000
    min_pixels: int = 3136  # 4 patches of 28 px: the model's own preprocessor_config.json
    max_pixels: int = 12845056  # 16,384 tokens of 28 x 28 px
    window_size: int = 112


ARCHITECTURES = {
    # Qwen/Qwen2.5-VL-7B-Instruct.
    "qwen2.5-vl-7b": Architecture(1280, 3420, 32, 16, (7, 15, 23, 31), 3584, 18944, 28, 28, 4, FIRST_SPECIAL),
    # Qwen/Qwen2.5-VL-72B-Instruct: 145 GB in bf16, so benchmarks write its config alone
    # (``weights=False``) and serve it with --load-format dummy.
    "qwen2.5-vl-72b": Architecture(1280, 3456, 32, 16, (7, 15, 23, 31), 8192, 29568, 80, 64, 8, FIRST_SPECIAL),
    # Narrow and shallow, with one full-attention block between window blocks, and a small
    # max_pixels so the tests' larger images are resized down.
    "tiny": Architecture(32, 64, 3, 2, (1,), 64, 128, 2, 4, 2, 1000, max_positions=4096, max_pixels=200_704,
                         window_size=56),
}


def vocab_size(arch: Architecture) -> int:
    """Rows of the embedding table: the real model's for 7B, else just past the special tokens."""
    return EMBEDDING_ROWS if arch.vocab_words == FIRST_SPECIAL else arch.vocab_words + len(SPECIAL_IDS) + 2


def special_ids(arch: Architecture) -> dict[str, int]:
    """The special tokens' ids: Qwen's own for the real vocabulary, else right after the words."""
    shift = arch.vocab_words - FIRST_SPECIAL
    return {token: index + shift for token, index in SPECIAL_IDS.items()}


@functools.cache
def vocabulary(words_count: int) -> list[str]:
    return ["system", "user", "assistant", "you", "are", "a", "helpful", "assistant."] + words(words_count - 8, seed=1)


def build_tokenizer(arch: Architecture) -> PreTrainedTokenizerFast:
    return word_level_tokenizer(vocabulary(arch.vocab_words), special_ids(arch), pre_tokenizers.WhitespaceSplit(),
                                arch.max_positions, CHAT_TEMPLATE)


def word_level_tokenizer(words: list[str], specials: dict[str, int], pre_tokenizer: pre_tokenizers.PreTokenizer,
                         max_positions: int, chat_template: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with Qwen's special tokens at their real ids (``specials``), EOS
    and padding, and ``chat_template``: what the random Qwen directories ship."""
    vocab = {word: index for index, word in enumerate(words)}
    vocab.update(specials)
    core = Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizer
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    # Qwen's tokenizer adds no BOS: the chat template's <|im_start|> opens the prompt.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<|endoftext|>", model_max_length=max_positions,
                                        padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    tokenizer.chat_template = chat_template
    return tokenizer


def build_config(arch: Architecture) -> Qwen2_5_VLConfig:
    ids = special_ids(arch)
    vision = {"depth": arch.vision_layers, "hidden_size": arch.vision_hidden, "intermediate_size": arch.vision_intermediate,
              "num_heads": arch.vision_heads, "out_hidden_size": arch.text_hidden, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": arch.window_size,
              "fullatt_block_indexes": list(arch.fullatt_blocks), "hidden_act": "silu", "in_channels": 3,
              "tokens_per_second": 2}
    text = {"vocab_size": vocab_size(arch), "hidden_size": arch.text_hidden, "intermediate_size": arch.text_intermediate,
            "num_hidden_layers": arch.text_layers, "num_attention_heads": arch.text_heads,
            "num_key_value_heads": arch.text_kv_heads, "max_position_embeddings": arch.max_positions,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "use_sliding_window": False, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]
                                if arch.text_hidden // arch.text_heads == 128 else scaled_sections(arch)},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def scaled_sections(arch: Architecture) -> list[int]:
    """M-RoPE sections for a narrow head: Qwen's 16/24/24 split of 64 frequencies, scaled to this head."""
    half = arch.text_hidden // arch.text_heads // 2
    t = max(1, half * 16 // 64)
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_image_processor(arch: Architecture) -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(
        min_pixels=arch.min_pixels, max_pixels=arch.max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2,
        image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD), resample=3)


def write_model_dir(out: Path, arch: str = "qwen2.5-vl-7b", device: str = "cpu", seed: int = 0,
                    max_pixels: int | None = None, weights: bool = True) -> Path:
    """``max_pixels``: the image processor's bound instead of the architecture's. ``weights=False``:
    every file but the weights (a directory to serve with --load-format dummy)."""
    architecture = ARCHITECTURES[arch]
    if max_pixels is not None:
        architecture = dataclasses.replace(architecture, max_pixels=max_pixels)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(architecture)
    config = build_config(architecture)
    config.save_pretrained(out)
    ids = special_ids(architecture)
    GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                     pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
    # The files Qwen's processor reads (tokenizer, chat template, preprocessor_config.json); not
    # written through Qwen2_5_VLProcessor, which would need torchvision for its video processor.
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    build_image_processor(architecture).save_pretrained(out)
    if weights:
        write_weights(config, out, torch.device(device), seed, model_class=Qwen2_5_VLForConditionalGeneration)
    return out


def prompt_words(arch: str, count: int, seed: int) -> str:
    """``count`` vocabulary words, each one token: a request's text of a known length."""
    rng = random.Random(seed)
    pool = vocabulary(ARCHITECTURES[arch].vocab_words)[8:]
    return " ".join(rng.choice(pool) for _ in range(count))


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], ARCHITECTURES, "qwen2.5-vl-7b", write_model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
