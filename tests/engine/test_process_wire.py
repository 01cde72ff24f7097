"""What crosses between the API process and the engine core (``fovea.engine.process.wire``):
pixels through one shared-memory file per request, and compiled grammars in serialised form."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fovea.engine.process.wire import (
    PIXEL_DIR,
    PIXEL_PREFIX,
    GrammarReader,
    WireGrammar,
    dumps,
    loads,
    params_out,
    pixels_in,
    pixels_out,
    remove_orphans,
)
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.prompt import EncodedPrompt
from fovea.models.base import ImageInput

OWNER = f"test{os.getpid()}"


def prompt_with(*pixels: torch.Tensor) -> EncodedPrompt:
    images = [ImageInput(p, 4, f"hash-{i}", (1, 2, 2)) for i, p in enumerate(pixels)]
    return EncodedPrompt(input_ids=[1, 2, 3], images=images, prompt_text="x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_pixels_cross_exactly_and_the_file_is_gone_once_read(dtype):
    generator = torch.Generator().manual_seed(0)
    originals = [(torch.randn(*shape, generator=generator) * 50).to(dtype)
                 for shape in [(3, 5, 7), (11, 13), (1,), (2, 3, 4, 5)]]  # odd byte counts: offsets realigned
    stub, path = pixels_out(prompt_with(*originals), OWNER)
    assert path is not None and os.path.exists(path)
    assert all(not isinstance(image.pixels, torch.Tensor) for image in stub.images)
    message = loads(dumps(("submit", stub, path)))  # what the socket carries: no pixel bytes
    assert len(dumps(stub)) < 2000
    back = pixels_in(message[1], message[2])
    assert not os.path.exists(path)
    for original, image in zip(originals, back.images, strict=True):
        assert image.pixels.dtype == dtype and image.pixels.shape == original.shape
        assert torch.equal(image.pixels, original)
    assert [i.hash for i in back.images] == [i.hash for i in prompt_with(*originals).images]


def test_a_prompt_without_images_writes_no_file():
    prompt = EncodedPrompt(input_ids=[5, 6], images=[], prompt_text="x")
    stub, path = pixels_out(prompt, OWNER)
    assert path is None and stub is prompt and pixels_in(stub, None) is prompt


def test_the_pixels_survive_their_file_being_removed():
    """The core maps the file and removes its name at once; the tensors must keep their values."""
    original = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    stub, path = pixels_out(prompt_with(original), OWNER)
    back = pixels_in(stub, path)
    assert not os.path.exists(path)
    back.images[0].pixels.add_(0)  # touch every page
    assert torch.equal(back.images[0].pixels, original)


def test_orphans_of_a_dead_core_are_removed():
    _, path = pixels_out(prompt_with(torch.ones(8, 8)), OWNER)
    stray = [p for p in PIXEL_DIR.glob(f"{PIXEL_PREFIX}{OWNER}-*")]
    assert path in {str(p) for p in stray}
    assert remove_orphans(OWNER) == len(stray) >= 1
    assert not os.path.exists(path)


def test_a_compiled_grammar_crosses_serialised_and_constrains_alike(demo_model):
    import xgrammar as xgr

    from fovea.engine.structured.compiler import GrammarCompiler
    from fovea.engine.structured.matcher import GrammarState
    from fovea.engine.structured.spec import GrammarSpec

    eos = sorted(t for t in demo_model.eos_token_ids if isinstance(t, int) and t >= 0)
    vocab = int(demo_model.model.get_output_embeddings().weight.shape[0])
    compiler = GrammarCompiler(demo_model.tokenizer, vocab, eos)
    try:
        grammar = compiler.get_now(GrammarSpec("regex", "(one|two|three)", "structured_outputs.regex"))
    finally:
        compiler.close()
    params = SamplingParams(max_tokens=4, grammar=grammar)
    wire = params_out(params)
    assert isinstance(wire.grammar, WireGrammar) and wire.grammar.vocab_size == vocab
    back = GrammarReader(demo_model.tokenizer, eos).params_in(loads(dumps(wire)))
    assert dataclasses.replace(back, grammar=None) == dataclasses.replace(params, grammar=None)
    assert back.grammar.dead_ends == grammar.dead_ends

    def first_mask(g) -> torch.Tensor:
        mask = torch.full(xgr.get_bitmask_shape(1, vocab), -1, dtype=torch.int32)
        GrammarState(g).fill(mask, 0)
        return mask

    assert torch.equal(first_mask(back.grammar), first_mask(grammar))  # the same tokens allowed first
    assert not torch.equal(first_mask(back.grammar), torch.full_like(first_mask(grammar), -1))  # and it constrains
    two = demo_model.tokenizer.convert_tokens_to_ids("two")
    ours, theirs = GrammarState(back.grammar), GrammarState(grammar)
    ours.accept(two)
    theirs.accept(two)
    ours.accept(eos[0])
    theirs.accept(eos[0])
    assert ours.terminated and theirs.terminated


def test_a_full_shared_memory_falls_back_to_the_temp_directory(monkeypatch, tmp_path):
    import fovea.engine.process.wire as wire

    real_open = open

    def full(path, *args, **kwargs):
        if str(path).startswith(str(wire.PIXEL_DIR / wire.PIXEL_PREFIX)):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(wire, "FALLBACK_DIR", tmp_path)
    monkeypatch.setattr("builtins.open", full)
    original = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    stub, path = pixels_out(prompt_with(original), OWNER)
    assert path.startswith(str(tmp_path))
    assert torch.equal(pixels_in(stub, path).images[0].pixels, original) and not os.path.exists(path)
