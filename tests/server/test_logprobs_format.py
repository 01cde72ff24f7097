"""Log-probability entries in the OpenAI shapes (serve/logprobs_format.py), without a server."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fovea.engine.core.request import TokenLogprob
from fovea.serve.logprobs_format import LogprobFormatter


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (as Qwen's and Llama 3's) that knows no multi-byte character."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(["hello world"] * 3, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_partial_characters_carry_their_real_bytes(byte_level):
    ids = byte_level.encode("é€ ok")
    content = LogprobFormatter(byte_level, "chat").format([TokenLogprob(i, -0.5, [(i, -0.5)]) for i in ids])["content"]
    assert "\ufffd" in content[0]["token"]  # one byte of "é" alone is no character ...
    assert bytes(b for e in content for b in e["bytes"]).decode() == "é€ ok"  # ... but the bytes join up
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


def test_legacy_offsets_run_on_across_stream_chunks(byte_level):
    ids = byte_level.encode("hello world")
    whole = LogprobFormatter(byte_level, "text").format([TokenLogprob(i, -1.0, []) for i in ids])
    streamed = LogprobFormatter(byte_level, "text")
    offsets = [streamed.format([TokenLogprob(i, -1.0, [])])["text_offset"][0] for i in ids]
    assert offsets == whole["text_offset"] == [sum(map(len, whole["tokens"][:k])) for k in range(len(ids))]
    assert "".join(whole["tokens"]) == "hello world"
    assert all(top == {tok: -1.0} for tok, top in zip(whole["tokens"], whole["top_logprobs"]))  # the sampled token
