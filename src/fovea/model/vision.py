"""The vision half of a LLaVA model: pixels -> vision tower -> projector -> LM-width rows.

fovea runs this stage itself, outside the language model's forward, so that the result
can be cached by image, timed, checked (finite, right count, right width) and, later,
computed in another process. The modules are transformers' own; only the feature
selection (which hidden layer, whether to drop CLS) is spelled out here, from the config.
"""

from __future__ import annotations

import hashlib

import torch

from fovea.model.loader import LoadedModel


def vision_modules(loaded: LoadedModel) -> tuple[torch.nn.Module, torch.nn.Module]:
    inner = loaded.model.model
    return inner.vision_tower, inner.multi_modal_projector


def select_features(hidden_states: tuple[torch.Tensor, ...], layer: int | list[int], strategy: str) -> torch.Tensor:
    layers = [layer] if isinstance(layer, int) else list(layer)
    picked = [hidden_states[i] for i in layers]
    if strategy == "default":
        picked = [h[:, 1:] for h in picked]  # drop the CLS position
    elif strategy != "full":
        raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
    return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)


@torch.inference_mode()
def encode_images(loaded: LoadedModel, pixel_values: torch.Tensor) -> torch.Tensor:
    """[n, 3, H, W] pixels -> [n, tokens_per_image, lm_hidden] embeddings in the LM's dtype."""
    tower, projector = vision_modules(loaded)
    config = loaded.model.config
    tower_dtype = next(tower.parameters()).dtype
    out = tower(pixel_values.to(device=loaded.device, dtype=tower_dtype), output_hidden_states=True)
    features = select_features(out.hidden_states, config.vision_feature_layer, config.vision_feature_select_strategy)
    projector_dtype = next(projector.parameters()).dtype
    embeddings = projector(features.to(projector_dtype))
    return embeddings.to(loaded.dtype)


def pixel_hash(pixels: torch.Tensor) -> str:
    """Content hash of one preprocessed image (the encoder cache key)."""
    data = pixels.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()

