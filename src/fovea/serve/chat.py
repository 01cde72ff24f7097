"""POST /v1/chat/completions: OpenAI messages -> images + chat template -> the engine."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from fovea.errors import FoveaError, InvalidRequest
from fovea.loading.prompt import EncodedPrompt, PlaceholderMismatch, render_chat
from fovea.media.video import load_video_bytes
from fovea.models.base import EncodeOptions
from fovea.serve.generation import respond
from fovea.serve.protocol import ChatCompletionRequest, ChatMessage, ImageURLPart, VideoURLPart
from fovea.serve.state import ServerState
from fovea.serve.structured import refuse_with_tools, requested_grammar
from fovea.serve.tools.calls import (
    ToolRequest,
    call_grammar,
    check_template,
    template_call,
    tool_request,
)
from fovea.serve.tools.chunks import ToolFormat


class TooManyImages(FoveaError):
    status, code = 400, "too_many_images"


class VideosNotSupported(FoveaError):
    status, code = 400, "videos_not_supported"


class ModelNotFound(FoveaError):
    status, code = 404, "model_not_found"


def check_model_name(state: ServerState, name: str | None, param: str | None = "model") -> None:
    if name and name != state.model_name:
        raise ModelNotFound(f"model {name!r} is not served here; this server serves {state.model_name!r} "
                            "(GET /v1/models lists it).", param=param)


def refuse_typed_placeholder(text: str, image_token: str, where: str) -> None:
    """The image token typed as text would be read as an image slot with no image behind it."""
    if image_token in text:
        raise PlaceholderMismatch(
            f"{where} contains the text {image_token!r}, which this model reserves for images; remove it and "
            "send images as image_url parts (or use /v1/completions for raw prompts with placeholders).",
            param=where)


def refuse_typed_video_token(state: ServerState, text: str, where: str) -> None:
    """The video token typed as text would be read as a video slot with no video behind it."""
    token = getattr(state.loaded.codec, "video_token", None)
    if token and token in text:
        raise PlaceholderMismatch(f"{where} contains the text {token!r}, which this model reserves for videos; "
                                  "remove it and send videos as video_url parts.", param=where)


def to_template_messages(messages: list[ChatMessage], image_token: str = "<image>",
                         videos: list[tuple[str, str]] | None = None
                         ) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """transformers-style messages plus the (image reference, request path) of each image; the
    videos' go into ``videos`` (None: the model takes none, and a video part is refused)."""
    out: list[dict[str, Any]] = []
    images: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None:
            if message.role != "assistant":
                raise InvalidRequest(f"messages[{i}] has no content.", param=f"messages[{i}].content")
            content = ""
        if isinstance(content, str):
            refuse_typed_placeholder(content, image_token, f"messages[{i}].content")
            out.append(with_message_fields({"role": message.role, "content": content}, message, i))
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if isinstance(part, ImageURLPart):
                if message.role != "user":
                    raise InvalidRequest(f"messages[{i}] is a {message.role} message; images may only be "
                                         "sent in user messages.", param=f"messages[{i}].content[{j}]")
                images.append((part.image_url.url, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            elif isinstance(part, VideoURLPart):
                where = f"messages[{i}].content[{j}]"
                if videos is None:
                    raise VideosNotSupported("this server's model takes no video input (video_url parts are for "
                                             "video models such as Qwen2.5-VL); send frames as image_url parts.",
                                             param=where)
                if message.role != "user":
                    raise InvalidRequest(f"messages[{i}] is a {message.role} message; videos may only be "
                                         "sent in user messages.", param=where)
                videos.append((part.video_url.url, where))
                parts.append({"type": "video"})
            else:
                refuse_typed_placeholder(part.text, image_token, f"messages[{i}].content[{j}].text")
                parts.append({"type": "text", "text": part.text})
        out.append(with_message_fields({"role": message.role, "content": parts}, message, i))
    return out, images


def with_message_fields(rendered: dict[str, Any], message: ChatMessage, i: int) -> dict[str, Any]:
    """The message's ``name``, an assistant's earlier tool calls (arguments as objects, as chat
    templates expect them) and a tool message's call id, for the templates that render them."""
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [template_call(c.id, c.function.name, c.function.arguments,
                                                f"messages[{i}].tool_calls[{j}].function.arguments")
                                  for j, c in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


async def load_image_bytes(state: ServerState, refs: list[tuple[str, str]]) -> list[tuple[bytes, str]]:
    """The bytes of each referenced image with its request path (decoding happens in the
    preprocessor, which names the path in any refusal)."""
    limit = state.settings.limit_images_per_prompt
    if len(refs) > limit:
        raise TooManyImages(f"the request carries {len(refs)} images; this server accepts at most {limit} "
                            "per prompt (--limit-images-per-prompt).", param=refs[limit][1])

    async def one(ref: str, where: str) -> tuple[bytes, str]:
        try:
            return await state.resolver.aload_bytes(ref), where
        except FoveaError as exc:
            exc.param = where
            raise

    return list(await asyncio.gather(*(one(ref, where) for ref, where in refs)))


async def load_videos(state: ServerState, refs: list[tuple[str, str]]) -> list[tuple[bytes, str]]:
    """The bytes of each referenced video with its request path (decoded in the preprocessor)."""

    async def one(ref: str, where: str) -> tuple[bytes, str]:
        try:
            return await asyncio.to_thread(load_video_bytes, ref, state.resolver.config), where
        except FoveaError as exc:
            exc.param = where
            raise

    return list(await asyncio.gather(*(one(ref, where) for ref, where in refs)))


async def build_chat_prompt(state: ServerState, req: ChatCompletionRequest, tools: ToolRequest | None = None
                            ) -> tuple[EncodedPrompt, EncodedPrompt | None]:
    """The prompt, and for a grounding score its twin with every image blanked."""
    video_token = getattr(state.loaded.codec, "video_token", None)
    video_refs: list[tuple[str, str]] | None = [] if video_token else None
    messages, refs = to_template_messages(req.messages, state.loaded.image_token, video_refs)
    if video_token:
        for i, message in enumerate(req.messages):
            texts = [message.content] if isinstance(message.content, str) else \
                [p.text for p in message.content or [] if not isinstance(p, (ImageURLPart, VideoURLPart))]
            for text in texts:
                refuse_typed_video_token(state, text, f"messages[{i}].content")
    if video_refs and len(refs) + len(video_refs) > state.settings.limit_images_per_prompt:
        raise TooManyImages(f"the request carries {len(refs)} images and {len(video_refs)} videos; this server "
                            f"accepts at most {state.settings.limit_images_per_prompt} of them together per prompt "
                            "(--limit-images-per-prompt).", param=video_refs[-1][1])
    images = await load_image_bytes(state, refs)
    videos = await load_videos(state, video_refs) if video_refs else []
    text = render_chat(state.loaded, messages, tools.tools if tools else None)  # jinja: well under a millisecond
    grounding = bool(req.fovea and req.fovea.grounding)
    options = EncodeOptions(req.add_special_tokens, low_detail(req.messages))
    if videos:
        return await state.preprocessor.prompts(text, images, blank_twin=grounding, videos=videos, options=options)
    return await state.preprocessor.prompts(text, images, blank_twin=grounding, options=options)


def low_detail(messages: list[ChatMessage]) -> tuple[bool, ...]:
    """Per image, in the order to_template_messages collects them: sent with detail "low"."""
    return tuple(part.image_url.detail == "low" for message in messages if isinstance(message.content, list)
                 for part in message.content if isinstance(part, ImageURLPart))


def make_chat_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model_name(state, req.model)
        state.engine.refuse_when_full()  # before its images are fetched and decoded
        for i, message in enumerate(req.messages):  # a conversation with tool turns needs a template for them
            if message.role == "tool" or message.tool_calls:
                check_template(state.loaded, f"messages[{i}] is a tool turn", f"messages[{i}]")
        tools = tool_request(req, state.loaded)
        prompt, twin = await build_chat_prompt(state, req, tools)
        if tools is None:
            return await respond(state, req, prompt, twin)
        refuse_with_tools(requested_grammar(req))
        grammar = call_grammar(tools)  # where it enforces the calls, their arguments stream as written
        return await respond(state, req, prompt, twin, fmt=ToolFormat(grammar is not None), grammar=grammar)

    return router
