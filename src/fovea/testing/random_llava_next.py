"""Write a random-weight LLaVA-NeXT directory of a real architecture, as a user's model directory would be.

    python -m fovea.testing.random_llava_next --arch llava-v1.6-vicuna-7b --out /tmp/llnext7b [--device cuda]

The directory has the layout llava-hf/llava-v1.6-vicuna-7b-hf ships, with seeded random bf16
weights: a ``LlavaNextConfig`` (CLIP ViT-L/14 at 336 px, feature layer -2, ``default``
feature selection, anyres ``image_grid_pinpoints``), a ``LlavaNextProcessor`` whose
``preprocessor_config.json`` is the real LLaVA-NeXT image processor's (336 px tiles, bicubic,
CLIP mean/std, padding), and LLaVA-1.5/Vicuna's 32,064-token tokenizer and chat template
(``USER: <image>\\n<text> ASSISTANT:``) from ``fovea.testing.random_llava``.

``tiny`` keeps the processor's format and the anyres structure (a base tile plus a grid of
tiles chosen among five pinpoints, unpadding, one ``image_newline`` per row) at 112 px tiles
of 14 px patches (64 tokens a tile), with a few narrow layers, so the parity tests run on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    MistralConfig,
    PreTrainedTokenizerFast,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.utils import is_torchvision_available

from fovea.testing.random_llava import (
    CHAT_TEMPLATE,
    IMAGE,
    IMAGE_ID,
    PAD_ID,
    VOCAB,
    build_tokenizer,
    cli,
    start_model_dir,
    write_weights,
)
from fovea.testing.random_llava import Architecture as LlavaArchitecture


@dataclass(frozen=True)
class Architecture(LlavaArchitecture):
    """random_llava's architecture, with the language model's family."""

    text_model: str = "llama"  # or "mistral" (llava-v1.6-mistral-7b: Mistral's layers, no sliding window)

    @property
    def pinpoints(self) -> list[list[int]]:
        """llava-v1.6's five (height, width) resolutions, in tiles of ``image_size``."""
        s = self.image_size
        return [[s, 2 * s], [2 * s, s], [2 * s, 2 * s], [3 * s, s], [s, 3 * s]]


ARCHITECTURES = {
    # llava-hf/llava-v1.6-vicuna-7b-hf: CLIP ViT-L/14 at 336 px (feature layer -2), Vicuna-7B (Llama).
    "llava-v1.6-vicuna-7b": Architecture(1024, 4096, 24, 16, 4096, 11008, 32, 32),
    # llava-hf/llava-v1.6-mistral-7b-hf's structure: the same tower, a Mistral-7B language model
    # (its text config says sliding_window null); with LLaVA-1.5's tokenizer here.
    "llava-v1.6-mistral-7b": Architecture(1024, 4096, 24, 16, 4096, 14336, 32, 32, max_positions=32768,
                                          text_model="mistral"),
    "tiny": Architecture(64, 128, 2, 2, 128, 256, 2, 4, max_positions=4096, image_size=112),
    "tiny-mistral": Architecture(64, 128, 2, 2, 128, 256, 2, 4, max_positions=4096, image_size=112,
                                 text_model="mistral"),
}


def image_processor_class() -> type:
    """The PIL/numpy LLaVA-NeXT image processor where torchvision is missing (transformers 5
    backs ``LlavaNextImageProcessor`` with torchvision and keeps ``LlavaNextImageProcessorPil``)."""
    pil_class = getattr(transformers, "LlavaNextImageProcessorPil", None)
    if not is_torchvision_available() and pil_class is not None:
        return pil_class
    return transformers.LlavaNextImageProcessor


def build_config(arch: Architecture) -> LlavaNextConfig:
    vision = CLIPVisionConfig(hidden_size=arch.vision_hidden, intermediate_size=arch.vision_intermediate,
                              num_hidden_layers=arch.vision_layers, num_attention_heads=arch.vision_heads,
                              image_size=arch.image_size, patch_size=arch.patch_size, projection_dim=768,
                              hidden_act="quick_gelu")
    text_class = MistralConfig if arch.text_model == "mistral" else LlamaConfig
    extra = {"sliding_window": None, "head_dim": arch.text_hidden // arch.text_heads} if arch.text_model == "mistral" else {}
    text = text_class(vocab_size=VOCAB, hidden_size=arch.text_hidden, intermediate_size=arch.text_intermediate,
                       num_hidden_layers=arch.text_layers, num_attention_heads=arch.text_heads,
                       num_key_value_heads=arch.text_heads, max_position_embeddings=arch.max_positions,
                       rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID,
                       tie_word_embeddings=False, **extra)
    tokens = (arch.image_size // arch.patch_size) ** 2
    return LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
                           projector_hidden_act="gelu", vision_feature_select_strategy="default",
                           vision_feature_layer=-2, image_grid_pinpoints=arch.pinpoints, image_seq_length=tokens,
                           tie_word_embeddings=False)


def build_processor(arch: Architecture, tokenizer: PreTrainedTokenizerFast | None = None) -> LlavaNextProcessor:
    image_processor = image_processor_class()(
        size={"shortest_edge": arch.image_size}, crop_size={"height": arch.image_size, "width": arch.image_size},
        image_grid_pinpoints=arch.pinpoints, do_center_crop=True, do_pad=True, resample=3,
        image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD))
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer or build_tokenizer(),
                              patch_size=arch.patch_size, vision_feature_select_strategy="default",
                              chat_template=CHAT_TEMPLATE, image_token=IMAGE, num_additional_image_tokens=1)


def write_model_dir(out: Path, arch: str = "llava-v1.6-vicuna-7b", device: str = "cpu", seed: int = 0) -> Path:
    architecture = ARCHITECTURES[arch]
    config = build_config(architecture)
    out = start_model_dir(out, config)
    processor = build_processor(architecture)
    processor.save_pretrained(out)
    processor.image_processor.save_pretrained(out)  # the classic preprocessor_config.json too
    write_weights(config, out, torch.device(device), seed, model_class=LlavaNextForConditionalGeneration)
    return out


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], ARCHITECTURES, "llava-v1.6-vicuna-7b", write_model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
