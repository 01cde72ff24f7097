"""PagedEngine end to end on the demo model: answers, batching, prefix cache, preemption."""

import pytest
from scene_helpers import fresh_scene, run_all
from test_paged_helpers import prompt_for, reference_tokens

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
# Each step queued before the previous step's tokens are read (the CUDA default) or after.
overlap_modes = pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])


def prompts(model, seeds, **kw):
    return [prompt_for(model, scenes.render(fresh_scene(s, **kw))) for s in seeds]


@overlap_modes
@pytest.mark.parametrize("tokens", [None, 24], ids=["whole-prompt", "chunked-24"])
def test_greedy_is_token_identical_to_transformers_generate(demo_model, tokens, overlap):
    # 24-token chunks split the 64-token image run over three steps.
    chosen = prompts(demo_model, range(500, 505))
    engine = PagedEngine(demo_model, PagedEngineConfig(max_num_batched_tokens=tokens, num_blocks=256,
                                                       overlap_steps=overlap))
    results = run_all(engine, [(p, GREEDY) for p in chosen])
    for prompt, (tokens_out, finish) in zip(chosen, results):
        assert tokens_out == reference_tokens(demo_model, prompt)
        assert finish.finish_reason == "stop" and finish.prompt_tokens == len(prompt.input_ids)
        assert finish.first_token_s is not None and finish.total_s >= finish.first_token_s
    assert engine.scheduler.running == [] and engine.block_manager.num_free == 256
    # Overlapped, steps really were queued behind unread ones; in turn, never.
    assert (engine.steps_queued_ahead > 0) == overlap


def test_more_requests_than_max_num_seqs_answer_as_one_at_a_time(demo_model):
    chosen = prompts(demo_model, range(600, 610))
    jobs = [(p, GREEDY) for p in chosen]
    together = run_all(PagedEngine(demo_model, PagedEngineConfig(max_num_seqs=4, num_blocks=256)), jobs)
    alone = run_all(PagedEngine(demo_model, PagedEngineConfig(max_num_seqs=1, num_blocks=256)), jobs)
    assert [t for t, _ in together] == [t for t, _ in alone]
    answers = [f.text for _, f in together]
    assert answers == [scenes.describe_answer(fresh_scene(s)) for s in range(600, 610)]


@overlap_modes
def test_same_image_and_question_share_prefix_blocks(demo_model, overlap):
    prompt = prompts(demo_model, [700])[0]
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=256, overlap_steps=overlap))
    (first, _), = run_all(engine, [(prompt, GREEDY)])
    assert engine.block_manager.hit_tokens == 0
    (second, _), = run_all(engine, [(prompt, GREEDY)])
    full_blocks = (len(prompt.input_ids) - 1) // 16
    assert engine.block_manager.hit_tokens == full_blocks * 16 > 0
    assert second == first == reference_tokens(demo_model, prompt)


def test_different_images_with_identical_token_ids_share_no_image_block(demo_model):
    a, b = prompts(demo_model, [710, 711])
    assert a.input_ids == b.input_ids and a.image_hashes != b.image_hashes
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=256))
    (tokens_a, _), = run_all(engine, [(a, GREEDY)])
    (tokens_b, _), = run_all(engine, [(b, GREEDY)])
    first_image_pos = a.input_ids.index(demo_model.image_token_id)
    assert engine.block_manager.hit_tokens <= first_image_pos  # only text-only leading blocks
    assert tokens_a == reference_tokens(demo_model, a) and tokens_b == reference_tokens(demo_model, b)
    assert tokens_a != tokens_b


@overlap_modes
def test_a_kv_cache_too_small_for_everyone_preempts_and_still_answers_right(demo_model, overlap):
    chosen = prompts(demo_model, range(800, 806))
    # 40 blocks of 4 tokens hold two 73-token prompts with their answers, not six; small blocks
    # make decodes ask for blocks often, so running sequences are preempted mid-answer.
    engine = PagedEngine(demo_model, PagedEngineConfig(block_size=4, num_blocks=40, overlap_steps=overlap))
    produced_when_preempted = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        produced_when_preempted.extend(seq.produced for seq in plan.preempted)
        return plan

    engine.scheduler.schedule = recording_schedule
    results = run_all(engine, [(p, GREEDY) for p in chosen])
    assert engine.scheduler.num_preemptions > 0 and max(produced_when_preempted) > 0
    for prompt, (tokens_out, finish) in zip(chosen, results):
        assert tokens_out == reference_tokens(demo_model, prompt)
        assert finish.completion_tokens == len(tokens_out) + 1  # + EOS
    assert engine.block_manager.num_free == 40


@overlap_modes
def test_preemption_without_prefix_cache_recomputes_generated_tokens(demo_model, overlap):
    chosen = prompts(demo_model, range(810, 814))
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=12, enable_prefix_caching=False,
                                                       max_num_batched_tokens=32, overlap_steps=overlap))
    results = run_all(engine, [(p, GREEDY) for p in chosen])
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.hit_tokens == 0
    assert [t for t, _ in results] == [reference_tokens(demo_model, p) for p in chosen]
