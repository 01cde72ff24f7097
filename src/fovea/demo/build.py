"""Build the demo model's files: word-level tokenizer, chat template, CLIP processor, LLaVA config.

The result is an ordinary Hugging Face LLaVA directory that ``transformers`` loads with
``LlavaForConditionalGeneration`` and ``AutoProcessor``; nothing about it is fovea-specific.
``build_model_dir`` with random weights is also how tests make tiny models of any shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from fovea.demo.checkpoint_layout import save_llava_hf_weights
from fovea.demo.scenes import vocabulary_words
from fovea.models.clip_processor import make_clip_image_processor

PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
SPECIALS = (PAD, BOS, EOS, UNK, IMAGE)

# The prompt starts with the BOS token, written by the template itself. One user turn: its
# images first (one placeholder each), then its text. The assistant's turn ends with </s>.
# Rendered text is lower-cased by the tokenizer's normaliser.
#
# The tokenizer's post-processor also prepends BOS (for raw prompts), so text rendered by this
# template must be tokenized with add_special_tokens=False: one BOS, the one the model was
# trained with. transformers' processor.apply_chat_template(..., tokenize=True) and vLLM's chat
# path already do that; see ``encode_rendered`` in dataset.py.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join(' ') -%}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{ 'user:' }}"
    "{%- if message['content'] is not string -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}{{ ' <image>' }}{%- endfor -%}"
    "{%- endif -%}{{ ' ' + text + ' ' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'assistant: ' + text + '</s> ' }}"
    "{%- else -%}{{ message['role'] + ': ' + text + ' ' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant:' }}{%- endif -%}"
)


@dataclass(frozen=True)
class DemoArchitecture:
    """Sizes of the demo LLaVA. The defaults are the shipped fovea-shapes model."""

    image_size: int = 128
    patch_size: int = 16
    vision_hidden: int = 192
    vision_layers: int = 4
    vision_heads: int = 3
    vision_intermediate: int = 768
    text_hidden: int = 256
    text_layers: int = 4
    text_heads: int = 4
    text_intermediate: int = 688
    max_positions: int = 512

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def build_tokenizer() -> PreTrainedTokenizerFast:
    words = list(SPECIALS) + vocabulary_words()
    vocab = {word: index for index, word in enumerate(words)}
    core = Tokenizer(WordLevel(vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's clean-up joins " ," -> "," and " ." -> "." when decoding.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens={"image_token": IMAGE},
        model_max_length=DemoArchitecture().max_positions,
        padding_side="left",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(arch: DemoArchitecture, tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    image_processor = make_clip_image_processor(
        size={"height": arch.image_size, "width": arch.image_size},
        do_center_crop=False,  # a crop would cut off the outer cells of non-square scenes
        image_mean=list(OPENAI_CLIP_MEAN),
        image_std=list(OPENAI_CLIP_STD),
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=arch.patch_size,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE,
        num_additional_image_tokens=1,  # the CLS position, dropped by the "default" strategy
    )


def build_config(arch: DemoArchitecture, tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    vision = CLIPVisionConfig(
        hidden_size=arch.vision_hidden,
        intermediate_size=arch.vision_intermediate,
        num_hidden_layers=arch.vision_layers,
        num_attention_heads=arch.vision_heads,
        image_size=arch.image_size,
        patch_size=arch.patch_size,
        hidden_act="gelu",
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=arch.text_hidden,
        intermediate_size=arch.text_intermediate,
        num_hidden_layers=arch.text_layers,
        num_attention_heads=arch.text_heads,
        num_key_value_heads=arch.text_heads,
        max_position_embeddings=arch.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=arch.image_tokens,
        tie_word_embeddings=False,
    )


def build_model(arch: DemoArchitecture, seed: int = 0) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """A randomly initialised demo LLaVA and its processor."""
    tokenizer = build_tokenizer()
    processor = build_processor(arch, tokenizer)
    config = build_config(arch, tokenizer)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, processor


def save_model_dir(model: LlavaForConditionalGeneration, processor: LlavaProcessor, out: Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # The weights under llava-hf names (vision_tower.vision_model.*, language_model.model.*, ...),
    # which both transformers and vLLM load; save_pretrained's own names vLLM refuses.
    save_llava_hf_weights(model, out)
    processor.save_pretrained(out)
    # Recent transformers nest the image recipe in processor_config.json; the classic
    # preprocessor_config.json is what most tools (and older transformers) read.
    processor.image_processor.save_pretrained(out)
    return out


def build_model_dir(out: Path, arch: DemoArchitecture | None = None, seed: int = 0) -> Path:
    """Write a random-weight demo-architecture LLaVA directory (used by tests)."""
    model, processor = build_model(arch or DemoArchitecture(), seed)
    return save_model_dir(model, processor, out)
