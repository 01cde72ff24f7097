"""Environment checks: is there a GPU, can torch see it, and if not, why not.

Every input comes through a :class:`Probe` (environment variables, torch's view, ``nvidia-smi``
output, a few files), so the checks run - and are tested - on a machine with no GPU: a test
hands in fakes that describe the situation it simulates.

Facts the checks rely on:

* ``CUDA_VISIBLE_DEVICES`` is read left to right; CUDA stops at the first entry it cannot
  resolve (an out-of-range index, ``-1``, ``NoDevFiles``, an unknown UUID), so that entry and
  every one after it are ignored. An empty value or an invalid first entry hides every GPU.
* Its indices count in ``CUDA_DEVICE_ORDER`` order, which is FASTEST_FIRST unless set to
  PCI_BUS_ID; ``nvidia-smi`` always counts in PCI bus order.
* A CUDA process enumerates at most one MIG instance.
* ``nvidia-smi``'s header names the newest CUDA the driver supports.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fovea.guard.checks import Check, Status

NVIDIA_SMI_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,name,uuid,pci.bus_id,memory.total,memory.free,driver_version",
    "--format=csv,noheader,nounits",
]
NVIDIA_SMI_TIMEOUT_S = 10.0
MIB = 1024 * 1024
GIB = 1024 * MIB

_HIDE_ALL = "unset it (`unset CUDA_VISIBLE_DEVICES`) or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0"
_CUDA_TORCH = ("install a CUDA build of torch, e.g. `pip install torch --index-url "
               "https://download.pytorch.org/whl/cu126` (pick a cuXYZ no newer than the driver's CUDA{})")


# --------------------------------------------------------------------------------------------
# What the probe reports


@dataclass(frozen=True, slots=True)
class TorchView:
    """What torch says about CUDA. ``cuda_build`` is ``torch.version.cuda`` (None: CPU-only build)."""

    version: str
    cuda_build: str | None
    available: bool
    device_count: int = 0
    device_names: tuple[str, ...] = ()
    hip_build: str | None = None
    error: str | None = None  # an exception or CUDA-initialisation warning met while asking


@dataclass(frozen=True, slots=True)
class NvmlGpu:
    """One row of the ``nvidia-smi --query-gpu`` output (memory in bytes, None when ``[N/A]``)."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    total_bytes: int | None
    free_bytes: int | None
    driver_version: str


def real_torch_view() -> TorchView:
    import torch

    version = str(torch.__version__)
    cuda_build = getattr(torch.version, "cuda", None)
    hip_build = getattr(torch.version, "hip", None)
    error = None
    available, count, names = False, 0, ()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = bool(torch.cuda.is_available())
            if available:
                count = int(torch.cuda.device_count())
                names = tuple(torch.cuda.get_device_name(i) for i in range(count))
        messages = [str(w.message) for w in caught if "cuda" in str(w.message).lower()]
        if messages:
            error = " ".join(messages)
    except Exception as exc:  # a broken driver must not crash the doctor
        error = f"{type(exc).__name__}: {exc}"
    return TorchView(version, cuda_build, available, count, names, hip_build, error)


def real_torch_mem_get_info(device: int) -> tuple[int, int] | None:
    """(free, total) bytes of ``cuda:<device>`` from torch; None when it cannot tell."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    except Exception:
        return None


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout


def real_nvidia_smi_query() -> str | None:
    return _run(NVIDIA_SMI_QUERY)


def real_nvidia_smi_header() -> str | None:
    return _run(["nvidia-smi"])


def read_text_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(1 << 20)
    except OSError:
        return None


def list_dev_nvidia() -> list[str]:
    return sorted(glob.glob("/dev/nvidia*"))


@dataclass(frozen=True, slots=True)
class Probe:
    """Everything the checks read. The defaults look at this machine; tests pass fakes."""

    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    torch_view: Callable[[], TorchView] = real_torch_view
    torch_mem_get_info: Callable[[int], tuple[int, int] | None] = real_torch_mem_get_info
    nvidia_smi_query: Callable[[], str | None] = real_nvidia_smi_query
    nvidia_smi_header: Callable[[], str | None] = real_nvidia_smi_header
    path_exists: Callable[[str], bool] = os.path.exists
    read_text: Callable[[str], str | None] = read_text_file
    dev_nvidia_nodes: Callable[[], list[str]] = list_dev_nvidia


# --------------------------------------------------------------------------------------------
# Parsing


def _mib(text: str) -> int | None:
    try:
        return int(float(text)) * MIB
    except ValueError:
        return None


def parse_nvidia_smi_query(text: str | None) -> list[NvmlGpu] | None:
    """Rows of the ``--query-gpu`` CSV; None when nvidia-smi gave nothing."""
    if text is None:
        return None
    gpus = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 7:
            continue
        # a GPU name could hold a comma: the first field is the index, the last five are fixed
        index, name, rest = parts[0], ", ".join(parts[1:-5]), parts[-5:]
        try:
            idx = int(index)
        except ValueError:
            continue
        gpus.append(NvmlGpu(idx, name, rest[0], rest[1], _mib(rest[2]), _mib(rest[3]), rest[4]))
    return gpus


def parse_driver_cuda(header: str | None) -> tuple[int, int] | None:
    """The ``CUDA Version: X.Y`` of the plain ``nvidia-smi`` header."""
    if not header:
        return None
    match = re.search(r"CUDA Version\s*:\s*(\d+)\.(\d+)", header)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _version_tuple(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _fmt_version(version: tuple[int, int] | None) -> str:
    return f"{version[0]}.{version[1]}" if version else "?"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True, slots=True)
class VisibleEntry:
    text: str
    kind: str  # "index" | "uuid" | "mig"
    gpu: NvmlGpu | None  # the physical GPU, when nvidia-smi lets us tell
    physical_index: int | None


@dataclass(frozen=True, slots=True)
class VisibleDevices:
    """How CUDA reads ``CUDA_VISIBLE_DEVICES``: the entries it uses and where it stopped."""

    raw: str | None
    entries: tuple[VisibleEntry, ...] = ()  # in torch order: entries[i] is cuda:i
    stopped_at: str | None = None  # the first entry CUDA could not resolve
    stop_reason: str = ""
    duplicates: tuple[str, ...] = ()

    @property
    def is_set(self) -> bool:
        return self.raw is not None

    @property
    def hides_all(self) -> bool:
        return self.is_set and not self.entries


def parse_visible_devices(raw: str | None, gpus: list[NvmlGpu] | None) -> VisibleDevices:
    if raw is None:
        return VisibleDevices(None)
    entries: list[VisibleEntry] = []
    seen: set[int] = set()
    duplicates: list[str] = []
    for text in (part.strip() for part in raw.split(",")):
        entry, reason = _resolve_entry(text, gpus)
        if entry is None:
            return VisibleDevices(raw, tuple(entries), text, reason, tuple(duplicates))
        if entry.physical_index is not None:
            if entry.physical_index in seen:
                duplicates.append(text)
                continue
            seen.add(entry.physical_index)
        entries.append(entry)
    return VisibleDevices(raw, tuple(entries), None, "", tuple(duplicates))


def _resolve_entry(text: str, gpus: list[NvmlGpu] | None) -> tuple[VisibleEntry | None, str]:
    if text == "":
        return None, "an empty entry"
    if re.fullmatch(r"\d+", text):
        index = int(text)
        if gpus is not None and index >= len(gpus):
            return None, f"index {index} is out of range: nvidia-smi lists {len(gpus)} GPU(s)"
        gpu = gpus[index] if gpus is not None else None
        return VisibleEntry(text, "index", gpu, index), ""
    if re.fullmatch(r"-\d+", text):
        return None, f"{text} is not a device index"
    if text.upper().startswith("MIG-"):
        parent = None
        legacy = re.match(r"MIG-(GPU-[0-9a-fA-F-]+)/", text)  # MIG-GPU-<uuid>/<gi>/<ci>
        if legacy and gpus is not None:
            parent = next((g for g in gpus if g.uuid.lower() == legacy.group(1).lower()), None)
        return VisibleEntry(text, "mig", parent, None), ""
    if text.upper().startswith("GPU-"):
        if gpus is None:
            return VisibleEntry(text, "uuid", None, None), ""
        matches = [g for g in gpus if g.uuid.lower().startswith(text.lower())]
        if not matches:
            return None, f"{text} matches no GPU UUID listed by nvidia-smi"
        if len(matches) > 1:
            return None, f"{text} is a prefix of {len(matches)} GPU UUIDs"
        return VisibleEntry(text, "uuid", matches[0], matches[0].index), ""
    return None, f"{text!r} is neither an index, a GPU UUID nor a MIG id"


# --------------------------------------------------------------------------------------------
# Gathering facts once


@dataclass(frozen=True, slots=True)
class Facts:
    env: Mapping[str, str]
    torch: TorchView
    gpus: list[NvmlGpu] | None  # None: nvidia-smi absent or failed
    driver_cuda: tuple[int, int] | None
    dev_nodes: tuple[str, ...]
    container: str | None
    visible: VisibleDevices
    need_gpu: bool | None

    @property
    def gpu_nodes(self) -> tuple[str, ...]:
        return tuple(node for node in self.dev_nodes if re.fullmatch(r"/dev/nvidia\d+", node))

    @property
    def nvml_count(self) -> int:
        return len(self.gpus) if self.gpus else 0

    @property
    def torch_count(self) -> int:
        return self.torch.device_count if self.torch.available else 0

    @property
    def gpu_exists(self) -> bool:
        return self.nvml_count > 0 or bool(self.gpu_nodes) or self.torch_count > 0

    @property
    def torch_cuda(self) -> tuple[int, int] | None:
        return _version_tuple(self.torch.cuda_build)


_BIND_MOUNTED_BY_RUNTIMES = ("/etc/hostname", "/etc/hosts", "/etc/resolv.conf")


def _runtime_mount_roots(mountinfo: str) -> str:
    """Sources of /etc/hostname, /etc/hosts, /etc/resolv.conf: container runtimes bind-mount them."""
    roots = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] in _BIND_MOUNTED_BY_RUNTIMES:
            roots.append(fields[3])
    return "\n".join(roots)


def detect_container(probe: Probe) -> str | None:
    """kubernetes / podman / docker / containerd / lxc, or None on bare metal or a VM."""
    evidence = "\n".join([probe.read_text("/proc/1/cgroup") or "",
                          _runtime_mount_roots(probe.read_text("/proc/self/mountinfo") or "")])
    if probe.env.get("KUBERNETES_SERVICE_HOST") or "kubepods" in evidence or "/kubelet/pods/" in evidence:
        return "kubernetes"
    if probe.path_exists("/run/.containerenv") or "libpod" in evidence or "/containers/storage/" in evidence:
        return "podman"
    if probe.path_exists("/.dockerenv") or "docker" in evidence:
        return "docker"
    if "containerd" in evidence:
        return "containerd"
    if "lxc" in evidence:
        return "lxc"
    return probe.env.get("container") or None  # podman, systemd-nspawn and lxc set it


def gather(probe: Probe, need_gpu: bool | None) -> Facts:
    gpus = parse_nvidia_smi_query(probe.nvidia_smi_query())
    driver_cuda = parse_driver_cuda(probe.nvidia_smi_header()) if gpus is not None else None
    return Facts(
        env=probe.env,
        torch=probe.torch_view(),
        gpus=gpus,
        driver_cuda=driver_cuda,
        dev_nodes=tuple(probe.dev_nvidia_nodes()),
        container=detect_container(probe),
        visible=parse_visible_devices(probe.env.get("CUDA_VISIBLE_DEVICES"), gpus),
        need_gpu=need_gpu,
    )


# --------------------------------------------------------------------------------------------
# The checks


def _torch_label(view: TorchView) -> str:
    if view.cuda_build:
        return f"torch {view.version} (CUDA {view.cuda_build} build)"
    if view.hip_build:
        return f"torch {view.version} (ROCm {view.hip_build} build)"
    return f"torch {view.version} (CPU-only build)"


def _why_torch_sees_no_gpu(f: Facts) -> tuple[list[str], list[str]]:
    """Reasons read from the evidence, and their remedies, for torch seeing no GPU."""
    reasons: list[str] = []
    remedies: list[str] = []
    if not f.torch.cuda_build and not f.torch.hip_build:
        reasons.append(f"torch {f.torch.version} is a CPU-only build")
        driver = f" {_fmt_version(f.driver_cuda)}" if f.driver_cuda else ""
        remedies.append(_CUDA_TORCH.format(driver))
    if f.visible.hides_all:
        reasons.append(f"CUDA_VISIBLE_DEVICES={f.visible.raw!r} hides every GPU")
        remedies.append(_HIDE_ALL)
    if f.torch_cuda and f.driver_cuda and f.torch_cuda > f.driver_cuda:
        reasons.append(f"torch is built for CUDA {_fmt_version(f.torch_cuda)} but the driver supports "
                       f"at most CUDA {_fmt_version(f.driver_cuda)}")
        remedies.append("upgrade the NVIDIA driver, or install a torch build for an older CUDA")
    if f.container and not f.gpu_nodes:
        reasons.append(f"the {f.container} container has no /dev/nvidia<N> device nodes")
        remedies.append(_container_remedy(f.container))
    if not reasons:
        if f.torch.error:
            reasons.append(f"torch reported: {f.torch.error}")
        else:
            reasons.append("CUDA initialisation failed: likely a driver / CUDA runtime mismatch "
                           "or a driver that is not loaded")
        remedies.append("compare `nvidia-smi` with `python -c 'import torch; print(torch.version.cuda)'`, "
                        "reinstall a matching driver or torch build, and check `dmesg` for NVRM errors")
    return reasons, remedies


def check_torch_cuda(f: Facts) -> Check:
    name, label = "torch.cuda", _torch_label(f.torch)
    if f.torch_count > 0:
        names = ", ".join(f.torch.device_names) or "?"
        detail = f"{label} sees {f.torch_count} GPU(s): {names}"
        if f.need_gpu is False:
            detail += "; need_gpu=False, so fovea will run on CPU"
        return Check(name, Status.PASS, detail)
    if f.need_gpu is False:
        return Check(name, Status.PASS, f"{label}, no GPU in use; fovea will run on CPU as requested")
    if not f.gpu_exists:
        if f.need_gpu:
            remedy = ("run on a machine with an NVIDIA GPU and expose it (`docker run --gpus all`, "
                      "Kubernetes `nvidia.com/gpu`), or allow CPU")
            if not f.torch.cuda_build:
                remedy += "; " + _CUDA_TORCH.format("")
            return Check(name, Status.FAIL, f"{label}: a GPU is required but none is present", remedy)
        detail = f"{label}: no GPU present; fovea will run on CPU"
        if f.torch.error:
            detail += f" (torch reported: {f.torch.error})"
        return Check(name, Status.PASS, detail)
    reasons, remedies = _why_torch_sees_no_gpu(f)
    where = f"nvidia-smi lists {f.nvml_count} GPU(s)" if f.nvml_count else \
        f"device nodes {', '.join(f.gpu_nodes)} exist"
    detail = f"{label} cannot use any GPU although {where}: " + "; ".join(reasons)
    return Check(name, Status.FAIL, detail, "; ".join(remedies))


def check_gpu_visibility(f: Facts) -> Check:
    name = "gpu.visibility"
    soft = Status.WARN if f.need_gpu is False else Status.FAIL  # CPU intended: mismatches only inform
    if f.gpus is None:
        if f.torch_count:
            return Check(name, Status.PASS,
                         f"torch sees {f.torch_count} GPU(s); nvidia-smi is not available to cross-check")
        if f.gpu_nodes:
            return Check(name, soft,
                         f"GPU device nodes {', '.join(f.gpu_nodes)} exist, but neither nvidia-smi nor "
                         "torch sees a GPU",
                         "check that the NVIDIA driver is loaded (`lsmod | grep nvidia`) and its user-space "
                         "libraries are installed / mounted")
        return Check(name, Status.PASS, "no GPU visible to nvidia-smi or torch")
    nvml, seen = f.nvml_count, f.torch_count
    if nvml == seen:
        return Check(name, Status.PASS, f"torch and nvidia-smi both see {seen} GPU(s)")
    if seen == 0:
        reasons, remedies = _why_torch_sees_no_gpu(f)
        return Check(name, soft, f"nvidia-smi lists {nvml} GPU(s) but torch sees none: " + "; ".join(reasons),
                     "; ".join(remedies))
    if seen < nvml:
        expected = len(f.visible.entries) if f.visible.is_set else None
        if any(e.kind == "mig" for e in f.visible.entries):
            expected = seen  # MIG instances: nvidia-smi's rows are whole GPUs, no count to compare
        if expected == seen:
            return Check(name, Status.PASS,
                         f"torch sees {seen} of the {nvml} GPU(s) nvidia-smi lists, as "
                         f"CUDA_VISIBLE_DEVICES={f.visible.raw!r} asks")
        why = (f"CUDA_VISIBLE_DEVICES={f.visible.raw!r} should expose {expected}"
               if expected is not None else "CUDA_VISIBLE_DEVICES is unset")
        return Check(name, Status.WARN,
                     f"torch sees {seen} GPU(s) but nvidia-smi lists {nvml} ({why}); a GPU may be in MIG "
                     "mode, in an error state, or taken by another container's isolation",
                     "run `nvidia-smi -q` and look for MIG mode, Xid errors or 'GPU is lost'")
    return Check(name, Status.WARN,
                 f"torch sees {seen} GPU(s) but nvidia-smi lists only {nvml} (MIG instances, or nvidia-smi "
                 "from another driver/namespace)",
                 "run `nvidia-smi -L` to list GPUs and MIG instances")


def _combine(name: str, notes: list[tuple[Status, str]], remedies: list[str]) -> Check:
    rank = {Status.SKIP: 0, Status.PASS: 1, Status.WARN: 2, Status.FAIL: 3}
    status = max((s for s, _ in notes), key=rank.__getitem__)
    return Check(name, status, "; ".join(text for _, text in notes), "; ".join(dict.fromkeys(remedies)))


def _describe(entry: VisibleEntry) -> str:
    if entry.physical_index is not None:
        name = f" ({entry.gpu.name})" if entry.gpu else ""
        return f"GPU {entry.physical_index}{name}"
    if entry.kind == "mig":
        return f"MIG instance {entry.text}"
    return entry.text


def check_cuda_visible_devices(f: Facts) -> Check:
    name, vis = "env.CUDA_VISIBLE_DEVICES", f.visible
    if not vis.is_set:
        count = f" ({f.nvml_count} GPU(s))" if f.gpus else ""
        return Check(name, Status.PASS, f"unset: CUDA sees every GPU{count}")
    value = f"CUDA_VISIBLE_DEVICES={vis.raw!r}"
    if vis.hides_all:
        why = "" if vis.raw.strip() in ("", "-1", "NoDevFiles") else f" ({vis.stop_reason})"
        if f.gpu_exists and f.need_gpu is not False:
            return Check(name, Status.FAIL, f"{value} hides every GPU from CUDA{why}", _HIDE_ALL)
        tail = " (there is no GPU anyway)" if not f.gpu_exists else " (need_gpu=False: CPU intended)"
        return Check(name, Status.WARN, f"{value} hides every GPU from CUDA{why}{tail}", _HIDE_ALL)
    notes: list[tuple[Status, str]] = []
    remedies: list[str] = []
    mapping = ", ".join(f"cuda:{i} is {_describe(e)}" for i, e in enumerate(vis.entries))
    if vis.stopped_at is not None:
        notes.append((Status.FAIL, f"{value}: {vis.stop_reason}; CUDA ignores it and every entry after it, "
                                   f"so only {mapping} remain"))
        remedies.append("list only existing GPUs (`nvidia-smi -L` shows their indices and UUIDs)")
    if vis.duplicates:
        twice = ", ".join(vis.duplicates)
        notes.append((Status.WARN, f"{value} names {twice} more than once; CUDA exposes a device once and "
                                   "may drop the entries after a repeat"))
        remedies.append("list each GPU once")
    physical = [e.physical_index for e in vis.entries if e.physical_index is not None]
    if physical != sorted(physical):
        notes.append((Status.WARN, f"{value} reorders the GPUs: {mapping}; torch's numbering differs from "
                                   "nvidia-smi's"))
        remedies.append("list the GPUs in ascending order, or remember that cuda:N is not nvidia-smi's GPU N")
    migs = [e for e in vis.entries if e.kind == "mig"]
    if len(migs) > 1:
        notes.append((Status.WARN, f"{value} lists {len(migs)} MIG instances but a CUDA process enumerates "
                                   "only one; the others are unused"))
        remedies.append("give each fovea process one MIG instance")
    elif migs:
        notes.append((Status.PASS, f"{value} selects MIG instance {migs[0].text}"
                                   " (nvidia-smi's memory figures are for the whole GPU)"))
    uuids = [e for e in vis.entries if e.kind == "uuid"]
    if uuids:
        notes.append((Status.PASS, f"{value} selects GPUs by UUID: {mapping}"))
    if not notes:
        notes.append((Status.PASS, f"{value}: {mapping}"))
    return _combine(name, notes, remedies)


def check_cuda_device_order(f: Facts) -> Check:
    name = "env.CUDA_DEVICE_ORDER"
    order = f.env.get("CUDA_DEVICE_ORDER")
    count = max(f.nvml_count, f.torch_count, len(f.gpu_nodes))
    if count <= 1:
        gpus = "one GPU" if count == 1 else "no GPU"
        return Check(name, Status.PASS, f"{order or 'unset'}; the order does not matter with {gpus}")
    if order == "PCI_BUS_ID":
        return Check(name, Status.PASS, "PCI_BUS_ID: torch and nvidia-smi number the GPUs alike")
    return Check(name, Status.WARN,
                 f"{order or 'unset (FASTEST_FIRST)'} with {count} GPUs: torch's cuda:N and the indices in "
                 "CUDA_VISIBLE_DEVICES may not match nvidia-smi's GPU N",
                 "export CUDA_DEVICE_ORDER=PCI_BUS_ID")


def _container_remedy(kind: str) -> str:
    if kind == "kubernetes":
        return ("request the GPU in the pod spec (`resources.limits: nvidia.com/gpu: 1`) on a node with the "
                "NVIDIA device plugin")
    if kind == "podman":
        return ("start it with `--device nvidia.com/gpu=all` (CDI) or `--gpus all` with the NVIDIA "
                "container toolkit")
    return ("start it with `docker run --gpus all` (or the NVIDIA container runtime, `--runtime=nvidia` with "
            "NVIDIA_VISIBLE_DEVICES=all)")


def check_container(f: Facts) -> Check:
    name = "container"
    if not f.container:
        return Check(name, Status.PASS, "not in a container")
    kind = f.container
    if not f.gpu_nodes and f.gpus is None and f.torch_count == 0:
        detail = f"{kind} container with no GPU devices exposed (no /dev/nvidia<N>, no nvidia-smi)"
        nvd = f.env.get("NVIDIA_VISIBLE_DEVICES")
        if nvd is not None and nvd.strip().lower() in ("", "void", "none"):
            detail += f"; NVIDIA_VISIBLE_DEVICES={nvd!r} asks for none"
        if f.need_gpu is False:
            return Check(name, Status.PASS, detail + "; CPU intended")
        status = Status.FAIL if f.need_gpu else Status.WARN
        return Check(name, status, detail, _container_remedy(kind))
    if f.gpus is None:
        nodes = ", ".join(f.gpu_nodes) or "GPU devices"
        caps = f.env.get("NVIDIA_DRIVER_CAPABILITIES")
        caps_note = f" (NVIDIA_DRIVER_CAPABILITIES={caps!r})" if caps is not None else ""
        return Check(name, Status.WARN,
                     f"{kind} container has {nodes} but no working nvidia-smi: the driver utilities are not "
                     f"mounted{caps_note}",
                     "set NVIDIA_DRIVER_CAPABILITIES=compute,utility (or all) so the runtime mounts "
                     "nvidia-smi and NVML")
    return Check(name, Status.PASS, f"{kind} container with {f.nvml_count} GPU(s) exposed")


def check_cuda_driver(f: Facts) -> Check:
    name = "cuda.driver"
    if f.gpus is None:
        return Check(name, Status.SKIP, "no NVIDIA driver found (nvidia-smi absent or failing)")
    driver_version = next((g.driver_version for g in f.gpus), "?")
    if f.torch.hip_build:
        return Check(name, Status.SKIP, "torch is a ROCm build")
    if not f.torch.cuda_build:
        return Check(name, Status.SKIP, f"torch is a CPU-only build; driver {driver_version}")
    torch_cuda = f.torch_cuda
    if f.driver_cuda is None or torch_cuda is None:
        return Check(name, Status.WARN,
                     f"driver {driver_version}: could not read the CUDA version it supports "
                     f"(torch built for CUDA {f.torch.cuda_build})",
                     "run `nvidia-smi` and read 'CUDA Version'")
    pair = (f"torch built for CUDA {_fmt_version(torch_cuda)}, driver {driver_version} supports up to "
            f"CUDA {_fmt_version(f.driver_cuda)}")
    remedy = (f"upgrade the NVIDIA driver to one supporting CUDA {_fmt_version(torch_cuda)}, or install a "
              f"torch build for CUDA {_fmt_version(f.driver_cuda)} or older "
              "(https://pytorch.org/get-started/locally/)")
    if torch_cuda <= f.driver_cuda:
        return Check(name, Status.PASS, pair)
    if torch_cuda[0] > f.driver_cuda[0] or f.torch_count == 0:
        return Check(name, Status.FAIL, f"{pair}: torch's CUDA is newer than the driver", remedy)
    # same major, newer minor: CUDA minor-version compatibility lets most kernels run, and torch does
    return Check(name, Status.WARN, f"{pair}: runs under CUDA minor-version compatibility, but PTX JIT and "
                                    "newer features need a newer driver", remedy)


def _serving_gpu(f: Facts) -> tuple[NvmlGpu | None, str]:
    """The physical GPU behind torch's cuda:0, when nvidia-smi's row can tell its free memory."""
    if not f.gpus:
        return None, ""
    if f.visible.is_set:
        first = f.visible.entries[0] if f.visible.entries else None
        if first is None or first.kind == "mig":
            return None, ""
        if first.gpu is not None:
            return first.gpu, f"GPU {first.gpu.index}"
        return None, ""
    return f.gpus[0], f"GPU {f.gpus[0].index}"


def check_gpu_memory(f: Facts, required_bytes: int | None, probe: Probe) -> Check:
    name = "gpu.memory"
    if required_bytes is None:
        return Check(name, Status.SKIP, "no memory requirement given")
    if f.need_gpu is False:
        return Check(name, Status.SKIP, "need_gpu=False: the model runs on CPU")
    if not f.gpu_exists or (f.torch_count == 0 and f.nvml_count == 0):
        return Check(name, Status.SKIP, "no GPU present")
    gpu, where = _serving_gpu(f)
    free = gpu.free_bytes if gpu is not None else None
    total = gpu.total_bytes if gpu is not None else None
    if free is None and f.torch_count > 0:
        info = probe.torch_mem_get_info(0)
        if info is not None:
            (free, total), where = info, "cuda:0"
    if free is None:
        return Check(name, Status.WARN,
                     f"could not read the free memory of cuda:0 (need {_gib(required_bytes)})",
                     "run `nvidia-smi` to see free memory")
    of_total = f" of {_gib(total)}" if total else ""
    detail = f"{where}: {_gib(free)} free{of_total}, model needs about {_gib(required_bytes)}"
    remedy = ("free the GPU (`nvidia-smi` lists the processes using it), pick a GPU with more memory, "
              "or load a smaller dtype / model")
    if free < required_bytes:
        return Check(name, Status.FAIL, detail, remedy)
    if free < required_bytes * 1.1:
        return Check(name, Status.WARN, detail + " (less than 10% headroom)", remedy)
    return Check(name, Status.PASS, detail)


def environment_checks(probe: Probe | None = None, *, need_gpu: bool | None = None,
                       required_gpu_bytes: int | None = None) -> list[Check]:
    """Run every environment check. ``need_gpu``: True = GPU required, False = CPU intended, None = auto."""
    probe = probe if probe is not None else Probe()
    facts = gather(probe, need_gpu)
    return [
        check_torch_cuda(facts),
        check_gpu_visibility(facts),
        check_cuda_visible_devices(facts),
        check_cuda_device_order(facts),
        check_container(facts),
        check_cuda_driver(facts),
        check_gpu_memory(facts, required_gpu_bytes, probe),
    ]
