"""The demo model's training loop (tiny sizes, CPU) and its held-out evaluation."""

import json

import torch

from fovea.demo import scenes
from fovea.demo.build import DemoArchitecture
from fovea.demo.evaluate import evaluate
from fovea.demo.train import TrainConfig, lr_at, train

TINY = DemoArchitecture(image_size=64, patch_size=16, vision_hidden=32, vision_layers=1, vision_heads=2,
                        vision_intermediate=64, text_hidden=32, text_layers=1, text_heads=2, text_intermediate=64)


def tiny_config(tmp_path, steps: int) -> TrainConfig:
    return TrainConfig(out=str(tmp_path / "model"), steps=steps, batch_size=16, lr=3e-3, warmup=5,
                       train_scenes=120, heldout_scenes=20, eval_every=10, checkpoint_every=10, workers=1,
                       device="cpu", compile=False, resume=str(tmp_path / "ckpt"), arch=TINY)


def test_training_lowers_the_loss_writes_a_model_and_resumes(tmp_path):
    first = train(tiny_config(tmp_path, 20))
    assert first["stopped_at_step"] == 20 and (tmp_path / "ckpt" / "state.pt").is_file()
    assert (tmp_path / "model" / "model.safetensors").is_file()
    report = json.loads((tmp_path / "model" / "training_report.json").read_text())
    assert report["history"][-1]["step"] == 20
    state = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=False)
    assert state["step"] == 20
    resumed = train(tiny_config(tmp_path, 30))  # picks up the checkpoint: 10 more steps, not 30
    assert resumed["stopped_at_step"] == 30
    assert [h["step"] for h in resumed["history"]] == [30]
    after = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=False)
    changed = [k for k in state["model"] if not torch.equal(state["model"][k], after["model"][k])]
    assert changed  # the resumed run really trained


def test_learning_rate_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=1000, warmup=100, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) < lr_at(50, cfg) < lr_at(99, cfg) <= 1e-3
    assert lr_at(100, cfg) > lr_at(500, cfg) > lr_at(999, cfg) >= 1e-4 * 0.999


def test_the_shipped_model_is_accurate_on_held_out_scenes(demo_model):
    # The bar: >= 97% exact match per task on >= 500 held-out scenes, served greedily.
    summary, cases = evaluate(demo_model, n_scenes=500)
    assert len(cases) >= 2400
    for task in scenes.TASKS:
        assert summary[f"task:{task}"]["accuracy"] >= 0.97, (task, summary)
