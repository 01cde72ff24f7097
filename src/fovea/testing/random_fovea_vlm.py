"""Write a random-weight ``fovea_vlm`` directory: a custom VLM that fovea serves from its config alone.

    python -m fovea.testing.random_fovea_vlm --arch tiny --out /tmp/my-vlm [--seed 0]

The worked example of docs/models.md ("A custom VLM without fovea code"): ``config.json``
(``model_type: fovea_vlm``, a transformers vision config, an MLP projector, a transformers text
config), ``model.safetensors`` (``vision_tower.*``, ``projector.linears.*``,
``language_model.*``), ``generation_config.json``, a tokenizer with a chat template and a
PIL image processor config. Architectures:

- ``tiny``: a SigLIP tower (56 px, 14 px patches: 16 image tokens, strategy "full", feature
  layer -2) and a Qwen2 language model (attention biases), a 2-layer GELU projector;
- ``tiny-clip-llama``: a CLIP tower (112 px: 64 image tokens after the CLS is dropped,
  features of layers -2 and -1 concatenated) and a Llama language model.

The tokenizer is ``random_llava``'s word-level one, with LLaVA-1.5's chat format
("<s>USER: <image>\\n... ASSISTANT:", the BOS written by the template).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from fovea.models.clip_processor import make_clip_image_processor
from fovea.models.fovea_vlm import FoveaVLMConfig, FoveaVLMForConditionalGeneration
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

# LLaVA-1.5's conversation format, with the BOS the template writes (as Llama-family templates do).
TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE


@dataclass(frozen=True)
class Architecture:
    vision_type: str  # clip_vision_model or siglip_vision_model
    text_type: str  # llama or qwen2
    image_size: int
    feature_layer: int | tuple[int, ...]
    strategy: str
    vision_hidden: int = 64
    text_hidden: int = 128


ARCHITECTURES = {
    "tiny": Architecture("siglip_vision_model", "qwen2", 56, -2, "full"),
    "tiny-clip-llama": Architecture("clip_vision_model", "llama", 112, (-2, -1), "default"),
}


def vision_config(arch: Architecture) -> dict[str, Any]:
    common = {"model_type": arch.vision_type, "hidden_size": arch.vision_hidden, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": arch.image_size, "patch_size": 14}
    if arch.vision_type == "siglip_vision_model":
        return {**common, "vision_use_head": False}
    return {**common, "hidden_act": "quick_gelu", "projection_dim": 64}


def text_config(arch: Architecture) -> Any:
    common = {"vocab_size": VOCAB, "hidden_size": arch.text_hidden, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": PAD_ID, "tie_word_embeddings": False}
    return Qwen2Config(**common) if arch.text_type == "qwen2" else LlamaConfig(**common)


def build_config(arch: Architecture) -> FoveaVLMConfig:
    layers = [arch.feature_layer] if isinstance(arch.feature_layer, int) else list(arch.feature_layer)
    return FoveaVLMConfig(
        vision_config=vision_config(arch), text_config=text_config(arch).to_dict(),
        projector={"type": "mlp", "layers": 2, "activation": "gelu",
                   "input_width": arch.vision_hidden * len(layers), "output_width": arch.text_hidden},
        vision_feature_layer=arch.feature_layer if isinstance(arch.feature_layer, int) else layers,
        vision_feature_select_strategy=arch.strategy, image_token=IMAGE, image_token_id=IMAGE_ID)


def build_image_processor(arch: Architecture) -> Any:
    if arch.vision_type == "siglip_vision_model":
        from transformers import SiglipImageProcessorPil

        return SiglipImageProcessorPil(size={"height": arch.image_size, "width": arch.image_size}, resample=3,
                                       image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return make_clip_image_processor(
        size={"shortest_edge": arch.image_size}, crop_size={"height": arch.image_size, "width": arch.image_size},
        do_center_crop=True, resample=3, image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD))


def write_model_dir(out: Path, arch: str = "tiny", device: str = "cpu", seed: int = 0) -> Path:
    architecture = ARCHITECTURES[arch]
    config = build_config(architecture)
    out = start_model_dir(out, config)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    build_image_processor(architecture).save_pretrained(out)
    write_weights(config, out, torch.device(device), seed, model_class=FoveaVLMForConditionalGeneration)
    return out


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], ARCHITECTURES, "tiny", write_model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
