"""ignore_eos and min_tokens (vLLM's request extensions) on both engines, with and without step overlap."""

import pytest
from scene_helpers import fresh_scene, run_all
from test_paged_helpers import prompt_for

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.sampling.params import SamplingParams

ENGINES = pytest.mark.parametrize("make", [
    pytest.param(lambda m: PagedEngine(m, PagedEngineConfig(num_blocks=128, overlap_steps=False)), id="paged"),
    pytest.param(lambda m: PagedEngine(m, PagedEngineConfig(num_blocks=128, overlap_steps=True)), id="overlapped"),
])


@ENGINES
def test_ignore_eos_runs_to_max_tokens_and_min_tokens_holds_eos_back(demo_model, make):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(901)))
    (plain, fin_plain), (ignored, fin_ignored), (held, fin_held), (both, fin_both) = run_all(make(demo_model), [
        (prompt, SamplingParams(max_tokens=40, temperature=0)),
        (prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
        (prompt, SamplingParams(max_tokens=40, temperature=0, min_tokens=20)),
        (prompt, SamplingParams(max_tokens=25, temperature=0, min_tokens=25, ignore_eos=True)),
    ])
    # The demo model's caption ends well before 20 tokens with an end-of-sequence token.
    assert fin_plain.finish_reason == "stop" and fin_plain.completion_tokens < 20
    eos = demo_model.eos_token_ids
    # ignore_eos: the EOS token is generated and the answer goes on to max_tokens.
    assert fin_ignored.finish_reason == "length" and fin_ignored.completion_tokens == 40
    assert ignored[:len(plain)] == plain and any(t in eos for t in ignored)
    # min_tokens: no EOS among the first 20 tokens; the answer may then end.
    assert fin_held.completion_tokens >= 20
    assert not any(t in eos for t in held[:20])
    assert fin_both.finish_reason == "length" and fin_both.completion_tokens == 25


@ENGINES
def test_min_tokens_defers_stop_strings(demo_model, make):
    prompt = prompt_for(demo_model, scenes.render(fresh_scene(902)))
    (_, plain), (_, early), (_, deferred) = run_all(make(demo_model), [
        (prompt, SamplingParams(max_tokens=40, temperature=0)),
        (prompt, SamplingParams(max_tokens=40, temperature=0, stop=["a"])),
        (prompt, SamplingParams(max_tokens=40, temperature=0, stop=["a"], min_tokens=3)),
    ])
    assert plain.text.startswith("a ") and early.text == "" and early.completion_tokens == 1
    # The first two tokens' "a"s are not stops; from the third token on the answer ends at the
    # next "a" of the caption.
    cut = len(deferred.text)
    assert deferred.completion_tokens >= 3 and cut > 2
    assert plain.text[:cut] == deferred.text and plain.text[cut] == "a"


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
