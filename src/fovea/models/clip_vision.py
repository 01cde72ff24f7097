"""The vision half of a LLaVA-family model (CLIP-style tower): pixels -> vision tower -> projector -> LM-width rows.

fovea runs this stage itself, outside the language model's forward, so that the result
can be cached by image, timed, checked (finite, right count, right width) and, later,
computed in another process. The modules are transformers' own; only the feature
selection (which hidden layer, whether to drop CLS) is spelled out here, from the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (loading imports the adapters: a runtime import here would be a circle)
    from fovea.loading.loader import LoadedModel


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


def _runs_layer_by_layer(tower: torch.nn.Module) -> bool:
    """CLIP-style towers (embeddings, pre-norm, a list of encoder layers) can stop early."""
    return all(hasattr(tower, name) for name in ("embeddings", "pre_layrnorm", "encoder")) and hasattr(
        tower.encoder, "layers")


def tower_hidden_states(tower: torch.nn.Module, pixels: torch.Tensor, layer: int | list[int]) -> list[torch.Tensor]:
    """The hidden states ``select_features`` reads (indexed as transformers'
    ``hidden_states``: 0 is the embeddings). A CLIP-style tower runs only up to the deepest
    layer needed: LLaVA's feature layer -2 leaves the last layer's work unused."""
    wanted = [layer] if isinstance(layer, int) else list(layer)
    if not _runs_layer_by_layer(tower):
        states = tower(pixels, output_hidden_states=True).hidden_states
        return [states[i] for i in wanted]
    total = len(tower.encoder.layers) + 1
    indices = [i if i >= 0 else total + i for i in wanted]
    if any(not 0 <= i < total for i in indices):
        raise ValueError(f"vision_feature_layer {layer!r} is outside the tower's {total} hidden states")
    h = tower.pre_layrnorm(tower.embeddings(pixels))
    states = [h]
    for block in tower.encoder.layers[:max(indices)]:
        h = block(h, None)
        h = h[0] if isinstance(h, tuple) else h  # transformers 4.x returned a tuple
        states.append(h)
    return [states[i] for i in indices]


@torch.inference_mode()
def encode_images(loaded: LoadedModel, pixel_values: torch.Tensor) -> torch.Tensor:
    """[n, 3, H, W] pixels -> [n, tokens_per_image, lm_hidden] embeddings in the LM's dtype."""
    tower, projector = vision_modules(loaded)
    config = loaded.model.config
    tower_dtype = next(tower.parameters()).dtype
    layer = config.vision_feature_layer
    picked = tower_hidden_states(tower, pixel_values.to(device=loaded.device, dtype=tower_dtype), layer)
    positions = list(range(len(picked))) if isinstance(layer, list) else 0
    features = select_features(picked, positions, config.vision_feature_select_strategy)
    projector_dtype = next(projector.parameters()).dtype
    embeddings = projector(features.to(projector_dtype))
    return embeddings.to(loaded.dtype)
