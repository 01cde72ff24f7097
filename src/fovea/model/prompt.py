"""Turn chat messages and decoded images into the model's input ids and pixel values.

The model's own chat template renders the prompt and its own processor expands each image
placeholder into the image-token run the vision tower fills. Both counts are checked: a
template that drops a placeholder, or a processor that expands it wrongly, is an error, not
a request answered without its image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from fovea.errors import FoveaError, InvalidRequest
from fovea.model.loader import LoadedModel
from fovea.model.vision import pixel_hash


class PlaceholderMismatch(FoveaError):
    status, code = 400, "image_placeholder_mismatch"


@dataclass
class EncodedPrompt:
    input_ids: list[int]
    # [n_images, 3, H, W] in the model's dtype, on the host: a request waiting in the queue holds
    # no device memory; the engine moves a batch of images to the device when it encodes them.
    pixel_values: torch.Tensor | None
    num_images: int
    prompt_text: str
    image_hashes: list[str] = field(default_factory=list)  # content hash of each preprocessed image
    tokens_per_image: int = 0


def render_chat(loaded: LoadedModel, messages: list[dict[str, Any]]) -> str:
    """messages use transformers' form: content is a string or a list of
    ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts."""
    try:
        return loaded.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises its own error types for unsupported conversations
        raise InvalidRequest(f"the model's chat template could not render these messages: {exc}") from exc


def encode_prompt(loaded: LoadedModel, text: str, images: list[Image.Image], *,
                  template_rendered: bool = True) -> EncodedPrompt:
    placeholders = text.count(loaded.image_token)
    if placeholders != len(images):
        where = "the chat template rendered" if template_rendered else "the prompt contains"
        raise PlaceholderMismatch(
            f"{where} {placeholders} image placeholder(s) ({loaded.image_token!r}) for "
            f"{len(images)} image(s); every image needs exactly one placeholder."
            + ("" if not template_rendered else " The model's chat template is dropping images."),
            status=400 if not template_rendered else 500,
        )
    processor = loaded.processor
    if images:
        encoded = processor(text=text, images=images, return_tensors="pt")
        pixel_values = encoded["pixel_values"].to(dtype=loaded.dtype)
        hashes = [pixel_hash(p) for p in pixel_values]
    else:
        encoded = processor.tokenizer(text, return_tensors="pt")
        pixel_values = None
        hashes = []
    input_ids = encoded["input_ids"][0].tolist()
    image_tokens = sum(1 for t in input_ids if t == loaded.image_token_id)
    per_image = image_tokens // max(1, len(images))
    if len(images) and (image_tokens % len(images) or per_image == 0):
        raise PlaceholderMismatch(
            f"the processor expanded {len(images)} image(s) into {image_tokens} image tokens, "
            "which is not a whole number of tokens per image.", status=500)
    if not images and image_tokens:
        raise PlaceholderMismatch(
            f"the text contains {image_tokens} image token(s) but no image was sent; remove "
            f"{loaded.image_token!r} from the text or attach the image.")
    return EncodedPrompt(input_ids, pixel_values, len(images), text, hashes, per_image if images else 0)
