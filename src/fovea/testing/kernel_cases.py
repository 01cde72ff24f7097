"""Random-weight models for checking the fused vision stage (``fovea.engine.vision.vision_fused``):
``random_llava``, ``tiny_vision``, ``llava15_vision``. Used by its tests and by
``bench/kernels_check.py``. The kernels' case builders and torch references are in
``fovea.engine.kernels.cases``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fovea.loading.loader import LoadedModel


# ---- fused vision stage: random-weight models ----------------------------------------------------

def random_llava(vision: dict, text_hidden: int, device: torch.device | str, dtype: torch.dtype,
                 feature_layer: int | list[int] = -2, strategy: str = "default", seed: int = 0,
                 weight_std: float | None = None) -> LoadedModel:
    """A random-weight LLaVA with the CLIP tower ``vision`` (CLIPVisionConfig arguments) and a
    one-layer language model of width ``text_hidden``. Matrices are N(0, weight_std) (default
    1/sqrt(fan_in), so activations stay O(1) and every nonlinearity matters), norm scales
    1 +- 0.1, biases N(0, 0.1)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from fovea.loading.loader import LoadedModel
    from fovea.models.llava import LlavaAdapter

    text = LlamaConfig(vocab_size=64, hidden_size=text_hidden, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=max(1, text_hidden // 128), max_position_embeddings=4096)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=text, image_token_index=63,
                         projector_hidden_act="gelu", vision_feature_select_strategy=strategy,
                         vision_feature_layer=feature_layer)
    device = torch.device(device)
    with torch.device(device):
        model = LlavaForConditionalGeneration(config).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, weight_std or p[0].numel() ** -0.5, generator=gen)  # 1/sqrt(fan_in)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.1, generator=gen)
    model.to(dtype)
    adapter = LlavaAdapter()
    return LoadedModel(path=Path("."), name="random-llava", model=model, processor=None, device=device, dtype=dtype,
                       image_token_id=63, image_token="<image>", context_length=4096, load_seconds=0.0,
                       adapter=adapter, codec=adapter.codec(None, 63, dtype))


def tiny_vision(hidden_act: str = "quick_gelu", layers: int = 3) -> dict:
    """A small CLIP tower (32 px, patches of 8: 17 tokens) with odd widths, for checks."""
    return {"hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": layers, "num_attention_heads": 3,
            "image_size": 32, "patch_size": 8, "projection_dim": 32, "hidden_act": hidden_act}


def llava15_vision() -> dict:
    """LLaVA-1.5-7B's tower: CLIP ViT-L/14 at 336 px."""
    return {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
            "image_size": 336, "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu"}
