"""Which vision forward runs (``fovea.engine.vision.vision_stage``): chosen by the adapter's declared
capability (``ModelAdapter.fused_vision``), never by a family's name, the same way in the
engine's model runner and in the encode worker, and back to transformers' modules, with the
reason in the label, when the fused stage is off, cannot run here or fails its start-up check."""

import functools
import logging
import re
from pathlib import Path

import pytest
import torch

import fovea
from fovea.disagg.encode_worker import vision_stage
from fovea.engine.vision import vision_fused
from fovea.engine.vision import vision_stage as stages
from fovea.engine.vision.qwen_vision_fused import QwenFusedVision
from fovea.engine.vision.vision_stage import FUSED_STAGES, choose_vision_stage
from fovea.loading.loader import load_model
from fovea.models.clip_vision import encode_images
from fovea.models.llava_next import LlavaNextAdapter
from fovea.testing import random_qwen2_5_vl, random_qwen3_vl
from fovea.testing.kernel_cases import random_llava, tiny_vision

SRC = Path(fovea.__file__).parent


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage")
    return {"qwen2_5_vl": random_qwen2_5_vl.write_model_dir(root / "q25", arch="tiny", seed=2),
            "qwen3_vl": random_qwen3_vl.write_model_dir(root / "q3", arch="tiny", seed=2)}


@pytest.fixture(scope="module")
def llava():
    return random_llava(tiny_vision("quick_gelu"), 64, "cpu", torch.float32)


def test_no_file_outside_models_branches_on_a_family_name():
    """Families differ only inside ``fovea/models``: elsewhere a capability is asked for."""
    literal = r"""(['"][\w.-]*['"])"""
    name = r"family\.name"
    pattern = re.compile(rf"{name}\s*(==|!=)\s*{literal}|{literal}\s*(==|!=)\s*[\w.]*{name}|{name}\s+(not\s+)?in\s*[(\[{{]")
    offenders = []
    for path in SRC.rglob("*.py"):
        if (SRC / "models") in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    assert pattern.search('    elif loaded.adapter.family.name == "llava":')  # the check can fail
    assert pattern.search("if 'qwen3_vl' != adapter.family.name:")
    assert pattern.search('if part.adapter.family.name in ("llava", "qwen2_5_vl"):')
    assert not pattern.search('log.info("family %s", loaded.adapter.family.name)')


def test_each_declared_stage_is_registered():
    from fovea.models import ModelAdapter

    declared = {cls.fused_vision for cls in _subclasses(ModelAdapter)} - {None}
    assert declared == {"clip", "qwen2_5_vit", "qwen3_vit"} and declared <= set(FUSED_STAGES)
    assert LlavaNextAdapter.fused_vision is None  # inherits LLaVA's adapter, not its fixed-size stage


def _subclasses(cls):
    import fovea.models  # noqa: F401 - registers every adapter

    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_llava_gets_the_clip_stage_and_its_batched_forward(llava, monkeypatch):
    stage = choose_vision_stage(llava, enabled=True)
    assert "not CUDA" in stage.label  # this CPU: transformers' modules, still batched for graphs
    assert isinstance(stage.batched, functools.partial) and stage.batched.func is encode_images
    assert stage.forward.batched is stage.batched
    assert "not enabled" in choose_vision_stage(llava, enabled=False).label
    chosen = []
    monkeypatch.setitem(FUSED_STAGES, "clip", lambda loaded, enabled: chosen.append(enabled) or stage)
    assert choose_vision_stage(llava, enabled=True) is stage and chosen == [True]


def test_a_fovea_vlm_declares_no_fused_stage(tmp_path):
    """The custom VLM described by its config alone (``fovea_vlm``) runs its adapter's forward.
    (The shipped demo model is a LLaVA: it gets the CLIP stage, as before.)"""
    from fovea.testing.random_fovea_vlm import write_model_dir

    loaded = load_model(write_model_dir(tmp_path / "vlm", arch="tiny"), "cpu", "float32")
    assert loaded.adapter.fused_vision is None
    stage = choose_vision_stage(loaded, enabled=True)
    assert stage.batched is None and "declares no fused vision stage" in stage.label
    shape = loaded.adapter.fixed_image_shape(loaded.model.config)
    pixels = torch.randn(2, *shape)
    rows = stage.forward([type("Image", (), {"pixels": p})() for p in pixels])
    assert torch.equal(torch.stack(rows), loaded.adapter.vision_forward(loaded).batched(pixels))


def test_the_demo_model_keeps_the_clip_stage(demo_model):
    assert demo_model.adapter.fused_vision == "clip"
    stage = choose_vision_stage(demo_model, enabled=False)
    assert stage.batched.func is encode_images and stage.forward.batched is stage.batched


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_gets_the_fused_qwen_stage_where_it_runs(qwen_dirs, family, monkeypatch):
    loaded = load_model(qwen_dirs[family], "cpu", "float32")
    stage = choose_vision_stage(loaded, enabled=True)
    assert "not CUDA" in stage.label and not isinstance(stage.forward, QwenFusedVision) and stage.batched is None
    assert "not enabled" in choose_vision_stage(loaded, enabled=False).label
    monkeypatch.setattr(vision_fused, "platform_problem", lambda loaded: None)  # as on a GPU with triton
    stage = choose_vision_stage(loaded, enabled=True)
    assert isinstance(stage.forward, QwenFusedVision) and stage.label.startswith("fused")
    assert stage.forward.kind == loaded.adapter.fused_vision and stage.batched is None


def test_a_broken_fused_stage_falls_back_with_the_reason(qwen_dirs, monkeypatch, caplog):
    loaded = load_model(qwen_dirs["qwen2_5_vl"], "cpu", "float32")
    monkeypatch.setattr(vision_fused, "platform_problem", lambda loaded: None)
    real = QwenFusedVision.__call__
    monkeypatch.setattr(QwenFusedVision, "__call__", lambda self, images: [r * 1.5 for r in real(self, images)])
    with caplog.at_level(logging.WARNING, logger="fovea.engine"):
        stage = choose_vision_stage(loaded, enabled=True)
    assert not isinstance(stage.forward, QwenFusedVision)
    assert stage.label.startswith("transformers' modules") and "relative error" in stage.label
    assert "relative error" in caplog.text
    monkeypatch.setattr(QwenFusedVision, "__call__", lambda self, images: 1 / 0)
    assert "ZeroDivisionError" in choose_vision_stage(loaded, enabled=True).label


def test_an_unknown_declared_stage_is_an_error(llava, monkeypatch):
    monkeypatch.setattr(type(llava.adapter), "fused_vision", "nonesuch")
    with pytest.raises(ValueError, match="nonesuch"):
        choose_vision_stage(llava, enabled=True)


def test_the_encode_worker_uses_the_same_chooser(qwen_dirs, monkeypatch):
    """An encode worker's vision part (the tower alone, in a shell model) runs the fused stage too."""
    from fovea.loading.vision_part import load_vision_part

    part = load_vision_part(qwen_dirs["qwen3_vl"], "cpu", "float32")
    forward, label = vision_stage(part, fused=False)
    assert "not enabled" in label
    monkeypatch.setattr(vision_fused, "platform_problem", lambda loaded: None)
    calls = []
    real = stages.choose_vision_stage

    def spy(loaded, enabled):
        calls.append(enabled)
        return real(loaded, enabled)

    monkeypatch.setattr(stages, "choose_vision_stage", spy)
    forward, label = vision_stage(part, fused=True)
    assert calls == [True] and isinstance(forward, QwenFusedVision) and label.startswith("fused")
