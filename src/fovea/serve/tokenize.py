"""POST /tokenize and POST /detokenize in vLLM's shapes.

/tokenize gives the ids the engine would run: a ``prompt`` as /v1/completions reads it (with
``images`` for its placeholders), or ``messages`` as /v1/chat/completions renders them, with
``add_special_tokens`` read as those endpoints read it. Each
image counts as the placeholder tokens the model's codec expands it to, so ``count`` is the
``usage.prompt_tokens`` the same request would report.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fovea.errors import InvalidRequest
from fovea.models.base import EncodeOptions
from fovea.serve.chat import build_chat_prompt, check_model_name, load_image_bytes
from fovea.serve.protocol import ChatCompletionRequest, ChatMessage
from fovea.serve.state import ServerState


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 unsupported_parameter


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    images: list[str] = Field(default_factory=list, description="fovea extension: images for the prompt")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    return_token_strs: bool = False
    # As the same request to chat or completions: None is their default (docs/api.md).
    add_special_tokens: bool | None = Field(default=None, strict=True)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.messages is not None and self.images:
            raise ValueError("images go with prompt; with messages send image_url parts")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def make_tokenize_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    loaded = state.loaded

    def max_model_len() -> int:
        return getattr(state.engine, "max_context", loaded.context_length)

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model_name(state, req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages, add_special_tokens=req.add_special_tokens)
            prompt, _ = await build_chat_prompt(state, chat)
        else:
            images = await load_image_bytes(state, [(ref, f"images[{i}]") for i, ref in enumerate(req.images)])
            prompt, _ = await state.preprocessor.prompts(req.prompt, images, template_rendered=False,
                                                         options=EncodeOptions(req.add_special_tokens))
        tokens = [int(t) for t in prompt.input_ids]
        strs = loaded.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return {"count": len(tokens), "max_model_len": max_model_len(), "tokens": tokens, "token_strs": strs}

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model_name(state, req.model)
        vocab = len(loaded.tokenizer)
        for i, token in enumerate(req.tokens):
            if token >= vocab:
                raise InvalidRequest(f"tokens[{i}] is {token}; this model's token ids run from 0 to {vocab - 1}.",
                                     param=f"tokens[{i}]")
        return {"prompt": loaded.tokenizer.decode(req.tokens)}

    return router
