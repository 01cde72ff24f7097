"""Environment checks against simulated machines, plus one run of the real probe (no GPU here)."""

from __future__ import annotations

import json

import pytest

from fovea.guard.checks import Check, Status, exit_code, render_json, render_text
from fovea.guard.environment import (
    MIB,
    Probe,
    TorchView,
    detect_container,
    environment_checks,
    parse_driver_cuda,
    parse_nvidia_smi_query,
    parse_visible_devices,
)

UUID0 = "GPU-11111111-aaaa-bbbb-cccc-000000000000"
UUID1 = "GPU-22222222-aaaa-bbbb-cccc-111111111111"
SMI_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def smi_rows(n: int, free_mib: int = 140000, total_mib: int = 143771, name: str = "NVIDIA H200") -> str:
    uuids = [UUID0, UUID1, "GPU-33333333-aaaa", "GPU-44444444-aaaa"]
    return "".join(f"{i}, {name}, {uuids[i]}, 00000000:{0x19 + i:02X}:00.0, {total_mib}, {free_mib}, "
                   "550.54.15\n" for i in range(n))


def cpu_torch() -> TorchView:
    return TorchView("2.13.0+cpu", None, False)


def cuda_torch(n: int, build: str = "12.4", names: str = "NVIDIA H200") -> TorchView:
    return TorchView(f"2.13.0+cu{build.replace('.', '')}", build, n > 0, n, (names,) * n)


def make_probe(*, env=None, torch=None, gpus: int = 0, smi_cuda: str = "12.4", smi_query: str | None = None,
               files=None, nodes=None, mem_info=None) -> Probe:
    """A machine: ``gpus`` physical GPUs seen by nvidia-smi (0: no nvidia-smi), /dev nodes to match."""
    files = dict(files or {})
    query = smi_query if smi_query is not None else (smi_rows(gpus) if gpus else None)
    if nodes is None:
        nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm"] + [f"/dev/nvidia{i}" for i in range(gpus)]
        nodes = nodes if gpus else []
    return Probe(
        env=dict(env or {}),
        torch_view=lambda: torch or cpu_torch(),
        torch_mem_get_info=lambda device: mem_info,
        nvidia_smi_query=lambda: query,
        nvidia_smi_header=lambda: SMI_HEADER.format(cuda=smi_cuda) if query is not None else None,
        path_exists=lambda path: path in files,
        read_text=lambda path: files.get(path),
        dev_nvidia_nodes=lambda: list(nodes),
    )


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def run(probe: Probe, **kwargs) -> dict[str, Check]:
    return by_name(environment_checks(probe, **kwargs))


DOCKER = {"/.dockerenv": ""}


# -------------------------------------------------------------------------- whole situations


def test_bare_metal_without_gpu_passes_and_runs_on_cpu():
    checks = run(make_probe())
    assert checks["torch.cuda"].status is Status.PASS
    assert "no GPU present; fovea will run on CPU" in checks["torch.cuda"].detail
    assert checks["container"].detail == "not in a container"
    assert checks["cuda.driver"].status is Status.SKIP
    assert checks["gpu.memory"].status is Status.SKIP
    assert exit_code(checks.values()) == 0
    assert {c.status for c in checks.values()} <= {Status.PASS, Status.SKIP}


def test_bare_metal_without_gpu_fails_when_gpu_required():
    checks = run(make_probe(), need_gpu=True)
    assert checks["torch.cuda"].status is Status.FAIL
    assert "CUDA build of torch" in checks["torch.cuda"].remedy
    assert exit_code(checks.values()) == 1


def test_container_without_gpus_exposed_warns_with_gpus_all_remedy():
    checks = run(make_probe(files=DOCKER))
    container = checks["container"]
    assert container.status is Status.WARN
    assert "docker container with no GPU devices exposed" in container.detail
    assert "--gpus all" in container.remedy and "--runtime=nvidia" in container.remedy
    assert exit_code(checks.values()) == 0


def test_container_without_gpus_fails_when_gpu_required():
    checks = run(make_probe(files=DOCKER, torch=cuda_torch(0)), need_gpu=True)
    assert checks["container"].status is Status.FAIL
    assert checks["torch.cuda"].status is Status.FAIL
    assert "--gpus all" in checks["torch.cuda"].remedy


def test_container_cpu_intended_passes():
    checks = run(make_probe(files=DOCKER), need_gpu=False)
    assert checks["container"].status is Status.PASS
    assert exit_code(checks.values()) == 0


def test_kubernetes_container_remedy_names_the_gpu_resource():
    checks = run(make_probe(env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}))
    assert checks["container"].status is Status.WARN
    assert "nvidia.com/gpu" in checks["container"].remedy


def test_container_with_device_nodes_but_no_nvidia_smi_warns_about_utility_capability():
    probe = make_probe(files=DOCKER, torch=cuda_torch(1), nodes=["/dev/nvidiactl", "/dev/nvidia0"],
                       env={"NVIDIA_DRIVER_CAPABILITIES": "compute"})
    checks = run(probe)
    assert checks["container"].status is Status.WARN
    assert "NVIDIA_DRIVER_CAPABILITIES" in checks["container"].detail
    assert "utility" in checks["container"].remedy
    assert checks["gpu.visibility"].status is Status.PASS  # torch sees it; nothing to cross-check
    assert checks["cuda.driver"].status is Status.SKIP


def test_container_with_gpus_passes():
    checks = run(make_probe(files=DOCKER, gpus=1, torch=cuda_torch(1)))
    assert checks["container"].status is Status.PASS
    assert "1 GPU(s) exposed" in checks["container"].detail
    assert exit_code(checks.values()) == 0


def test_nvml_sees_gpus_but_torch_is_cpu_only_build():
    checks = run(make_probe(gpus=2, torch=cpu_torch(), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    torch_check, vis = checks["torch.cuda"], checks["gpu.visibility"]
    assert torch_check.status is Status.FAIL and vis.status is Status.FAIL
    assert "CPU-only build" in torch_check.detail and "CPU-only build" in vis.detail
    assert "download.pytorch.org/whl/cu" in torch_check.remedy
    assert "12.4" in torch_check.remedy  # the driver's CUDA bounds the wheel to pick
    assert checks["cuda.driver"].status is Status.SKIP
    assert exit_code(checks.values()) == 1


def test_nvml_sees_gpus_torch_cuda_build_sees_none_without_other_evidence_blames_driver_runtime():
    view = TorchView("2.13.0+cu124", "12.4", False, error="CUDA initialization: unknown error")
    checks = run(make_probe(gpus=1, torch=view))
    assert checks["gpu.visibility"].status is Status.FAIL
    assert "unknown error" in checks["gpu.visibility"].detail
    assert "dmesg" in checks["gpu.visibility"].remedy


def test_cpu_intended_with_gpu_present_is_not_a_failure():
    checks = run(make_probe(gpus=1, torch=cpu_torch()), need_gpu=False)
    assert checks["torch.cuda"].status is Status.PASS
    assert checks["gpu.visibility"].status is Status.WARN
    assert exit_code(checks.values()) == 0


def test_gpus_visible_everywhere_pass():
    checks = run(make_probe(gpus=2, torch=cuda_torch(2), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
                 need_gpu=True, required_gpu_bytes=10 * 1024**3)
    assert all(c.status in (Status.PASS, Status.SKIP) for c in checks.values()), render_text(checks.values())
    assert "sees 2 GPU(s)" in checks["torch.cuda"].detail
    assert checks["gpu.visibility"].detail == "torch and nvidia-smi both see 2 GPU(s)"


# -------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles"])
def test_cuda_visible_devices_hiding_everything_fails_with_gpus(value):
    checks = run(make_probe(gpus=2, torch=cuda_torch(0), env={"CUDA_VISIBLE_DEVICES": value}))
    cvd = checks["env.CUDA_VISIBLE_DEVICES"]
    assert cvd.status is Status.FAIL
    assert "hides every GPU" in cvd.detail
    assert "unset CUDA_VISIBLE_DEVICES" in cvd.remedy
    assert checks["torch.cuda"].status is Status.FAIL
    assert "hides every GPU" in checks["torch.cuda"].detail
    assert "hides every GPU" in checks["gpu.visibility"].detail


def test_cuda_visible_devices_empty_without_gpus_only_warns():
    checks = run(make_probe(env={"CUDA_VISIBLE_DEVICES": ""}))
    assert checks["env.CUDA_VISIBLE_DEVICES"].status is Status.WARN
    assert exit_code(checks.values()) == 0


def test_cuda_visible_devices_unset_passes():
    checks = run(make_probe(gpus=1, torch=cuda_torch(1)))
    assert checks["env.CUDA_VISIBLE_DEVICES"].status is Status.PASS
    assert "unset" in checks["env.CUDA_VISIBLE_DEVICES"].detail


def test_cuda_visible_devices_reordered_warns_and_names_mapping():
    env = {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    checks = run(make_probe(gpus=2, torch=cuda_torch(2), env=env))
    cvd = checks["env.CUDA_VISIBLE_DEVICES"]
    assert cvd.status is Status.WARN
    assert "cuda:0 is GPU 1" in cvd.detail and "cuda:1 is GPU 0" in cvd.detail
    assert checks["gpu.visibility"].status is Status.PASS
    assert exit_code(checks.values()) == 0


def test_cuda_visible_devices_subset_explains_fewer_gpus():
    env = {"CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    checks = run(make_probe(gpus=3, torch=cuda_torch(2), env=env))
    assert checks["env.CUDA_VISIBLE_DEVICES"].status is Status.PASS
    vis = checks["gpu.visibility"]
    assert vis.status is Status.PASS and "2 of the 3" in vis.detail


def test_fewer_gpus_in_torch_without_explanation_warns():
    checks = run(make_probe(gpus=2, torch=cuda_torch(1), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    assert checks["gpu.visibility"].status is Status.WARN


def test_cuda_visible_devices_index_out_of_range_fails():
    checks = run(make_probe(gpus=2, torch=cuda_torch(1), env={"CUDA_VISIBLE_DEVICES": "0,2,1"}))
    cvd = checks["env.CUDA_VISIBLE_DEVICES"]
    assert cvd.status is Status.FAIL
    assert "index 2 is out of range" in cvd.detail
    assert "every entry after it" in cvd.detail and "cuda:0 is GPU 0" in cvd.detail


def test_cuda_visible_devices_only_entry_out_of_range_hides_all():
    checks = run(make_probe(gpus=1, torch=cuda_torch(0), env={"CUDA_VISIBLE_DEVICES": "3"}))
    cvd = checks["env.CUDA_VISIBLE_DEVICES"]
    assert cvd.status is Status.FAIL
    assert "hides every GPU" in cvd.detail and "out of range" in cvd.detail


def test_cuda_visible_devices_uuid_entries_pass_with_mapping():
    env = {"CUDA_VISIBLE_DEVICES": UUID1[:12], "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # prefixes are allowed
    checks = run(make_probe(gpus=2, torch=cuda_torch(1), env=env))
    cvd = checks["env.CUDA_VISIBLE_DEVICES"]
    assert cvd.status is Status.PASS
    assert "by UUID" in cvd.detail and "cuda:0 is GPU 1" in cvd.detail
    assert checks["gpu.visibility"].status is Status.PASS


def test_cuda_visible_devices_unknown_uuid_fails():
    checks = run(make_probe(gpus=1, torch=cuda_torch(0), env={"CUDA_VISIBLE_DEVICES": "GPU-deadbeef"}))
    assert checks["env.CUDA_VISIBLE_DEVICES"].status is Status.FAIL
    assert "matches no GPU UUID" in checks["env.CUDA_VISIBLE_DEVICES"].detail


def test_cuda_visible_devices_mig_instance_passes_with_note():
    env = {"CUDA_VISIBLE_DEVICES": "MIG-5c89aac3-1f8b-5b1a-9a0a-7f0e4c0c5a6e"}
    checks = run(make_probe(gpus=1, torch=cuda_torch(1), env=env), required_gpu_bytes=1,)
    cvd = checks["env.CUDA_VISIBLE_DEVICES"]
    assert cvd.status is Status.PASS and "MIG instance" in cvd.detail
    assert checks["gpu.visibility"].status is Status.PASS
    # nvidia-smi's row is the whole GPU: free memory comes from torch instead (here: unknown)
    assert checks["gpu.memory"].status is Status.WARN


def test_cuda_visible_devices_two_mig_instances_warn():
    env = {"CUDA_VISIBLE_DEVICES": "MIG-aaaa,MIG-bbbb"}
    checks = run(make_probe(gpus=1, torch=cuda_torch(1), env=env))
    assert checks["env.CUDA_VISIBLE_DEVICES"].status is Status.WARN
    assert "only one" in checks["env.CUDA_VISIBLE_DEVICES"].detail


def test_cuda_visible_devices_duplicate_warns():
    checks = run(make_probe(gpus=2, torch=cuda_torch(1), env={"CUDA_VISIBLE_DEVICES": "0,0"}))
    assert checks["env.CUDA_VISIBLE_DEVICES"].status is Status.WARN
    assert "more than once" in checks["env.CUDA_VISIBLE_DEVICES"].detail


def test_cuda_visible_devices_reorder_detected_without_nvidia_smi():
    probe = make_probe(torch=cuda_torch(2), nodes=["/dev/nvidia0", "/dev/nvidia1"],
                       env={"CUDA_VISIBLE_DEVICES": "1,0"})
    cvd = run(probe)["env.CUDA_VISIBLE_DEVICES"]
    assert cvd.status is Status.WARN and "cuda:0 is GPU 1" in cvd.detail


def test_parse_visible_devices_stops_at_first_invalid_entry():
    gpus = parse_nvidia_smi_query(smi_rows(4))
    parsed = parse_visible_devices("2, 0 ,bogus,1", gpus)
    assert [e.physical_index for e in parsed.entries] == [2, 0]
    assert parsed.stopped_at == "bogus"
    assert parse_visible_devices(None, gpus).hides_all is False
    assert parse_visible_devices("", gpus).hides_all is True


# -------------------------------------------------------------------------- device order


def test_device_order_warns_with_several_gpus_unless_pci_bus_id():
    warn = run(make_probe(gpus=2, torch=cuda_torch(2)))["env.CUDA_DEVICE_ORDER"]
    assert warn.status is Status.WARN and "PCI_BUS_ID" in warn.remedy
    ok = run(make_probe(gpus=2, torch=cuda_torch(2), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    assert ok["env.CUDA_DEVICE_ORDER"].status is Status.PASS
    single = run(make_probe(gpus=1, torch=cuda_torch(1)))
    assert single["env.CUDA_DEVICE_ORDER"].status is Status.PASS


# -------------------------------------------------------------------------- driver


def test_torch_cuda_newer_major_than_driver_fails():
    view = TorchView("2.13.0+cu130", "13.0", False)
    checks = run(make_probe(gpus=1, torch=view, smi_cuda="12.4"))
    driver = checks["cuda.driver"]
    assert driver.status is Status.FAIL
    assert "13.0" in driver.detail and "12.4" in driver.detail
    assert "upgrade the NVIDIA driver" in driver.remedy
    assert "newer than the driver" in driver.detail
    assert "at most CUDA 12.4" in checks["torch.cuda"].detail  # the evidence names the cause


def test_torch_cuda_newer_minor_fails_when_torch_cannot_use_gpu():
    checks = run(make_probe(gpus=1, torch=cuda_torch(0, build="12.8"), smi_cuda="12.2"))
    assert checks["cuda.driver"].status is Status.FAIL


def test_torch_cuda_newer_minor_warns_when_torch_runs_anyway():
    checks = run(make_probe(gpus=1, torch=cuda_torch(1, build="12.8"), smi_cuda="12.2"))
    assert checks["cuda.driver"].status is Status.WARN
    assert "minor-version compatibility" in checks["cuda.driver"].detail


def test_torch_cuda_older_than_driver_passes():
    checks = run(make_probe(gpus=1, torch=cuda_torch(1, build="12.1"), smi_cuda="12.4"))
    assert checks["cuda.driver"].status is Status.PASS
    assert "550.54.15" in checks["cuda.driver"].detail


def test_parsers():
    assert parse_driver_cuda(SMI_HEADER.format(cuda="12.4")) == (12, 4)
    assert parse_driver_cuda("garbage") is None
    gpus = parse_nvidia_smi_query("0, NVIDIA H200, GPU-1, 00000000:19:00.0, 143771, [N/A], 550.54.15\n")
    assert gpus[0].total_bytes == 143771 * MIB and gpus[0].free_bytes is None
    assert gpus[0].name == "NVIDIA H200" and gpus[0].driver_version == "550.54.15"
    assert parse_nvidia_smi_query(None) is None
    assert parse_nvidia_smi_query("") == []


# -------------------------------------------------------------------------- memory


def test_gpu_memory_insufficient_fails():
    probe = make_probe(gpus=1, torch=cuda_torch(1), smi_query=smi_rows(1, free_mib=8 * 1024))
    mem = run(probe, required_gpu_bytes=16 * 1024**3)["gpu.memory"]
    assert mem.status is Status.FAIL
    assert "8.0 GiB free" in mem.detail and "16.0 GiB" in mem.detail


def test_gpu_memory_tight_warns_and_ample_passes():
    probe = make_probe(gpus=1, torch=cuda_torch(1), smi_query=smi_rows(1, free_mib=10 * 1024))
    assert run(probe, required_gpu_bytes=int(9.5 * 1024**3))["gpu.memory"].status is Status.WARN
    assert run(probe, required_gpu_bytes=5 * 1024**3)["gpu.memory"].status is Status.PASS


def test_gpu_memory_uses_the_gpu_behind_cuda0():
    rows = ("0, NVIDIA H200, GPU-a, 00000000:19:00.0, 143771, 100, 550.54.15\n"
            "1, NVIDIA H200, GPU-b, 00000000:1A:00.0, 143771, 140000, 550.54.15\n")
    env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    probe = make_probe(torch=cuda_torch(1), smi_query=rows, env=env)
    mem = run(probe, required_gpu_bytes=1024**3)["gpu.memory"]
    assert mem.status is Status.PASS and mem.detail.startswith("GPU 1")


def test_gpu_memory_falls_back_to_torch_without_nvidia_smi():
    probe = make_probe(torch=cuda_torch(1), nodes=["/dev/nvidia0"], mem_info=(2 * 1024**3, 80 * 1024**3))
    mem = run(probe, required_gpu_bytes=4 * 1024**3)["gpu.memory"]
    assert mem.status is Status.FAIL and mem.detail.startswith("cuda:0")


def test_gpu_memory_skips_without_gpu_or_requirement():
    assert run(make_probe(), required_gpu_bytes=1)["gpu.memory"].status is Status.SKIP
    assert run(make_probe(gpus=1, torch=cuda_torch(1)))["gpu.memory"].status is Status.SKIP


# -------------------------------------------------------------------------- container detection


@pytest.mark.parametrize(("files", "env", "expected"), [
    ({}, {}, None),
    ({"/.dockerenv": ""}, {}, "docker"),
    ({"/run/.containerenv": ""}, {}, "podman"),
    ({"/proc/1/cgroup": "12:cpu:/docker/0123abcd\n"}, {}, "docker"),
    ({"/proc/1/cgroup": "0::/kubepods/burstable/pod1/abc\n"}, {}, "kubernetes"),
    ({"/proc/1/cgroup": "0::/\n", "/proc/self/mountinfo":
      "500 400 253:1 /var/lib/containerd/io.containerd.runtime.v2.task/default/x/hostname /etc/hostname rw - "
      "ext4 /dev/vda1 rw\n"}, {}, "containerd"),
    ({"/proc/1/cgroup": "0::/init.scope\n", "/proc/self/mountinfo":
      "30 1 0:50 / /var/lib/docker/overlay2/x/merged rw - overlay overlay rw\n"}, {}, None),  # a docker host
    ({}, {"container": "podman"}, "podman"),
])
def test_detect_container(files, env, expected):
    assert detect_container(make_probe(files=files, env=env)) == expected


# -------------------------------------------------------------------------- rendering


def test_render_text_json_and_exit_code():
    checks = [
        Check("torch.cuda", Status.PASS, "fine"),
        Check("container", Status.WARN, "no GPU exposed", "start it with --gpus all"),
        Check("gpu.memory", Status.SKIP, "no requirement", "unused remedy"),
    ]
    text = render_text(checks)
    lines = text.splitlines()
    assert lines[0] == "[pass] torch.cuda  fine"
    assert lines[1] == "[warn] container   no GPU exposed"
    assert lines[2] == "       remedy: start it with --gpus all"
    assert lines[3].startswith("[skip] gpu.memory")
    assert "unused remedy" not in text
    assert lines[-1] == "ok: 1 pass, 1 warn, 0 fail, 1 skip"
    assert exit_code(checks) == 0

    body = json.loads(render_json(checks))
    assert body["ok"] is True
    assert body["counts"] == {"pass": 1, "warn": 1, "fail": 0, "skip": 1}
    assert body["checks"][1] == {"name": "container", "status": "warn", "detail": "no GPU exposed",
                                 "remedy": "start it with --gpus all"}

    failed = checks + [Check("cuda.driver", Status.FAIL, "too old", "upgrade")]
    assert exit_code(failed) == 1
    assert json.loads(render_json(failed))["ok"] is False
    assert render_text(failed).splitlines()[-1].startswith("FAILED:")
    assert exit_code([]) == 0 and json.loads(render_json([]))["checks"] == []


def test_check_is_frozen_and_status_is_a_string():
    check = Check("x", Status.PASS, "d")
    with pytest.raises(AttributeError):
        check.status = Status.FAIL  # type: ignore[misc]
    assert Status.FAIL == "fail"


# -------------------------------------------------------------------------- the real machine


def test_real_probe_on_this_machine_does_not_crash():
    for need_gpu in (None, False):
        checks = environment_checks(need_gpu=need_gpu, required_gpu_bytes=1024**3)
        names = [c.name for c in checks]
        assert names == ["torch.cuda", "gpu.visibility", "env.CUDA_VISIBLE_DEVICES", "env.CUDA_DEVICE_ORDER",
                         "container", "cuda.driver", "gpu.memory"]
        torch_check = by_name(checks)["torch.cuda"]
        try:
            import torch
            has_gpu = torch.cuda.is_available()
        except Exception:
            has_gpu = False
        if not has_gpu:
            assert torch_check.status is Status.PASS
            assert "will run on CPU" in torch_check.detail
            assert exit_code(checks) == 0, render_text(checks)
        render_text(checks), json.loads(render_json(checks))
