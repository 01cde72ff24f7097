"""What /v1/completions adds to the one-prompt path: prompts given as token ids, and a batch of
prompts answered in one response.

A batch's choices are indexed prompt by prompt, ``n`` each (choice ``k * n + j`` is prompt k's
j-th), as OpenAI and vLLM index them; usage counts every prompt once and every choice's tokens.
Each prompt is its own engine request, all admitted before the response starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from fastapi.responses import JSONResponse, Response

from fovea.engine.core.request import ErrorEvent, Event, FinishEvent, PromptScoring, Submission
from fovea.errors import FoveaError, InvalidRequest
from fovea.loading.prompt import EncodedPrompt, PlaceholderMismatch
from fovea.serve import protocol
from fovea.serve.generation import (
    TEXT,
    add_prompt_logprobs,
    collect_choices,
    event_stream,
    sampling_params,
    total_usage,
)
from fovea.serve.logprobs_format import LogprobFormatter
from fovea.serve.protocol import CompletionRequest
from fovea.serve.state import ServerState
from fovea.serve.structured import compile_request_grammar


def token_prompt(state: ServerState, ids: list[int], where: str) -> EncodedPrompt:
    """A prompt given as token ids, used as they are: each must be in the vocabulary, and none may
    be an image or video token (those stand for rows of an image, and such a prompt has none)."""
    tokenizer = state.loaded.tokenizer
    vocab = len(tokenizer)
    codec = state.loaded.codec
    reserved = {codec.image_token_id: "image"}
    video = getattr(getattr(codec, "video", None), "token_id", None)
    if video is not None:
        reserved[video] = "video"
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise InvalidRequest(f"{where}[{i}] is {token}, outside the vocabulary (0..{vocab - 1}).",
                                 param=f"{where}[{i}]")
        if token in reserved:
            raise PlaceholderMismatch(f"{where}[{i}] is {token}, this model's {reserved[token]} token, which stands "
                                      f"for an {reserved[token]}'s rows; a token-id prompt carries no images: send "
                                      "the prompt as text with `images` instead.", param=f"{where}[{i}]")
    return EncodedPrompt(list(ids), [], tokenizer.decode(ids))


class BatchSubmission:
    """The submissions of a batch's prompts as one: their events re-indexed ``k * n + index``;
    ``cancel`` cancels them all."""

    def __init__(self, submissions: list[Submission], n: int) -> None:
        self.submissions, self.n = submissions, n

    def cancel(self) -> None:
        for submission in self.submissions:
            submission.cancel()

    async def accepted(self) -> None:
        """Every prompt queued (a refusal of any raises, and cancels the others)."""
        try:
            for submission in self.submissions:
                await submission.accepted()
        except BaseException:
            self.cancel()
            raise

    async def events(self) -> AsyncIterator[Event]:
        merged: asyncio.Queue[Event] = asyncio.Queue()

        async def pump(k: int, submission: Submission) -> None:
            async with aclosing(submission.events()) as events:
                async for event in events:
                    event.index += k * self.n
                    merged.put_nowait(event)

        tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(self.submissions)]
        finished = 0
        try:
            while finished < self.n * len(self.submissions):
                event = await merged.get()
                yield event
                if isinstance(event, ErrorEvent):
                    return
                finished += isinstance(event, FinishEvent)
        finally:
            self.cancel()
            for task in tasks:
                task.cancel()


def admit(state: ServerState, prompts: list[EncodedPrompt], params: list, rid: str,
          scoring: PromptScoring | None = None) -> BatchSubmission:
    """Every prompt queued now, or none (a refusal cancels those already queued); ``scoring``:
    each prompt's, asked of its first choice."""
    submissions: list[Submission] = []
    try:
        for k, (prompt, one) in enumerate(zip(prompts, params, strict=True)):
            submissions.append(state.engine.submit(prompt, one, f"{rid}-{k}", scoring=scoring))
    except BaseException:
        for submission in submissions:
            submission.cancel()
        raise
    return BatchSubmission(submissions, params[0].n)


async def respond_batch(state: ServerState, req: CompletionRequest, prompts: list[EncodedPrompt]) -> Response:
    """Answer a batch of prompts (text without images, or token ids) in one response."""
    if req.fovea and (req.fovea.grounding or req.fovea.timing):
        raise InvalidRequest("fovea.grounding and fovea.timing describe one prompt; send each prompt of the batch "
                             "as a request of its own to have them.", param="fovea")
    params = []
    for k, prompt in enumerate(prompts):
        try:
            params.append(sampling_params(state, req, prompt))
            state.engine.check_fits(prompt, params[-1])
        except FoveaError as error:  # the limits hold per prompt: say which one
            error.message = f"prompt[{k}]: {error.message}"
            raise
    grammar = await compile_request_grammar(state, req, None)
    for one in params:
        one.grammar = grammar
    rid = protocol.completion_id("cmpl")
    batch = admit(state, prompts, params, rid, req.prompt_scoring())
    await batch.accepted()  # a refusal by the engine core is an HTTP error, before any stream starts
    whole = replace(params[0], n=req.n * len(prompts))  # the response's choices, over every prompt
    if req.stream:
        return event_stream(state, req, prompts, whole, rid, batch, TEXT)
    async with aclosing(batch.events()) as events:
        answers = await collect_choices(state, prompts[0], events, whole.n, rid)
    choices = [TEXT.choice(i, a.finish, None if whole.logprobs is None else
                           LogprobFormatter(state.loaded.tokenizer, TEXT.kind).format(a.logprobs))
               for i, a in enumerate(answers)]
    usage = total_usage([a.finish for a in answers], req.n)
    body = TEXT.response(rid, state.model_name, choices, usage, None)
    if req.prompt_logprobs is not None:
        add_prompt_logprobs(state, body, TEXT, [a.finish for a in answers[::req.n]], req.n)
    return JSONResponse(body)
