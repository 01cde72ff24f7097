"""Tokens a grammar allows but the vocabulary cannot finish (engine/structured/dead_ends.py).

The demo's word-level vocabulary has "on" and "one" but no "e" and no space: xgrammar allows
"on" for the choice "one", and "a" for "a red circle", after which no token can go on.
"""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from fovea.engine.structured import dead_ends
from fovea.engine.structured.compiler import GrammarCompiler, GrammarRefused
from fovea.engine.structured.matcher import GrammarState
from fovea.engine.structured.spec import GrammarSpec


@pytest.fixture(scope="module")
def words(demo_model) -> GrammarCompiler:
    rows = demo_model.model.get_output_embeddings().weight.shape[0]
    return GrammarCompiler(demo_model.tokenizer, rows, sorted(demo_model.eos_token_ids))


def first_mask(compiler: GrammarCompiler, choices: list[str]) -> set[str]:
    """The words the first step of a choice may take, as the engine's masks fill it."""
    return allowed_now(compiler, compiler.get_now(GrammarSpec.choice(choices, "c")), [])


def test_only_word_level_vocabularies_are_checked(words, tmp_path):
    from transformers import AutoTokenizer

    from fovea.testing.byte_level_model import write_model_dir

    assert words.dead_ends  # no token for most single bytes
    byte = AutoTokenizer.from_pretrained(write_model_dir(tmp_path / "byte"))
    assert not GrammarCompiler(byte, len(byte), [byte.eos_token_id]).dead_ends  # every byte is a token


def test_a_word_that_only_begins_an_answer_is_masked(words):
    assert first_mask(words, ["one", "two", "three"]) == {"one", "two", "three"}  # "on" is gone
    assert first_mask(words, ["a red circle", "one"]) == {"one"}  # "a" cannot go on ("red" has no space)
    assert first_mask(words, ["red", "blue"]) == {"red", "blue"}


def token_id(compiler: GrammarCompiler, word: str) -> int:
    return compiler.info.decoded_vocab.index(word.encode())


def allowed_now(compiler: GrammarCompiler, grammar, tokens: list[str]) -> set[str]:
    """The words a structured row may take after ``tokens``."""
    state = GrammarState(grammar)
    for token in tokens:
        state.accept(token_id(compiler, token))
    mask = torch.full(xgr.get_bitmask_shape(1, compiler.vocab_size), -1, dtype=torch.int32)
    state.fill(mask, 0)
    return {compiler.info.decoded_vocab[t].decode() for t in dead_ends.allowed_tokens(mask[0], compiler.vocab_size)}


def test_the_search_looks_several_words_ahead(words):
    """"on" finishes only as on-two-...-three: found two words ahead; "one" cannot be finished
    after "on" ("e" is no word); the matcher is left where it was."""
    grammar = words.get_now(GrammarSpec("regex", "(on|one)(two)+three|one", "r"))
    assert allowed_now(words, grammar, []) == {"on", "one"}
    assert allowed_now(words, grammar, ["on"]) == {"two"}
    matcher = xgr.GrammarMatcher(grammar.compiled)
    assert matcher.accept_token(token_id(words, "on"))
    assert dead_ends.can_finish(matcher, words.vocab_size, dead_ends.Budget()) is True
    assert matcher.accept_token(token_id(words, "two"))  # rolled back: "two" comes next
    stuck = xgr.GrammarMatcher(words.get_now(GrammarSpec("regex", "(one)(two)+three", "r")).compiled)
    assert stuck.accept_token(token_id(words, "on"))  # xgrammar allows it...
    assert dead_ends.can_finish(stuck, words.vocab_size, dead_ends.Budget()) is False  # ...but it is a dead end


def test_a_search_that_runs_out_keeps_the_token(words, monkeypatch):
    """Unknown is not dead: past the budget (or over a wide mask) the token stays allowed."""
    monkeypatch.setattr(dead_ends, "SEARCH_STEPS", 0)
    assert "on" in first_mask(words, ["one", "two", "three"])
    monkeypatch.setattr(dead_ends, "SEARCH_STEPS", 4096)
    monkeypatch.setattr(dead_ends, "MAX_CHECKED", 3)
    assert "on" in first_mask(words, ["one", "two", "three"])  # four allowed: not checked


def test_a_grammar_no_words_can_finish_is_refused_at_compile(words):
    with pytest.raises(GrammarRefused) as refused:
        words.get_now(GrammarSpec.choice(["red circle"], "structured_outputs.choice"))
    assert refused.value.code == "grammar_unsatisfiable" and refused.value.param == "structured_outputs.choice"


@pytest.mark.parametrize("bit", range(32))
def test_clearing_one_bit_of_an_int32_row(bit):
    row = torch.full((2,), -1, dtype=torch.int32)
    row[1] &= dead_ends._cleared(bit)
    assert dead_ends.allowed_tokens(row, 64) == [t for t in range(64) if t != 32 + bit]


def test_many_rows_filled_in_parallel_drop_dead_ends_too(words):
    """From PARALLEL_FILL_ROWS rows on, xgrammar's batch fill, then the same check on each row."""
    from fovea.engine.structured import bitmask

    grammar = words.get_now(GrammarSpec.choice(["one", "two", "three"], "c"))
    states = [GrammarState(grammar) for _ in range(bitmask.PARALLEL_FILL_ROWS + 2)]
    compact = torch.full(xgr.get_bitmask_shape(len(states), words.vocab_size), -1, dtype=torch.int32)
    bitmask.fill_masks(states, compact)
    for row in compact:
        assert {words.info.decoded_vocab[t].decode() for t in dead_ends.allowed_tokens(row, words.vocab_size)} == {
            "one", "two", "three"}
