import asyncio

import pytest
from scene_helpers import fresh_scene
from scene_helpers import run_all as run_engine

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.detokenize import IncrementalDetokenizer
from fovea.engine.reference import reference_generate
from fovea.engine.sampling.params import SamplingParams
from fovea.errors import InvalidRequest, Overloaded
from fovea.loading.prompt import encode_prompt, render_chat


def prompt_for(model, image, question="Describe the image."):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return encode_prompt(model, render_chat(model, messages), [image])


def run_all(model, jobs, config=None):
    return run_engine(PagedEngine(model, config or PagedEngineConfig()), jobs)


def test_greedy_is_token_identical_to_transformers_generate(demo_model):
    images = [scenes.render(fresh_scene(i)) for i in range(6)]
    prompts = [prompt_for(demo_model, img) for img in images]
    results = run_all(demo_model, [(p, SamplingParams(max_tokens=40, temperature=0.0)) for p in prompts])
    for prompt, (tokens, finish) in zip(prompts, results):
        assert tokens == reference_generate(demo_model, prompt, 40)
        assert finish.finish_reason == "stop"


def test_batched_answers_equal_one_at_a_time_answers(demo_model):
    jobs = [(prompt_for(demo_model, scenes.render(fresh_scene(100 + i))), SamplingParams(max_tokens=40, temperature=0.0))
            for i in range(6)]
    together = run_all(demo_model, jobs, PagedEngineConfig(max_num_seqs=8))
    alone = run_all(demo_model, jobs, PagedEngineConfig(max_num_seqs=1))
    assert [t for t, _ in together] == [t for t, _ in alone]


def test_answers_are_right_and_depend_on_the_image(demo_model):
    chosen = [fresh_scene(200 + i) for i in range(8)]
    results = run_all(demo_model, [(prompt_for(demo_model, scenes.render(s)), SamplingParams(max_tokens=40, temperature=0))
                                   for s in chosen])
    answers = [finish.text for _, finish in results]
    assert answers == [scenes.describe_answer(s) for s in chosen]
    assert len(set(answers)) > 1


def test_seeded_sampling_is_reproducible_and_usage_is_counted(demo_model):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(300)))
    params = lambda seed: SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, seed=seed)
    a, b = run_all(demo_model, [(prompt, params(7)), (prompt, params(7))])
    assert a[0] == b[0]
    assert a[1].prompt_tokens == len(prompt.input_ids)
    assert a[1].completion_tokens >= len(a[0])


def test_max_tokens_and_stop_strings(demo_model):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(400, min_shapes=3)))
    (short, fin_short), (stopped, fin_stop) = run_all(demo_model, [
        (prompt, SamplingParams(max_tokens=3, temperature=0)),
        (prompt, SamplingParams(max_tokens=40, temperature=0, stop=[" at"])),
    ])
    assert fin_short.finish_reason == "length" and len(short) == 3
    assert fin_stop.finish_reason == "stop" and " at" not in fin_stop.text
    assert fin_stop.text and scenes.describe_answer(fresh_scene(400, min_shapes=3)).startswith(fin_stop.text)


def test_prompt_longer_than_context_is_refused_up_front(demo_model):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(1)))
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=64))
    with pytest.raises(InvalidRequest) as info:
        engine.check_fits(prompt, SamplingParams(max_tokens=demo_model.context_length))
    assert info.value.code == "context_length_exceeded"


def test_a_full_queue_refuses_with_429(demo_model):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(2)))

    async def main():
        engine = PagedEngine(demo_model, PagedEngineConfig(max_queue=1, num_blocks=64))  # not started: nothing drains the queue
        first = engine.generate(prompt, SamplingParams(max_tokens=2))
        pending = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)  # let the first request enter the queue
        with pytest.raises(Overloaded) as info:
            await engine.generate(prompt, SamplingParams(max_tokens=2)).__anext__()
        pending.cancel()
        return info.value

    error = asyncio.run(main())
    assert error.status == 429


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_detokenizer_holds_back_a_possible_stop_string():
    detok = IncrementalDetokenizer(_CharTokenizer(), stop=["END"])
    out = [detok.push(ord(c)) for c in "abEN"]
    assert "".join(out) == "ab"  # "EN" might become "END"
    assert detok.push(ord("x")) == "ENx"
    assert detok.push(ord("E")) == "" and detok.push(ord("N")) == "" and detok.push(ord("D")) == ""
    assert detok.stopped and detok.text == "abENx"
