"""Turn chat messages and decoded images into the model's input ids and images.

The model's own chat template renders the prompt, and its family's codec
(``fovea.models``) expands each image placeholder into that image's token run. Counts are
checked: a template that drops a placeholder, or an expansion that does not match the
images, is an error, not a request answered without its image.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from fovea.errors import InvalidRequest
from fovea.models.base import (
    DEFAULT_OPTIONS,
    EncodedPrompt,
    EncodeOptions,
    ImageInput,
    PlaceholderMismatch,
    PromptCodec,
)

__all__ = ["EncodedPrompt", "ImageInput", "PlaceholderMismatch", "encode_prompt", "render_chat"]


def _codec(model: Any) -> PromptCodec:
    """A ``LoadedModel``'s codec, or a codec itself (worker processes hold only the codec)."""
    return model if isinstance(model, PromptCodec) else model.codec


def render_chat(model: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """messages use transformers' form: content is a string or a list of
    ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts."""
    try:
        return _codec(model).render(messages, tools) if tools else _codec(model).render(messages)
    except Exception as exc:  # jinja raises its own error types for unsupported conversations
        raise InvalidRequest(f"the model's chat template could not render these messages: {exc}") from exc


def encode_prompt(model: Any, text: str, images: list[Image.Image], *, template_rendered: bool = True,
                  options: EncodeOptions = DEFAULT_OPTIONS) -> EncodedPrompt:
    return _codec(model).encode(text, images, template_rendered=template_rendered, options=options)
