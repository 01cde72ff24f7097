"""`fovea doctor`'s engine.reference check fails when the engine and transformers disagree."""

from __future__ import annotations

from fovea.engine import PagedEngine, PagedEngineConfig, reference
from fovea.guard.checks import Status
from fovea.guard.doctor import reference_check


def test_the_check_passes_on_agreement_and_fails_on_disagreement(demo_model, monkeypatch):
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=64))
    assert reference_check(demo_model, engine).status is Status.PASS
    real = reference.reference_logits
    monkeypatch.setattr(reference, "reference_logits", lambda model, prompt: real(model, prompt).flip(0))
    failed = reference_check(demo_model, PagedEngine(demo_model, PagedEngineConfig(num_blocks=64)))
    assert failed.status is Status.FAIL and "disagree" in failed.remedy
