"""PagedEngine's request contract: stop strings, length, seeds, cancellation, limits, errors."""

import asyncio
import threading

import pytest
import torch
from scene_helpers import collect, fresh_scene, run_all
from test_paged_helpers import prompt_for

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, TokenEvent
from fovea.engine.reference import reference_logits
from fovea.engine.sampling.params import SamplingParams
from fovea.errors import InvalidRequest, Overloaded
from fovea.loading.prompt import PlaceholderMismatch
from fovea.testing.tolerance import assert_close_to_model


def engine_for(model, **kw):
    return PagedEngine(model, PagedEngineConfig(num_blocks=kw.pop("num_blocks", 128), **kw))


# Each step queued before the previous step's tokens are read (the CUDA default) or after.
overlap_modes = pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])


def hold_steps_until(engine, release: threading.Event, after_steps: int = 2) -> list[int]:
    """From step ``after_steps + 1`` on, each model step waits for ``release``: the request cannot
    run ahead of the test, so whatever the test does after the first token lands mid-stream.
    Two free steps let the first token out with or without step overlap. Returns the live step count."""
    execute = engine.runner.execute
    steps = [0]

    def held(plan, previous=None):
        steps[0] += 1
        if steps[0] > after_steps:
            assert release.wait(timeout=60), "the test never released the engine"
        return execute(plan, previous)

    engine.runner.execute = held
    return steps


@overlap_modes
def test_max_tokens_and_stop_strings(demo_model, overlap):
    scene = fresh_scene(400, min_shapes=3)
    prompt = prompt_for(demo_model, scenes.render(scene))
    (short, fin_short), (_, fin_stop) = run_all(engine_for(demo_model, overlap_steps=overlap), [
        (prompt, SamplingParams(max_tokens=3, temperature=0)),
        (prompt, SamplingParams(max_tokens=40, temperature=0, stop=[" at"])),
    ])
    assert fin_short.finish_reason == "length" and len(short) == 3 and fin_short.completion_tokens == 3
    assert fin_stop.finish_reason == "stop" and " at" not in fin_stop.text
    assert fin_stop.text and scenes.describe_answer(scene).startswith(fin_stop.text)


@overlap_modes
def test_seeded_sampling_is_reproducible_batched_or_alone(demo_model, overlap):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(300)))
    def params(seed):
        return SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, seed=seed)

    a, b, _ = run_all(engine_for(demo_model, overlap_steps=overlap), [(prompt, params(7)), (prompt, params(7)), (prompt, params(8))])
    (alone, _), = run_all(engine_for(demo_model, overlap_steps=overlap), [(prompt, params(7))])
    assert a[0] == b[0] == alone
    assert a[1].prompt_tokens == len(prompt.input_ids) and a[1].completion_tokens >= len(a[0])


@overlap_modes
def test_first_logprobs_are_the_prompts_next_token_distribution(demo_model, overlap):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(310)))
    engine = engine_for(demo_model, overlap_steps=overlap)

    async def main():
        engine.start()
        try:
            return await collect(engine, prompt, SamplingParams(max_tokens=2, temperature=0),
                                 want_first_logprobs=True)
        finally:
            engine.stop()

    tokens, finish = asyncio.run(main())
    logits = reference_logits(demo_model, prompt)
    assert_close_to_model(finish.first_logprobs, torch.log_softmax(logits, -1), demo_model.model.config,
                          len(prompt.input_ids))
    assert tokens[0] == int(finish.first_logprobs.argmax())


@overlap_modes
def test_a_consumer_that_stops_listening_cancels_and_frees_its_blocks(demo_model, overlap):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(320)))
    engine = engine_for(demo_model, num_blocks=64, overlap_steps=overlap)
    closed = threading.Event()
    steps = hold_steps_until(engine, closed)
    reasons = []
    finish = engine._finish
    engine._finish = lambda seq, reason: (reasons.append(reason), finish(seq, reason))

    async def main():
        engine.start()
        try:
            stream = engine.generate(prompt, SamplingParams(max_tokens=100, temperature=1.0, seed=1))
            async for event in stream:
                assert isinstance(event, TokenEvent)
                break
            await stream.aclose()  # as when an HTTP client disconnects
            closed.set()
            for _ in range(200):
                if not engine.scheduler.has_work():
                    break
                await asyncio.sleep(0.01)
        finally:
            engine.stop()

    asyncio.run(main())
    assert reasons == ["cancelled"]
    assert steps[0] < 100, "the request ran to max_tokens: nothing was cancelled"
    assert engine.block_manager.num_free == 64


def test_prompts_that_cannot_fit_are_refused_up_front(demo_model):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(1)))
    engine = engine_for(demo_model, num_blocks=8)  # 128 tokens of KV cache
    with pytest.raises(InvalidRequest) as info:
        engine.check_fits(prompt, SamplingParams(max_tokens=demo_model.context_length))
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as info:
        engine.check_fits(prompt, SamplingParams(max_tokens=100))  # fits the model, not the cache
    assert info.value.code == "context_length_exceeded" and "128" in info.value.message
    engine.check_fits(prompt, SamplingParams(max_tokens=128 - len(prompt.input_ids)))


def test_a_full_queue_refuses_with_429(demo_model):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(2)))

    async def main():
        engine = engine_for(demo_model, max_queue=1)  # not started: nothing drains the queue
        first = engine.generate(prompt, SamplingParams(max_tokens=2))
        pending = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)
        assert engine.queue_depth == 1
        with pytest.raises(Overloaded) as info:
            await engine.generate(prompt, SamplingParams(max_tokens=2)).__anext__()
        pending.cancel()
        return info.value

    assert asyncio.run(main()).status == 429


def bad_then_good(engine, bad, good):
    """The events of ``bad``, then the finish of ``good`` on the same engine (still serving)."""
    async def main():
        engine.start()
        try:
            events = [e async for e in engine.generate(bad, SamplingParams(max_tokens=4))]
            _, finish = await collect(engine, good, SamplingParams(max_tokens=40, temperature=0))
            return events, finish
        finally:
            engine.stop()

    return asyncio.run(main())


def test_a_prompt_whose_image_rows_do_not_match_fails_alone(demo_model):
    good = prompt_for(demo_model, scenes.render(fresh_scene(3)))
    bad = prompt_for(demo_model, scenes.render(fresh_scene(4)))
    bad.images[0].num_tokens -= 1
    engine = engine_for(demo_model)

    events, finish = bad_then_good(engine, bad, good)
    assert len(events) == 1 and isinstance(events[0].error, PlaceholderMismatch)
    assert finish.text == scenes.describe_answer(fresh_scene(3))


def test_image_rows_short_of_the_placeholders_fail_that_request_alone(demo_model):
    # The hand-off guard: an encoder (or encode worker) that hands over fewer rows than the
    # prompt has image positions must fail the request loudly, never shift the text.
    good = prompt_for(demo_model, scenes.render(fresh_scene(5)))
    bad = prompt_for(demo_model, scenes.render(fresh_scene(6)))
    engine = engine_for(demo_model)
    embedder = engine.runner.embedder
    image_rows = embedder.image_rows

    def short_rows(seqs, errors=None):
        rows = image_rows(seqs, errors)
        return {key: (value[:-1] if key == bad.image_hashes[0] else value) for key, value in rows.items()}

    embedder.image_rows = short_rows

    events, finish = bad_then_good(engine, bad, good)
    assert len(events) == 1 and isinstance(events[0].error, PlaceholderMismatch)
    assert "63 image embedding rows" in str(events[0].error)
    assert finish.text == scenes.describe_answer(fresh_scene(5))


def test_stop_answers_requests_still_in_flight(demo_model):
    from fovea.engine.engine import EngineStopped

    prompt = prompt_for(demo_model, scenes.render(fresh_scene(330)))
    engine = engine_for(demo_model)
    hold_steps_until(engine, engine._stopping)  # the request is mid-stream when stop() is called

    async def main():
        engine.start()
        stream = engine.generate(prompt, SamplingParams(max_tokens=100, temperature=1.0, seed=3))
        first = await stream.__anext__()
        engine.stop()
        rest = [event async for event in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert isinstance(first, TokenEvent)
    assert isinstance(rest[-1], ErrorEvent) and isinstance(rest[-1].error, EngineStopped)
    assert engine.block_manager.num_free == 128
