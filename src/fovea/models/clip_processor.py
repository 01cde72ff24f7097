"""Pick the CLIP image processor class this transformers install can run.

transformers 5 backs ``CLIPImageProcessor`` with torchvision and keeps a PIL twin
(``CLIPImageProcessorPil``) for machines without it. Both read the same
``preprocessor_config.json``, so the choice changes no recipe, only the backend.
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers.utils import is_torchvision_available


def clip_image_processor_class() -> type:
    pil_class = getattr(transformers, "CLIPImageProcessorPil", None)
    if not is_torchvision_available() and pil_class is not None:
        return pil_class
    return transformers.CLIPImageProcessor


def make_clip_image_processor(**kwargs: Any) -> Any:
    return clip_image_processor_class()(**kwargs)
