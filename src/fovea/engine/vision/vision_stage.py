"""Which vision forward a process runs: the adapter's declared fused stage where it runs and agrees
with transformers' modules, else the adapter's eager forward.

An adapter names its fused stage (``ModelAdapter.fused_vision``); ``FUSED_STAGES`` maps the name
to what builds it. Both the engine's model runner and the encode worker call
``choose_vision_stage``, so the path a memory plan measures is the one that serves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fovea.engine.vision import vision_fused
from fovea.models.base import ImageInput


class VisionStage(NamedTuple):
    """The vision forward over a list of images, a label saying which one and why, and for
    fixed-size towers the same forward over one [n, C, H, W] tensor (what CUDA graphs capture
    and the memory profile calls), else None."""

    forward: Callable[[list[ImageInput]], list[torch.Tensor]]
    label: str
    batched: Callable[[torch.Tensor], torch.Tensor] | None = None


def clip_stage(loaded, enabled: bool) -> VisionStage:
    """CLIP-style towers (``vision_fused.FusedVision``), fixed size."""
    from fovea.models.llava import stacked

    encode, label = vision_fused.choose_vision_encoder(loaded, enabled=enabled)
    return VisionStage(stacked(encode), label, encode)


def qwen_stage(loaded, enabled: bool) -> VisionStage:
    """Qwen2.5-VL's and Qwen3-VL's towers (``qwen_vision_fused.QwenFusedVision``), any image sizes."""
    from fovea.engine.vision.qwen_vision_fused import QwenFusedVision, startup_problem

    forward, label = vision_fused.checked_fused(loaded, enabled, loaded.adapter.vision_forward(loaded),
                                                QwenFusedVision, startup_problem)
    return VisionStage(forward, label)


FUSED_STAGES: dict[str, Callable[[object, bool], VisionStage]] = {
    "clip": clip_stage,
    "qwen2_5_vit": qwen_stage,
    "qwen3_vit": qwen_stage,
}


def choose_vision_stage(loaded, enabled: bool) -> VisionStage:
    """The vision stage for ``loaded`` (a ``LoadedModel`` or an encode worker's ``VisionPart``):
    the fused stage its adapter declares, where ``enabled`` and it passes its start-up check,
    else the adapter's eager forward; the label says which and why."""
    name = getattr(loaded.adapter, "fused_vision", None)
    if name is None:
        return VisionStage(loaded.adapter.vision_forward(loaded),
                           "transformers' modules (this model's adapter declares no fused vision stage)")
    build = FUSED_STAGES.get(name)
    if build is None:
        raise ValueError(f"{type(loaded.adapter).__name__} declares fused vision stage {name!r}; "
                         f"known: {', '.join(sorted(FUSED_STAGES))}")
    return build(loaded, enabled)
