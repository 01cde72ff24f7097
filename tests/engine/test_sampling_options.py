"""Sampling options honoured by the paged engine, against transformers and hand-computed references:
repetition/presence/frequency penalties, logit bias, raw log-probabilities and n choices sharing
the prompt's KV blocks. Each runs with the step queued one ahead and without."""

from __future__ import annotations

import asyncio

import pytest
import torch
from scene_helpers import fresh_scene
from test_paged_helpers import prompt_for

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import FinishEvent, TokenEvent
from fovea.engine.reference import reference_generate, reference_logits
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.testing.random_llava import write_model_dir
from fovea.testing.tolerance import assert_close_to_model

overlap_modes = pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """A tiny random-weight LLaVA: its next-token distributions are flat, so options change answers."""
    return load_model(write_model_dir(tmp_path_factory.mktemp("tiny"), "tiny"), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def random_prompt(random_model):
    return prompt_for(random_model, scenes.render(fresh_scene(77)))


def run(engine: PagedEngine, prompt, params: SamplingParams) -> dict[int, tuple[list[TokenEvent], FinishEvent]]:
    """Choice index -> (its token events, its finish)."""
    async def main():
        engine.start()
        try:
            out: dict[int, list] = {}
            async for event in engine.generate(prompt, params):
                assert isinstance(event, (TokenEvent, FinishEvent)), event
                out.setdefault(event.index, []).append(event)
            return {i: (events[:-1], events[-1]) for i, events in out.items()}
        finally:
            engine.stop()
    return asyncio.run(main())


def tokens_of(result, index: int = 0) -> list[int]:
    return [e.token_id for e in result[index][0] if e.token_id >= 0]


def engine_for(model, overlap: bool) -> PagedEngine:
    return PagedEngine(model, PagedEngineConfig(num_blocks=64, overlap_steps=overlap))


@overlap_modes
def test_greedy_repetition_penalty_is_transformers_generate(random_model, random_prompt, overlap):
    plain = tokens_of(run(engine_for(random_model, overlap), random_prompt, SamplingParams(max_tokens=12, temperature=0)))
    got = tokens_of(run(engine_for(random_model, overlap), random_prompt,
                        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.8)))
    assert got == reference_generate(random_model, random_prompt, 12, repetition_penalty=1.8)
    assert got != plain  # the penalty changed the answer: the comparison above means something


def hand_penalised(logits: torch.Tensor, generated: list[int], presence: float, frequency: float,
                   bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's formula, one token at a time: bias, minus frequency x count, minus presence if present."""
    out = logits.clone()
    for token, value in bias.items():
        out[token] += value
    for token in set(generated):
        out[token] -= frequency * generated.count(token) + presence
    return out


@overlap_modes
@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 2.0), (-1.0, 0.5)])
def test_presence_and_frequency_penalties_match_the_formula(random_model, random_prompt, overlap, presence, frequency):
    bias = {5: 0.75, 40: -3.0}
    result = run(engine_for(random_model, overlap), random_prompt,
                 SamplingParams(max_tokens=10, temperature=0, presence_penalty=presence, frequency_penalty=frequency,
                                logit_bias=bias, ignore_eos=True))
    got = tokens_of(result)
    assert len(got) == 10
    for i, token in enumerate(got):
        want = hand_penalised(reference_logits(random_model, random_prompt, got[:i]), got[:i], presence, frequency, bias)
        assert token == int(want.argmax()), (i, got)
    if presence > 0 or frequency > 0:  # repeats are discouraged: fewer than without the penalty
        plain = tokens_of(run(engine_for(random_model, overlap), random_prompt,
                              SamplingParams(max_tokens=10, temperature=0, logit_bias=bias, ignore_eos=True)))
        assert len(set(got)) >= len(set(plain))


@overlap_modes
def test_logit_bias_forces_a_token_and_penalties_batch_with_plain_rows(demo_model, overlap):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(78)))
    engine = engine_for(demo_model, overlap)

    async def main():
        engine.start()
        try:
            async def one(params):
                return [e.token_id async for e in engine.generate(prompt, params)
                        if isinstance(e, TokenEvent) and e.token_id >= 0]
            return await asyncio.gather(one(SamplingParams(max_tokens=4, temperature=0, logit_bias={12: 100.0})),
                                        one(SamplingParams(max_tokens=40, temperature=0)))
        finally:
            engine.stop()
    forced, plain = asyncio.run(main())
    assert forced == [12] * 4
    assert demo_model.tokenizer.decode(plain) == scenes.describe_answer(fresh_scene(78))  # the plain row is untouched
    assert engine.token_counts.capacity == 0  # no row was penalised: no counts were allocated


@overlap_modes
@pytest.mark.parametrize("options", [{}, {"temperature": 1.5, "seed": 3, "repetition_penalty": 1.5,
                                          "logit_bias": {7: 4.0}}], ids=["greedy", "sampled-penalised"])
def test_logprobs_are_the_reference_models_raw_log_softmax(random_model, random_prompt, overlap, options):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, **({"temperature": 0} | options))
    events, _ = run(engine_for(random_model, overlap), random_prompt, params)[0]
    generated = [e.token_id for e in events]
    assert len(generated) == 6
    for i, event in enumerate(events):
        want = torch.log_softmax(reference_logits(random_model, random_prompt, generated[:i]), dim=-1)
        entry = event.logprob
        assert entry is not None and entry.token_id == event.token_id
        # The error of a log-probability is the logits': the whole distribution's scale.
        config, context = random_model.model.config, len(random_prompt.input_ids) + i
        scale = float(want.abs().max())
        assert_close_to_model(torch.tensor(entry.logprob), want[event.token_id], config, context, scale=scale)
        top = torch.topk(want, 5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        got_top = torch.tensor([lp for _, lp in entry.top])
        assert_close_to_model(got_top, top.values, config, context, scale=scale)


@overlap_modes
def test_n_choices_share_the_prompts_blocks_and_reproduce_with_seeds(random_model, random_prompt, overlap):
    engine = engine_for(random_model, overlap)
    bs = engine.config.block_size
    full = (len(random_prompt.input_ids) - 1) // bs
    assert full >= 2
    shared: list[set[int]] = []
    execute = engine.runner.execute

    def watching(plan, previous=None):  # the prompt's blocks held by the running choices, and by how many
        seqs = [c.seq for c in plan.chunks]
        if len(seqs) == 3:
            tables = {tuple(s.block_table[:full]) for s in seqs}
            shared.append({engine.block_manager.ref_counts[b] for t in tables for b in t} if len(tables) == 1
                          else set())
        return execute(plan, previous)

    engine.runner.execute = watching
    params = SamplingParams(max_tokens=8, temperature=1.5, seed=21, n=3, ignore_eos=True)
    result = run(engine, random_prompt, params)
    assert sorted(result) == [0, 1, 2]
    assert shared and all(counts == {3} for counts in shared)  # one copy of the prompt, held by all three
    assert engine.block_manager.hit_tokens == 2 * full * bs  # choices 1 and 2 took it from the prefix cache
    answers = [tokens_of(result, i) for i in range(3)]
    assert len({tuple(a) for a in answers}) > 1  # the choices differ ...
    again = run(engine_for(random_model, overlap), random_prompt, params)
    assert [tokens_of(again, i) for i in range(3)] == answers  # ... and reproduce
    for i in (0, 2):  # choice i is the answer of n=1 with seed + i
        alone = run(engine_for(random_model, overlap), random_prompt,
                    SamplingParams(max_tokens=8, temperature=1.5, seed=21 + i, ignore_eos=True))
        assert tokens_of(alone) == answers[i]
    assert all(result[i][1].prompt_tokens == len(random_prompt.input_ids) for i in range(3))


def test_stop_token_ids_end_the_answer_after_min_tokens(random_model, random_prompt):
    plain = tokens_of(run(engine_for(random_model, False), random_prompt,
                          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    stop = plain[2]
    first = plain.index(stop)
    events, finish = run(engine_for(random_model, False), random_prompt,
                         SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert [e.token_id for e in events if e.token_id >= 0] == plain[:first]
    assert finish.finish_reason == "stop" and finish.completion_tokens == first + 1
    # Before min_tokens the stop token cannot be sampled at all: the answer goes on without it.
    events, finish = run(engine_for(random_model, False), random_prompt,
                         SamplingParams(max_tokens=8, min_tokens=8, temperature=0, ignore_eos=True,
                                        stop_token_ids=[stop]))[0]
    assert stop not in [e.token_id for e in events] and finish.completion_tokens == 8


def test_top_k_and_min_p_keep_only_the_top_token_at_their_limits(random_model, random_prompt):
    greedy = tokens_of(run(engine_for(random_model, False), random_prompt, SamplingParams(max_tokens=8, temperature=0)))
    for options in ({"top_k": 1}, {"min_p": 1.0}):
        for seed in range(3):
            got = run(engine_for(random_model, False), random_prompt,
                      SamplingParams(max_tokens=8, temperature=2.0, seed=seed, **options))
            assert tokens_of(got) == greedy, options
    wide = {tuple(tokens_of(run(engine_for(random_model, False), random_prompt,
                                SamplingParams(max_tokens=8, temperature=2.0, seed=s, top_k=5)))) for s in range(3)}
    assert len(wide) > 1  # top-k 5 still samples
