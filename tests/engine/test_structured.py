"""Structured outputs inside the engine: masks, padding rows, the overlapped step, the grammar cache."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr
from PIL import Image

from fovea.engine.config import PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, FinishEvent, TokenEvent
from fovea.engine.engine import PagedEngine
from fovea.engine.sampling.params import SamplingParams
from fovea.engine.structured.bitmask import apply_grammar_masks_
from fovea.engine.structured.compiler import Grammar, GrammarCompiler
from fovea.engine.structured.matcher import GrammarState
from fovea.engine.structured.spec import GrammarSpec, StructuredOutputError
from fovea.loading.loader import load_model
from fovea.testing.byte_level_model import write_model_dir

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 99}},
          "required": ["kind", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_model_dir(tmp_path_factory.mktemp("bq")), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def compiler(model):
    rows = model.model.get_output_embeddings().weight.shape[0]
    return GrammarCompiler(model.tokenizer, rows, sorted(model.eos_token_ids), capacity=2)


def prompt(model, text: str, image: bool = True):
    rendered = model.codec.render([{"role": "user", "content": ([{"type": "image"}] if image else [])
                                    + [{"type": "text", "text": text}]}])
    return model.codec.encode(rendered, [Image.new("RGB", (56, 56), (10, 200, 10))] if image else [])


async def run(engine, p, params, steps_seen: list[int] | None = None):
    """Generate; with steps_seen, also note the engine's step count as each token arrives."""
    tokens = []
    async for event in engine.generate(p, params):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            tokens.append(event.token_id)
            if steps_seen is not None:
                steps_seen.append(engine.steps)
        elif isinstance(event, FinishEvent):
            return tokens, event
        elif isinstance(event, ErrorEvent):
            return tokens, event.error


def test_padding_rows_are_always_masked(model, compiler):
    """The LM head has rows past the tokenizer's vocabulary: no grammar may pick them."""
    vocab = compiler.vocab_size
    assert vocab > len(model.tokenizer)
    state = GrammarState(compiler.get_now(GrammarSpec.json_schema(SCHEMA, "s")))
    for text in ['{"kind": "', 'cat", "n": ', "7"]:
        logits = torch.zeros(2, vocab)

        class Row:
            grammar, request = state, None
        apply_grammar_masks_(logits, [type("Free", (), {"grammar": None})(), Row()])
        assert torch.isinf(logits[1, len(model.tokenizer):]).all()  # padding rows masked
        assert not torch.isinf(logits[0]).any()  # the free-text row is untouched
        for token in model.tokenizer.encode(text, add_special_tokens=False):
            state.accept(token)


def test_cache_compiles_once_off_the_caller_and_evicts(compiler):
    threads: list[str] = []
    original = compiler._compile_source

    def spy(spec):
        threads.append(threading.current_thread().name)
        return original(spec)

    compiler._compile_source = spy
    try:
        specs = [GrammarSpec("regex", f"[a-c]{{{i}}}", "r") for i in (2, 3, 4)]

        async def twice():
            return await asyncio.gather(compiler.get(specs[0]), compiler.get(specs[0]))

        first, second = asyncio.run(twice())
        assert first is second and len(threads) == 1 and threads[0].startswith("fovea-grammar")
        for spec in specs[1:]:
            compiler.get_now(spec)
        assert compiler.get_now(specs[2]) is compiler.get_now(specs[2]) and len(threads) == 3
        compiler.get_now(specs[0])  # evicted by the two after it (capacity 2): compiled again
        assert len(threads) == 4
    finally:
        compiler._compile_source = original


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_mixed_batch(model, compiler, overlap):
    """Structured rows in one batch with free-text rows that answer exactly as alone; with the
    step queued ahead, sampling waits for the in-flight tokens the structured rows' masks need."""
    engine = PagedEngine(model, PagedEngineConfig(num_blocks=256, overlap_steps=overlap))
    engine.start()
    try:
        grammar = compiler.get_now(GrammarSpec.json_schema(SCHEMA, "s"))
        free = [prompt(model, w, image=i == 0) for i, w in enumerate(["one", "two two"])]
        alone = [asyncio.run(run(engine, p, SamplingParams(max_tokens=12, temperature=0)))[0] for p in free]

        async def together():
            jobs = [run(engine, p, SamplingParams(max_tokens=12, temperature=0)) for p in free]
            jobs += [run(engine, prompt(model, f"q{i}"), SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                                         grammar=grammar)) for i in range(3)]
            return await asyncio.gather(*jobs)

        results = asyncio.run(together())
        assert [tokens for tokens, _ in results[:2]] == alone
        assert (engine.structured_waits > 0) == overlap  # waited only when a token was in flight
        for _, finish in results[2:]:
            assert isinstance(finish, FinishEvent) and finish.finish_reason == "stop", finish
            jsonschema.validate(json.loads(finish.text), SCHEMA)
    finally:
        engine.stop()


def test_structured_row_decodes_every_step_when_overlapped(model, compiler):
    """With the step queued ahead, a structured row still takes a token in every step (its mask is
    filled once the in-flight token lands, behind the next forward): beside a free row of the same
    length both finish in the same steps, and a penalised row ending early gives its slot back."""
    engine = PagedEngine(model, PagedEngineConfig(num_blocks=256, overlap_steps=True))
    engine.start()
    try:
        grammar = compiler.get_now(GrammarSpec("regex", "[a-z]+", "t"))
        choice = compiler.get_now(GrammarSpec.choice(["ab"], "t"))
        tokens = 16
        fixed = {"max_tokens": tokens, "min_tokens": tokens, "temperature": 1.0}

        async def together():
            return await asyncio.gather(
                run(engine, prompt(model, "free", image=False), SamplingParams(**fixed, seed=1)),
                run(engine, prompt(model, "shaped", image=False), SamplingParams(**fixed, seed=2, grammar=grammar),
                    shaped_steps),
                # Its grammar ends it while the next step, with a row for it, is already queued.
                run(engine, prompt(model, "ends", image=False),
                    SamplingParams(max_tokens=20, temperature=1.0, seed=3, grammar=choice, presence_penalty=1.0)))

        shaped_steps: list[int] = []
        (free, _), (shaped, finish), (_, short) = asyncio.run(together())
        assert len(free) == len(shaped) == tokens and isinstance(finish, FinishEvent)
        assert re.fullmatch("[a-z]+", finish.text), finish.text
        assert isinstance(short, FinishEvent) and (short.finish_reason, short.text) == ("stop", "ab")
        # One token a step from the shaped row's first token to its last: sitting out every other
        # step would take ~2x. Counted from its own first token, not from submission, so that the
        # three requests reaching the engine in different steps (a busy CPU) does not count.
        assert shaped_steps[-1] - shaped_steps[0] <= tokens + 2, shaped_steps
        assert engine.structured_waits > 0
        assert not engine.token_counts.slot_of  # every penalised sequence gave its slot back
    finally:
        engine.stop()


def test_json_object_ends(tmp_path):
    """With every logit equal, greedy takes the lowest allowed id (the closers): the object ends."""
    flat = load_model(write_model_dir(tmp_path / "flat", flat_logits=True), device="cpu", dtype="float32")
    rows = flat.model.get_output_embeddings().weight.shape[0]
    grammars = GrammarCompiler(flat.tokenizer, rows, sorted(flat.eos_token_ids))
    engine = PagedEngine(flat, PagedEngineConfig(num_blocks=64))
    engine.start()
    try:
        params = SamplingParams(max_tokens=40, temperature=0, grammar=grammars.get_now(GrammarSpec("json_object", "",
                                                                                                   "r")))
        _, finish = asyncio.run(run(engine, prompt(flat, "x"), params))
        assert finish.finish_reason == "stop" and isinstance(json.loads(finish.text), dict), finish.text
    finally:
        engine.stop()


def test_a_dead_end_fails_only_its_request(demo_model):
    """A row whose mask is left empty (a dead-end search that ran out of steps, here switched off
    for a grammar the demo's words can begin, "red", but not finish: no space token) fails that
    request alone with structured_output_failed; a free-text one beside it is answered."""
    rows = demo_model.model.get_output_embeddings().weight.shape[0]
    grammars = GrammarCompiler(demo_model.tokenizer, rows, sorted(demo_model.eos_token_ids))
    unchecked = Grammar(grammars._compile_source(GrammarSpec.choice(["red circle"], "c")), rows, dead_ends=False)
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=64))
    engine.start()
    try:
        text = demo_model.codec.render([{"role": "user", "content": "how many shapes are there ?"}])
        p = demo_model.codec.encode(text, [])
        dead = SamplingParams(max_tokens=8, temperature=0, grammar=unchecked)

        async def both():
            return await asyncio.gather(run(engine, p, dead), run(engine, p, SamplingParams(max_tokens=8,
                                                                                             temperature=0)))

        (_, error), (_, finish) = asyncio.run(both())
        assert isinstance(error, StructuredOutputError) and error.code == "structured_output_failed"
        assert isinstance(finish, FinishEvent) and finish.completion_tokens > 0
    finally:
        engine.stop()


def test_bitmask_shape_matches_xgrammar():
    assert xgr.get_bitmask_shape(3, 1016) == (3, 32)


def test_a_compile_done_before_its_callback_does_not_deadlock(compiler, monkeypatch):
    """A compilation that finishes before ``add_done_callback`` runs its callback in the caller,
    under the cache's lock (this deadlocked with a plain Lock)."""
    done = concurrent.futures.Future()
    done.set_result("compiled")
    monkeypatch.setattr(compiler._pool, "submit", lambda *args: done)
    spec = GrammarSpec("regex", "z{7}", "r")
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(compiler._future(spec).result()), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert outcome == ["compiled"] and compiler._lru[spec.key] == "compiled"


def test_device_path_masks_only_its_rows(model, compiler):
    """The CUDA path's staging (indices and compact masks into a batch-sized mask), run on CPU."""
    from fovea.engine.structured.bitmask import apply_staged_

    state = GrammarState(compiler.get_now(GrammarSpec("regex", "[0-9]+", "r")))
    compact = torch.full(xgr.get_bitmask_shape(1, compiler.vocab_size), -1, dtype=torch.int32)
    state.fill(compact, 0)
    logits = torch.zeros(3, compiler.vocab_size)
    apply_staged_(logits, compact, [2])
    allowed = (~torch.isinf(logits[2])).nonzero().flatten().tolist()
    assert allowed == sorted(model.tokenizer.convert_tokens_to_ids(list("0123456789")))  # the digit bytes
    assert not torch.isinf(logits[:2]).any()  # the other rows are untouched


def test_many_rows_fill_in_parallel_as_one_by_one(model, compiler):
    """From PARALLEL_FILL_ROWS rows on, xgrammar's batch fill: the same masks as row by row."""
    from fovea.engine.structured import bitmask

    grammar = compiler.get_now(GrammarSpec.json_schema(SCHEMA, "s"))
    states = [GrammarState(grammar) for _ in range(bitmask.PARALLEL_FILL_ROWS + 2)]
    for i, state in enumerate(states):  # each at a different point of its answer
        for token in model.tokenizer.encode('{"kind": "cat", "n": 4'[:i + 1], add_special_tokens=False):
            state.accept(token)
    shape = xgr.get_bitmask_shape(len(states), compiler.vocab_size)
    serial, parallel = torch.full(shape, -1, dtype=torch.int32), torch.full(shape, -1, dtype=torch.int32)
    for k, state in enumerate(states):
        state.fill(serial, k)
    bitmask.fill_masks(states, parallel)
    assert torch.equal(serial, parallel) and len({tuple(r.tolist()) for r in serial}) > 5


def test_a_tokenizer_larger_than_the_lm_head_turns_structured_outputs_off(model, caplog):
    from fovea.serve.structured import build_grammar_compiler

    assert build_grammar_compiler(model, len(model.tokenizer) - 1) is None
    assert "structured outputs are off" in caplog.text


def test_length_bounded_strings_are_json(model, compiler):
    """xgrammar 0.2.9 lets raw control characters into length-bounded strings; the schema is
    rewritten so every answer parses (json.loads refuses them) and still validates."""
    schema = {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 6},
                                               "ids": {"type": "array", "items": {"type": "string", "minLength": 1,
                                                                                  "maxLength": 3}, "maxItems": 3}},
              "required": ["tag", "ids"], "additionalProperties": False}
    grammar = compiler.get_now(GrammarSpec.json_schema(schema, "s"))
    engine = PagedEngine(model, PagedEngineConfig(num_blocks=256))
    engine.start()
    try:
        async def all_of():
            return await asyncio.gather(*(run(engine, prompt(model, f"t{i}", image=False), SamplingParams(
                max_tokens=80, temperature=1.0, seed=i, grammar=grammar)) for i in range(6)))

        for _, finish in asyncio.run(all_of()):
            assert finish.finish_reason == "stop"
            jsonschema.validate(json.loads(finish.text), schema)
    finally:
        engine.stop()


def test_device_path_falls_back_to_torch_when_triton_fails(model, compiler, monkeypatch):
    from fovea.engine.structured import bitmask

    real = xgr.apply_token_bitmask_inplace

    def triton_broken(*args, backend="auto", **kwargs):
        if backend == "auto":
            raise RuntimeError("triton: no compiler here")
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(bitmask.xgr, "apply_token_bitmask_inplace", triton_broken)
    monkeypatch.setattr(bitmask, "_device_backend", "auto")
    state = GrammarState(compiler.get_now(GrammarSpec("regex", "[0-9]+", "r")))
    compact = torch.full(xgr.get_bitmask_shape(1, compiler.vocab_size), -1, dtype=torch.int32)
    state.fill(compact, 0)
    logits = torch.zeros(2, compiler.vocab_size)
    bitmask.apply_staged_(logits, compact, [1])
    assert bitmask._device_backend == "torch_native"
    assert (~torch.isinf(logits[1])).nonzero().flatten().tolist() == sorted(
        model.tokenizer.convert_tokens_to_ids(list("0123456789")))
