"""Prompt scoring through the paged engine (``PromptScoring``) against transformers' forward, on the
tiny random-weight Qwen2.5-VL, Qwen3-VL and LLaVA checkpoints: every prompt token's log-probability,
rank and top-k (vLLM's ``prompt_logprobs``) and whole rows of the last positions (grounding), read
from a chunked prefill, with the memory profile's slices of logits, and with the prefix cache."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from PIL import Image

from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, FinishEvent, PromptScoring
from fovea.engine.reference import reference_prompt_logprobs
from fovea.engine.sampling.params import SamplingParams
from fovea.guard.canary import kl_divergence
from fovea.guard.grounding import answer_dependence, answer_ids
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat
from fovea.models.base import with_text_tokens
from fovea.testing.tolerance import assert_close_to_model, model_path_len, reduction_atol

# (family, image sizes, tokens per prefill step: each prompt takes several chunks)
FAMILIES = {"qwen2_5_vl": ([(300, 200), (64, 90)], 12), "qwen3_vl": ([(300, 200), (90, 64)], 12),
            "llava": ([(80, 60)], 128)}


def write(family: str, out):
    if family == "qwen2_5_vl":
        from fovea.testing.random_qwen2_5_vl import write_model_dir
        return write_model_dir(out, arch="tiny", seed=3)
    if family == "qwen3_vl":
        from fovea.testing.random_qwen3_vl import write_model_dir
        return write_model_dir(out, arch="tiny", seed=3)
    from fovea.testing.random_llava import write_model_dir
    return write_model_dir(out, "tiny", seed=3)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    return name, load_model(write(name, tmp_path_factory.mktemp(name) / name), "cpu", "float32")


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))


def prompt_of(name: str, model, seed: int = 0, text: str = "you are a helpful assistant"):
    images = [noise(w, h, seed + i) for i, (w, h) in enumerate(FAMILIES[name][0])]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return encode_prompt(model, render_chat(model, [{"role": "user", "content": content}]), images)


def engine_for(name: str, model, max_num_seqs: int = 3) -> PagedEngine:
    # max_num_seqs 3: the scored rows go through the LM head two or three at a time.
    return PagedEngine(model, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=FAMILIES[name][1],
                                                max_num_seqs=max_num_seqs))


ONE = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def run(engine: PagedEngine, jobs: list[tuple]) -> list[dict[int, FinishEvent]]:
    """Each job (prompt, params, scoring): its finish events by choice index."""
    async def one(prompt, params, scoring):
        out = {}
        async for event in engine.generate(prompt, params, scoring=scoring):
            if isinstance(event, ErrorEvent):
                raise event.error
            if isinstance(event, FinishEvent):
                out[event.index] = event
        return out

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(one(*job) for job in jobs))
        finally:
            engine.stop()

    return asyncio.run(main())


def check_against_reference(model, prompt, finish: FinishEvent, top: int, full_rows: int) -> None:
    ref = reference_prompt_logprobs(model, prompt)  # [L, vocab]
    length = len(prompt.input_ids)
    config = model.model.config
    entries = finish.prompt_logprobs
    assert entries is not None and len(entries) == length - 1  # every token but the first
    targets = torch.tensor(prompt.input_ids[1:])
    assert [e.token_id for e in entries] == targets.tolist()
    rows = ref[:-1]  # row p predicts token p + 1
    scale = float(rows.abs().max())  # the distributions' scale: their logits' error is the values'
    own_ref = rows.gather(1, targets[:, None])[:, 0]
    ours = torch.tensor([e.logprob for e in entries])
    assert_close_to_model(ours, own_ref, config, length, scale=scale, what="prompt token log-probabilities")
    # Ranks: within what the tolerance allows near ties to reorder.
    atol = reduction_atol(torch.float32, model_path_len(config, length), scale)
    ranks = torch.tensor([e.rank for e in entries])
    surely_above = (rows > own_ref[:, None] + 2 * atol).sum(1) + 1
    maybe_above = (rows > own_ref[:, None] - 2 * atol).sum(1)
    assert bool(((surely_above <= ranks) & (ranks <= maybe_above)).all()), "ranks disagree with the reference"
    # Top-k: k entries, most likely first, their values the reference's top values and each id's
    # own reference value.
    assert all(len(e.top) == top for e in entries)
    values = torch.tensor([[lp for _, lp in e.top] for e in entries])
    ids = torch.tensor([[t for t, _ in e.top] for e in entries])
    assert_close_to_model(values, torch.topk(rows, top, dim=-1).values, config, length, scale=scale, what="top-k")
    assert_close_to_model(values, rows.gather(1, ids), config, length, scale=scale, what="top-k ids")
    # Whole rows of the last positions.
    assert finish.prompt_rows is not None and finish.prompt_rows.shape == (full_rows, rows.shape[1])
    assert_close_to_model(finish.prompt_rows, rows[-full_rows:], config, length, what="full rows")


def test_prompt_scores_equal_transformers_over_chunked_prefill(family):
    name, model = family
    prompt = prompt_of(name, model)
    engine = engine_for(name, model)
    assert len(prompt.input_ids) > 3 * engine.config.max_num_batched_tokens  # several prefill chunks
    scored, = run(engine, [(prompt, ONE, PromptScoring(top=5, full_rows=4))])
    check_against_reference(model, prompt, scored[0], 5, 4)


def test_a_prompt_in_the_prefix_cache_is_still_scored_whole(family):
    """The same prompt answered first without scoring (its blocks go to the prefix cache), then
    scored, twice: a scoring sequence takes no cached blocks, so every row is still computed,
    and both runs equal the reference; a request after them that does not score takes the hits."""
    name, model = family
    prompt = prompt_of(name, model, seed=7)
    engine = engine_for(name, model)
    run(engine, [(prompt, ONE, None)])
    hits = engine.block_manager.hit_tokens
    first, = run(engine, [(prompt, ONE, PromptScoring(top=3, full_rows=2))])
    second, = run(engine, [(prompt, ONE, PromptScoring(top=3, full_rows=2))])
    assert engine.block_manager.hit_tokens == hits  # the scored runs took no cached block
    for finish in (first[0], second[0]):
        check_against_reference(model, prompt, finish, 3, 2)
    assert [e.logprob for e in first[0].prompt_logprobs] == [e.logprob for e in second[0].prompt_logprobs]
    run(engine, [(prompt, ONE, None)])
    assert engine.block_manager.hit_tokens > hits  # the cache itself still serves


def test_n_choices_score_the_prompt_once(family):
    name, model = family
    if name != "qwen2_5_vl":
        pytest.skip("engine bookkeeping, family-independent")
    prompt = prompt_of(name, model, seed=11)
    engine = engine_for(name, model, max_num_seqs=4)
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=5, n=3, ignore_eos=True)
    finishes, = run(engine, [(prompt, params, PromptScoring(top=0))])
    assert engine.prompts_scored == 1
    assert finishes[0].prompt_logprobs is not None and len(finishes[0].prompt_logprobs) == len(prompt.input_ids) - 1
    assert all(e.top == [] for e in finishes[0].prompt_logprobs)  # prompt_logprobs=0: the token alone
    assert finishes[1].prompt_logprobs is None and finishes[2].prompt_logprobs is None


def test_scoring_survives_a_preemption(family):
    """A cache too small for two sequences: one is preempted mid-way and recomputed; its scores
    are taken again from the start and still equal the reference."""
    name, model = family
    if name != "qwen2_5_vl":
        pytest.skip("engine bookkeeping, family-independent")
    prompt = prompt_of(name, model, seed=13)
    blocks = -(-len(prompt.input_ids) // 16) + 3
    engine = PagedEngine(model, PagedEngineConfig(num_blocks=blocks, max_num_batched_tokens=12, max_num_seqs=3))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    _, second = run(engine, [(prompt_of(name, model, seed=14), params, None),
                                 (prompt, params, PromptScoring(top=2, full_rows=1))])
    assert engine.scheduler.num_preemptions > 0
    check_against_reference(model, prompt, second[0], 2, 1)


def test_with_text_tokens_continues_the_prompt(family):
    """The prompt plus text tokens: the same images, and for M-RoPE the positions transformers
    gives the longer sequence (get_rope_index over it), the delta unchanged."""
    name, model = family
    prompt = prompt_of(name, model, seed=17)
    longer = with_text_tokens(prompt, [5, 6, 7])
    assert longer.input_ids == prompt.input_ids + [5, 6, 7] and longer.images == prompt.images
    assert longer.position_delta == prompt.position_delta
    if prompt.positions is None:
        assert longer.positions is None
        return
    assert [row[:len(prompt.input_ids)] for row in longer.positions] == prompt.positions
    ids = torch.tensor([longer.input_ids])
    extra = model.adapter.reference_inputs(longer, torch.device("cpu"), model.image_token_id)
    kwargs = {"image_grid_thw": extra["image_grid_thw"]}
    if "mm_token_type_ids" in extra:
        kwargs["mm_token_type_ids"] = extra["mm_token_type_ids"]
    theirs, delta = model.model.model.get_rope_index(ids, **kwargs)
    assert theirs[:, 0].tolist() == longer.positions and int(delta) == longer.position_delta
    assert with_text_tokens(prompt, []).positions == prompt.positions


def test_the_grounding_report_equals_transformers(family):
    """The engine's grounding report (two scoring requests) against the KL of transformers'
    teacher-forced forward over the same prompts, with the images and with blank ones."""
    name, model = family
    images = [noise(w, h, 20 + i) for i, (w, h) in enumerate(FAMILIES[name][0])]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "you are"}]
    text = render_chat(model, [{"role": "user", "content": content}])
    prompt = encode_prompt(model, text, images)
    twin = encode_prompt(model, text, [Image.new("RGB", im.size, (255, 255, 255)) for im in images])
    engine = engine_for(name, model)
    answer = "you are a helpful assistant you are a helpful"

    async def main():
        engine.start()
        try:
            return await answer_dependence(engine, model, prompt, twin, answer, threshold=0.05)
        finally:
            engine.stop()

    report = asyncio.run(main())
    ids = answer_ids(model, answer, engine.max_context)
    m, length = len(ids), len(prompt.input_ids)
    assert report["scored_tokens"] == m == 8
    real = reference_prompt_logprobs(model, with_text_tokens(prompt, ids))[length - 1:length - 1 + m]
    blank = reference_prompt_logprobs(model, with_text_tokens(twin, ids))[length - 1:length - 1 + m]
    # KL(p||q) = sum p (a - b) over log-probabilities a, b that each err by at most e: it moves by
    # at most e (2 + max|a - b|) (the p-weighted sum of the errors, and p's own change times a - b),
    # plus the report's rounding to 6 decimals.
    e = reduction_atol(torch.float32, model_path_len(model.model.config, length + m),
                       max(float(real.abs().max()), float(blank.abs().max())))
    for i, got in enumerate(report["kl_per_token"]):
        want = kl_divergence(real[i], blank[i])
        bound = e * (2 + float((real[i] - blank[i]).abs().max())) + 1e-6
        assert abs(got - want) <= bound, (i, got, want, bound)
    assert report["max_kl"] > 0 and report["image_dependent"] == (report["max_kl"] > 0.05)
    assert engine.prompts_scored == 2
