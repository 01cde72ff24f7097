import random
import subprocess
import sys

import pytest

from fovea.demo import scenes


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fovea.cli", *args], capture_output=True, text=True, timeout=300)


def test_chat_prints_the_answer(tmp_path):
    scene = scenes.SceneSampler().sample(random.Random(77_001))
    path = tmp_path / "scene.png"
    scenes.render(scene).save(path)
    result = run_cli("chat", "--image", str(path), "Describe the image.")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == scenes.describe_answer(scene)


def test_chat_without_max_tokens_follows_the_max_model_len(tmp_path):
    """The default answer length is what --max-model-len leaves after the prompt, not the model's
    context; a prompt that leaves nothing is refused naming the prompt."""
    path = tmp_path / "scene.png"
    scenes.render(scenes.SceneSampler().sample(random.Random(77_002))).save(path)
    result = run_cli("chat", "--max-model-len", "120", "--image", str(path), "Describe the image.")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    result = run_cli("chat", "--max-model-len", "40", "--image", str(path), "Describe the image.")
    assert result.returncode == 2
    assert "the prompt has" in result.stderr and "limit is 40 tokens per sequence" in result.stderr
    assert "max_tokens" not in result.stderr


def test_chat_refuses_a_broken_image_and_a_bad_model_dir(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    result = run_cli("chat", "--image", str(broken), "Describe the image.")
    assert result.returncode == 2 and "error" in result.stderr.lower()
    result = run_cli("chat", "--model", str(tmp_path), "--image", str(broken), "hi")
    assert result.returncode == 2 and "config.json is missing" in result.stderr


def test_doctor_reports_this_machine_and_the_model_contract():
    import json

    result = run_cli("doctor", "--json")
    report = json.loads(result.stdout)
    names = {c["name"]: c for c in report["checks"]}
    assert result.returncode == (0 if report["ok"] else 1)
    assert names["contract"]["status"] == "pass" and "probe images of [64, 64] image tokens" in names["contract"]["detail"]
    assert names["model.directory"]["status"] == "pass"
    assert names["engine.reference"]["status"] == "pass" and "of transformers' forward" in names["engine.reference"]["detail"]
    assert names["encoder.plan"]["status"] == "pass" and "encode worker on cpu needs" in names["encoder.plan"]["detail"]
    assert {"torch.cuda", "gpu.visibility", "env.CUDA_VISIBLE_DEVICES", "container"} <= set(names)


def test_doctor_fails_on_a_directory_that_is_not_a_model(tmp_path):
    result = run_cli("doctor", "--model", str(tmp_path))
    assert result.returncode == 1
    assert "[fail] model.directory" in result.stdout and "config.json is missing" in result.stdout


def test_max_batched_tokens_reaches_the_paged_engine(demo_model):
    from fovea.config import ServerSettings
    from fovea.serve.app import create_app

    settings = ServerSettings(host="127.0.0.1", port=1, device="cpu", dtype="float32", canary=False,
                              max_batched_tokens=96)
    app = create_app(settings, loaded=demo_model)
    assert app.state.fovea.engine.config.max_num_batched_tokens == 96
    with pytest.raises(ValueError, match="--max-batched-tokens"):
        ServerSettings(max_batched_tokens=0)


def test_step_overlap_and_fused_vision_are_automatic_or_forced(demo_model):
    from fovea.cli import build_parser
    from fovea.config import ServerSettings
    from fovea.serve.app import create_app

    args = build_parser().parse_args(["serve", "--step-overlap", "on", "--fused-vision", "off"])
    assert (args.step_overlap, args.fused_vision) == ("on", "off")

    def engine_config(**kw):
        settings = ServerSettings(device="cpu", dtype="float32", canary=False, **kw)
        return create_app(settings, loaded=demo_model).state.fovea.engine.config

    forced = engine_config(step_overlap="on", fused_vision="off")
    assert forced.overlap_steps is True and forced.fused_vision is False
    # auto: off for a 5 M-parameter model (and on any CPU).
    auto = engine_config()
    assert auto.overlap_steps is False and auto.fused_vision is False
    with pytest.raises(ValueError, match="--step-overlap must be one of auto, on, off"):
        ServerSettings(step_overlap="yes")


@pytest.mark.parametrize("device, dtype, expected", [
    ("cpu", "bfloat16", "bfloat16"), ("cpu", "float16", "float16"), ("cpu", "auto", "float32"),
    ("cuda", "auto", "bfloat16"), ("cuda:1", "float32", "float32"),
])
def test_doctor_estimates_memory_in_the_dtype_asked_for(monkeypatch, device, dtype, expected):
    import torch

    from fovea.guard import doctor

    seen = []
    monkeypatch.setattr(doctor, "estimate_serving_bytes", lambda path, d: seen.append(d) or 0)
    monkeypatch.setattr(doctor, "environment_checks", lambda **kw: [])
    monkeypatch.setattr(doctor, "model_dir_check", lambda path: doctor.Check("model.directory", doctor.Status.FAIL, ""))
    doctor.doctor_checks(None, device, dtype)
    assert seen == [getattr(torch, expected)]


def test_doctor_json_carries_the_memory_plan():
    import json

    result = run_cli("doctor", "--json", "--device", "cpu", "--kv-cache-memory", "64MiB")
    report = json.loads(result.stdout)
    plan = report["memory_plan"]
    check = next(c for c in report["checks"] if c["name"] == "memory.plan")
    assert check["status"] == "pass" and "kv_cache" in check["detail"]
    kv = next(line for line in plan["lines"] if line["name"] == "kv_cache")
    assert "--kv-cache-memory" in kv["how"] and plan["planned_bytes"] == sum(l["bytes"] for l in plan["lines"])
