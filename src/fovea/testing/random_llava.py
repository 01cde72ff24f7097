"""Write a random-weight LLaVA directory of a real architecture, as a user's model directory would be.

    python -m fovea.testing.random_llava --arch llava-1.5-7b --out /tmp/llava7b [--device cuda]

Benchmarks serve it with ``fovea serve`` like any local Hugging Face directory: a config,
safetensors shards with an index, a 32,064-token tokenizer with LLaVA-1.5's chat template,
and a CLIP image processor (336 px, bicubic, centre crop, CLIP mean/std). Speed does not
depend on the weights' values, so they are seeded random numbers (never zeros: zeros can
run faster than real data). ``tiny`` has the same processor, tokenizer and token counts
(576 image tokens per image) with a few narrow layers, so the whole serving path runs on a
CPU in tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import string
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from fovea.models.clip_processor import make_clip_image_processor

UNK, BOS, EOS, IMAGE, PAD = "<unk>", "<s>", "</s>", "<image>", "<pad>"
VOCAB = 32064  # llava-hf/llava-1.5-7b-hf: Llama's 32,000 plus <image>, <pad> and 62 spare rows
IMAGE_ID, PAD_ID = 32000, 32001
# LLaVA-1.5's conversation format: "USER: <image>\n<text> ASSISTANT:".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
SHARD_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class Architecture:
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    max_positions: int = 4096
    image_size: int = 336
    patch_size: int = 14


ARCHITECTURES = {
    # llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14 at 336 px (feature layer -2), Llama-2-7B.
    "llava-1.5-7b": Architecture(1024, 4096, 24, 16, 4096, 11008, 32, 32),
    "tiny": Architecture(64, 128, 2, 2, 128, 256, 2, 4, max_positions=1024),
}


def words(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct lower-case pseudo-words (the tokenizer's vocabulary)."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < count:
        out["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9)))] = None
    return list(out)


@functools.cache
def vocabulary() -> list[str]:
    head = [UNK, BOS, EOS, "USER:", "ASSISTANT:"]
    body = words(IMAGE_ID - len(head))
    return head + body + [IMAGE, PAD] + [f"<extra_{i}>" for i in range(VOCAB - IMAGE_ID - 2)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: index for index, word in enumerate(vocabulary())}
    core = Tokenizer(WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        unk_token=UNK, extra_special_tokens={"image_token": IMAGE},
                                        model_max_length=4096, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_config(arch: Architecture) -> LlavaConfig:
    vision = CLIPVisionConfig(hidden_size=arch.vision_hidden, intermediate_size=arch.vision_intermediate,
                              num_hidden_layers=arch.vision_layers, num_attention_heads=arch.vision_heads,
                              image_size=arch.image_size, patch_size=arch.patch_size, projection_dim=768,
                              hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=arch.text_hidden, intermediate_size=arch.text_intermediate,
                       num_hidden_layers=arch.text_layers, num_attention_heads=arch.text_heads,
                       num_key_value_heads=arch.text_heads, max_position_embeddings=arch.max_positions,
                       rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID,
                       tie_word_embeddings=False)
    tokens = (arch.image_size // arch.patch_size) ** 2
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
                       projector_hidden_act="gelu", vision_feature_select_strategy="default",
                       vision_feature_layer=-2, image_seq_length=tokens, tie_word_embeddings=False)


def build_processor(arch: Architecture, tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    image_processor = make_clip_image_processor(
        size={"shortest_edge": arch.image_size}, crop_size={"height": arch.image_size, "width": arch.image_size},
        do_center_crop=True, resample=3, image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD))
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=arch.patch_size,
                          vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                          image_token=IMAGE, num_additional_image_tokens=1)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """N(0, 0.02) matrices and embeddings, 1 +- 0.02 norm scales, small biases; bf16 on the host."""
    if len(shape) >= 2:
        t = torch.empty(shape, device=device).normal_(0.0, 0.02, generator=generator)
    elif "norm" in name and name.endswith("weight"):
        t = torch.empty(shape, device=device).normal_(1.0, 0.02, generator=generator)
    else:
        t = torch.empty(shape, device=device).normal_(0.0, 0.002, generator=generator)
    return t.to(torch.bfloat16).cpu()


def write_weights(config, out: Path, device: torch.device, seed: int = 0,
                  model_class: type = LlavaForConditionalGeneration) -> int:
    """Random bf16 weights for every tensor ``model_class(config)`` has, in shards with an index; returns bytes."""
    with torch.device("meta"):
        model = model_class(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = random_tensor(name, shape, generator, device)
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def start_model_dir(out: Path, config) -> Path:
    """``out`` created, with ``config`` and the greedy generation config of this tokenizer's ids
    (BOS 1, EOS 2): what every LLaVA-style random directory starts with."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID, do_sample=False).save_pretrained(out)
    return out


def write_model_dir(out: Path, arch: str = "llava-1.5-7b", device: str = "cpu", seed: int = 0) -> Path:
    architecture = ARCHITECTURES[arch]
    tokenizer = build_tokenizer()
    config = build_config(architecture)
    out = start_model_dir(out, config)
    processor = build_processor(architecture, tokenizer)
    processor.save_pretrained(out)
    processor.image_processor.save_pretrained(out)  # the classic preprocessor_config.json too
    write_weights(config, out, torch.device(device), seed)
    return out


def prompt_words(count: int, seed: int) -> str:
    """``count`` vocabulary words, each one token: a request's text of a known length."""
    rng = random.Random(seed)
    pool = vocabulary()[5:IMAGE_ID]
    return " ".join(rng.choice(pool) for _ in range(count))


def cli(argv: list[str] | None, description: str, archs: dict, default: str, write) -> int:
    """The ``--arch/--out/--device/--seed`` command line of a random-checkpoint writer."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arch", choices=sorted(archs), default=default)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda is faster)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.out, args.arch, args.device, args.seed)
    print(args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], ARCHITECTURES, "llava-1.5-7b", write_model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
