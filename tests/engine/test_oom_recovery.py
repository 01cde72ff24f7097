"""Out-of-memory errors inside a step lose no request: the step is retried smaller, and only a
request that cannot fit even alone fails, with its own error (injected allocation failures, CPU)."""

import pytest
import torch
from scene_helpers import collect, fresh_scene, run_all
from test_paged_helpers import prompt_for

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import ErrorEvent
from fovea.engine.engine import OutOfMemory
from fovea.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0)
overlap_modes = pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])


def engine_for(model, overlap, **kw):
    return PagedEngine(model, PagedEngineConfig(num_blocks=256, overlap_steps=overlap, max_num_batched_tokens=256,
                                                **kw))


def oom(what: str = "injected") -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 172.00 MiB ({what})")


def fail_steps_over(engine, max_tokens: int, times: int | None = None) -> list[int]:
    """Steps of more than ``max_tokens`` tokens run out of memory (at most ``times`` times);
    returns the token counts of the steps that failed."""
    execute, failed = engine.runner.execute, []

    def execute_or_fail(plan, previous=None):
        if plan.num_tokens > max_tokens and (times is None or len(failed) < times):
            failed.append(plan.num_tokens)
            raise oom()
        return execute(plan, previous)

    engine.runner.execute = execute_or_fail
    return failed


def prompts(model, n, seed=0):
    return [prompt_for(model, scenes.render(fresh_scene(seed + i))) for i in range(n)]


@overlap_modes
def test_a_burst_whose_big_steps_run_out_of_memory_is_answered_exactly(demo_model, overlap):
    jobs = [(p, GREEDY) for p in prompts(demo_model, 6, seed=1100)]
    reference = run_all(engine_for(demo_model, overlap), jobs)
    engine = engine_for(demo_model, overlap)
    failed = fail_steps_over(engine, max_tokens=100)  # 6 prompts of 73 tokens: only small steps fit
    results = run_all(engine, jobs)
    assert failed and engine.oom_recoveries == len(failed)
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in reference]
    assert all(finish.finish_reason == "stop" for _, finish in results)
    assert engine.scheduler.num_preemptions > 0


@overlap_modes
def test_limits_shrink_on_out_of_memory_and_grow_back(demo_model, overlap):
    engine = engine_for(demo_model, overlap)
    engine.scheduler.RECOVERY_STEPS = 2
    failed = fail_steps_over(engine, max_tokens=0, times=2)  # the first two steps, whatever their size
    run_all(engine, [(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
                     for p in prompts(demo_model, 3, seed=1200)])
    assert len(failed) == 2 and engine.oom_recoveries == 2
    # After enough good steps the limits are back where the configuration put them.
    assert engine.scheduler.token_limit == engine.scheduler.max_tokens
    assert engine.scheduler.seq_limit == engine.scheduler.max_seqs


@overlap_modes
def test_a_request_that_never_fits_fails_alone_and_the_engine_serves_on(demo_model, overlap):
    import asyncio

    engine = engine_for(demo_model, overlap)
    execute = engine.runner.execute
    never = {"on": True}

    def execute_or_fail(plan, previous=None):
        if never["on"]:
            raise oom("always")
        return execute(plan, previous)

    engine.runner.execute = execute_or_fail
    prompt = prompts(demo_model, 1, seed=1300)[0]

    async def main():
        engine.start()
        try:
            events = [e async for e in engine.generate(prompt, GREEDY)]
            never["on"] = False
            after = await collect(engine, prompt, GREEDY)
            return events, after
        finally:
            engine.stop()

    events, (tokens, finish) = asyncio.run(main())
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    error = events[0].error
    assert isinstance(error, OutOfMemory) and error.code == "out_of_memory" and error.status == 503
    assert "even alone" in error.message
    assert engine.oom_recoveries >= 2  # shrunk to the smallest step before giving up
    assert finish.finish_reason == "stop" and tokens  # the engine is unharmed


@overlap_modes
def test_out_of_memory_in_the_vision_stage_is_retried(demo_model, overlap):
    engine = engine_for(demo_model, overlap)
    fill, calls = engine.runner.embedder.fill, []

    def fill_or_fail(seqs):
        calls.append(len(seqs))
        if len(calls) == 1:
            raise oom("vision")
        return fill(seqs)

    engine.runner.embedder.fill = fill_or_fail
    jobs = [(p, GREEDY) for p in prompts(demo_model, 3, seed=1400)]
    reference = run_all(engine_for(demo_model, overlap), jobs)
    results = run_all(engine, jobs)
    assert engine.oom_recoveries == 1 and len(calls) > 1
    assert [t for t, _ in results] == [t for t, _ in reference]
