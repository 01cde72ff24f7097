"""The model families fovea serves, keyed by their config's ``model_type``.

Adding a family: write ``fovea/models/<family>.py`` with a ``ModelAdapter`` subclass and
add it to ``_FAMILIES`` below.
"""

from __future__ import annotations

from fovea.models.base import EncodedPrompt, ImageInput, ModelAdapter, PlaceholderMismatch, PromptCodec
from fovea.models.fovea_vlm import FoveaVLMAdapter
from fovea.models.llava import LlavaAdapter
from fovea.models.llava_next import LlavaNextAdapter
from fovea.models.qwen2_5_vl import Qwen2_5_VLAdapter
from fovea.models.qwen3_vl import Qwen3_VLAdapter

_FAMILIES: tuple[type[ModelAdapter], ...] = (LlavaAdapter, LlavaNextAdapter, Qwen2_5_VLAdapter, Qwen3_VLAdapter,
                                             FoveaVLMAdapter)
ADAPTERS: dict[str, type[ModelAdapter]] = {t: cls for cls in _FAMILIES for t in cls.family.model_types}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model_type: str | None) -> ModelAdapter | None:
    """The adapter serving ``model_type``, or None when no family does."""
    cls = ADAPTERS.get(model_type or "")
    return cls() if cls is not None else None


__all__ = ["ADAPTERS", "EncodedPrompt", "ImageInput", "ModelAdapter", "PlaceholderMismatch", "PromptCodec",
           "adapter_for", "supported_model_types"]
