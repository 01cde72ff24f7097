"""POST /v1/completions (a raw prompt with image placeholders) and POST /generate (the simple shape)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from PIL import Image

from fovea.model.prompt import encode_prompt, render_chat
from fovea.serve.chat import check_model_name, load_images, refuse_typed_placeholder
from fovea.serve.generation import TEXT, respond, run_to_finish, sampling_params
from fovea.serve.protocol import CompletionRequest, GenerateRequest, usage
from fovea.serve.state import ServerState


def blank_copies(images: list[Image.Image]) -> list[Image.Image]:
    return [Image.new("RGB", im.size, (255, 255, 255)) for im in images]


def make_completions_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    loaded = state.loaded

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model_name(state, req.model)
        images = await load_images(state, [(ref, f"images[{i}]") for i, ref in enumerate(req.images)])
        prompt = await asyncio.to_thread(encode_prompt, loaded, req.prompt, images, template_rendered=False)
        twin = None
        if req.fovea and req.fovea.grounding and images:
            twin = await asyncio.to_thread(encode_prompt, loaded, req.prompt, blank_copies(images),
                                           template_rendered=False)
        return await respond(state, req, prompt, twin, fmt=TEXT)

    @router.post("/generate")
    async def generate(req: GenerateRequest):
        check_model_name(state, req.model)
        refuse_typed_placeholder(req.prompt, loaded.image_token, "prompt")
        refs = [(req.image, "image")] if req.image else []
        images = await load_images(state, refs)
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": req.prompt}]
        text = await asyncio.to_thread(render_chat, loaded, [{"role": "user", "content": content}])
        prompt = await asyncio.to_thread(encode_prompt, loaded, text, images)
        params = sampling_params(state, req, prompt)
        state.engine.check_fits(prompt, params)
        finish = await run_to_finish(state, prompt, params, "gen-" + str(id(prompt)))
        return JSONResponse({"text": finish.text, "finish_reason": finish.finish_reason,
                             "model": state.model_name,
                             "usage": usage(finish.prompt_tokens, finish.completion_tokens)})

    return router
