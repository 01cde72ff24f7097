"""POST /v1/completions (raw prompts: text with image placeholders, or token ids; one or a batch)
and POST /generate (the simple shape)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from fovea.errors import FoveaError, InvalidRequest
from fovea.loading.prompt import EncodedPrompt, render_chat
from fovea.models.base import EncodeOptions
from fovea.serve.chat import (
    check_model_name,
    load_image_bytes,
    refuse_typed_placeholder,
    refuse_typed_video_token,
)
from fovea.serve.completion_prompts import respond_batch, token_prompt
from fovea.serve.generation import TEXT, respond, run_choices, sampling_params, total_usage
from fovea.serve.protocol import CompletionRequest, GenerateRequest
from fovea.serve.state import ServerState


def make_completions_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    loaded = state.loaded

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model_name(state, req.model)
        state.engine.refuse_when_full()  # before its images are fetched and decoded
        batch = req.prompts
        if len(batch) > 1 and req.images:
            raise InvalidRequest("images go with one prompt; send a batch of prompts without images, or each "
                                 "prompt with its images as a request of its own.", param="images")
        if isinstance(batch[0], list) and req.images:
            raise InvalidRequest("a prompt of token ids carries no images; send the prompt as text, with one "
                                 "image placeholder per entry of images.", param="images")
        options = EncodeOptions(req.add_special_tokens)
        if len(batch) > 1:
            return await respond_batch(state, req, [await one_prompt(one, f"prompt[{k}]", options)
                                                    for k, one in enumerate(batch)])
        if isinstance(batch[0], list):
            where = "prompt[0]" if req.is_batch else "prompt"
            return await respond(state, req, token_prompt(state, batch[0], where), fmt=TEXT)
        images = await load_image_bytes(state, [(ref, f"images[{i}]") for i, ref in enumerate(req.images)])
        grounding = bool(req.fovea and req.fovea.grounding)
        prompt, twin = await state.preprocessor.prompts(batch[0], images, template_rendered=False,
                                                        blank_twin=grounding, options=options)
        return await respond(state, req, prompt, twin, fmt=TEXT)

    async def one_prompt(prompt: str | list[int], where: str, options: EncodeOptions) -> EncodedPrompt:
        """One prompt of a batch: token ids as they are, text as a prompt without images."""
        if isinstance(prompt, list):
            return token_prompt(state, prompt, where)
        try:
            return (await state.preprocessor.prompts(prompt, [], template_rendered=False, options=options))[0]
        except FoveaError as error:
            error.param = error.param or where
            raise

    @router.post("/generate")
    async def generate(req: GenerateRequest):
        check_model_name(state, req.model)
        state.engine.refuse_when_full()  # before its images are fetched and decoded
        refuse_typed_placeholder(req.prompt, loaded.image_token, "prompt")
        refuse_typed_video_token(state, req.prompt, "prompt")
        images = await load_image_bytes(state, [(req.image, "image")] if req.image else [])
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": req.prompt}]
        text = render_chat(loaded, [{"role": "user", "content": content}])
        prompt, _ = await state.preprocessor.prompts(text, images)
        params = sampling_params(state, req, prompt)
        state.engine.check_fits(prompt, params)
        answers = await run_choices(state, prompt, params, "gen-" + str(id(prompt)))
        finishes = [a.finish for a in answers]
        body = {"text": finishes[0].text, "finish_reason": finishes[0].finish_reason, "model": state.model_name,
                "usage": total_usage(finishes)}
        if params.n > 1:  # every choice; text and finish_reason above are choice 0's
            body["choices"] = [{"index": i, "text": f.text, "finish_reason": f.finish_reason}
                               for i, f in enumerate(finishes)]
        return JSONResponse(body)

    return router
