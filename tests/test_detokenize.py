"""Incremental detokenisation: the streamed pieces add up to the full decode."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fovea.engine.core.detokenize import IncrementalDetokenizer

TEXTS = ["The café on the corner serves crème brûlée.", "Zürich → Genève: 2½ hours 🚆🚆!",
         "漢字とかなの混じった文。", "  spaces   and\nnew lines\tand tabs ", "emoji 👩‍👩‍👧 family, ok"]


@pytest.fixture(scope="module")
def byte_bpe():
    """A small byte-level BPE (GPT-2 style): multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def stream(tokenizer, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, list(stop))
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_full_decode(byte_bpe, text):
    ids = byte_bpe(text, add_special_tokens=False)["input_ids"]
    pieces, detok = stream(byte_bpe, ids)
    assert "".join(pieces) == byte_bpe.decode(ids) == text
    assert detok.text == text
    assert all("\ufffd" not in p for p in pieces)  # incomplete characters are never streamed


def test_random_token_splits_of_valid_text(byte_bpe):
    """Ids of several texts glued together (so token boundaries fall anywhere)."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [i for t in rng.sample(TEXTS, 3) for i in byte_bpe(t, add_special_tokens=False)["input_ids"]]
        pieces, _ = stream(byte_bpe, ids)
        assert "".join(pieces) == byte_bpe.decode(ids)


def test_special_tokens_are_skipped_and_stop_strings_cut(byte_bpe):
    eos = byte_bpe.convert_tokens_to_ids("<eos>")
    ids = byte_bpe("crème brûlée", add_special_tokens=False)["input_ids"]
    pieces, _ = stream(byte_bpe, ids[:3] + [eos] + ids[3:])
    assert "".join(pieces) == "crème brûlée"
    pieces, detok = stream(byte_bpe, byte_bpe("The café on the corner", add_special_tokens=False)["input_ids"],
                           stop=["on the"])
    assert "".join(pieces) == "The café " and detok.stopped


def test_an_unfinished_character_is_flushed_at_the_end(byte_bpe):
    ids = byte_bpe("ok 🚆", add_special_tokens=False)["input_ids"]
    cut = ids[:-1]  # the emoji's last byte(s) never arrive
    pieces, _ = stream(byte_bpe, cut)
    assert "".join(pieces) == byte_bpe.decode(cut)  # ends in U+FFFD, as the full decode does


def test_the_work_per_token_does_not_grow_with_the_output(byte_bpe):
    """Each push decodes a short window, not everything generated so far."""
    decoded_lengths = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded_lengths.append(len(ids))
            return byte_bpe.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = byte_bpe(" ".join(TEXTS) * 10, add_special_tokens=False)["input_ids"]
    pieces, _ = stream(Counting(), ids)
    assert "".join(pieces) == byte_bpe.decode(ids)
    assert len(ids) > 300 and max(decoded_lengths) <= 8
