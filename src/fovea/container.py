"""The container images' entrypoint: ``fovea doctor`` first, then ``fovea serve``.

``FOVEA_DEVICE`` says what the image was started for (the GPU image: ``cuda``, the CPU image:
``cpu``). When a GPU was asked for but none is exposed, the start stops at once with the one flag
to add, before any model is loaded; a server that cannot use its GPU never falls back to CPU in
silence. Every other failing doctor check stops it too, with the doctor's own report.

    python -m fovea.container [fovea serve flags...]     # what ENTRYPOINT runs
    FOVEA_SKIP_DOCTOR=1                                    # serve without the checks (not advised)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from fovea.guard.environment import Facts, Probe, gather

EXIT_NO_GPU = 3  # distinct from the doctor's 1 and serve's 2, so an orchestrator can tell them apart
_COMPOSE = ("in compose: `deploy: {resources: {reservations: {devices: [{driver: nvidia, count: all, "
            "capabilities: [gpu]}]}}}` (docker/compose.*.yaml have it)")


def gpu_exposure_problem(facts: Facts) -> str | None:
    """Why a container asked to use a GPU sees none, as the exact flag to add; None when it sees one."""
    if facts.torch_count > 0:
        return None
    env = facts.env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and facts.visible.hides_all:
        also = "" if facts.gpu_nodes else " No GPU is exposed either: add `--gpus all` too."
        return (f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU from this container. Remove "
                "`-e CUDA_VISIBLE_DEVICES=...` from `docker run` (or set it to the GPUs to use, e.g. "
                f"`-e CUDA_VISIBLE_DEVICES=0`).{also}")
    nvd = env.get("NVIDIA_VISIBLE_DEVICES")
    if nvd is not None and nvd.strip().lower() in ("", "void", "none"):
        return (f"NVIDIA_VISIBLE_DEVICES={nvd!r} tells the NVIDIA runtime to expose no GPU. Remove that "
                "`-e NVIDIA_VISIBLE_DEVICES=...` or set `-e NVIDIA_VISIBLE_DEVICES=all`.")
    if not facts.gpu_nodes:
        return ("no GPU is exposed to this container (no /dev/nvidia<N> device). Add `--gpus all` to "
                f"`docker run` (it needs the NVIDIA Container Toolkit on the host); {_COMPOSE}. "
                "To run on CPU instead, use the CPU image or `-e FOVEA_DEVICE=cpu`.")
    if facts.gpus is None:
        return (f"the container has {', '.join(facts.gpu_nodes)} but no NVIDIA driver libraries: it was not "
                "started by the NVIDIA runtime. Use `--gpus all` (or `--runtime=nvidia`) instead of "
                "`--device /dev/nvidia0`, and keep `NVIDIA_DRIVER_CAPABILITIES=compute,utility`.")
    if not facts.torch.cuda_build:
        return (f"torch {facts.torch.version} in this image is a CPU-only build; this is not fovea's GPU "
                "image (docker/Dockerfile.gpu installs a CUDA build).")
    return (f"the driver lists {len(facts.gpus)} GPU(s) but torch sees none"
            f"{': ' + facts.torch.error if facts.torch.error else ''}. Run `fovea doctor` in the container "
            "for the driver/CUDA check.")


def serve_argv(device: str, args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``fovea serve`` on all interfaces (a container's port is only reachable that way)."""
    argv = ["fovea", "serve"]
    if "--host" not in args:
        argv += ["--host", env.get("FOVEA_HOST", "0.0.0.0")]  # inside a container, by design
    if "--device" not in args:
        argv += ["--device", device]
    if "--model" not in args and env.get("FOVEA_MODEL"):
        argv += ["--model", env["FOVEA_MODEL"]]
    return argv + list(args)


def doctor_argv(device: str, args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    argv = ["fovea", "doctor", "--device", device]
    model = env.get("FOVEA_MODEL")
    if "--model" in args:
        model = args[list(args).index("--model") + 1]
    return argv + (["--model", model] if model else [])


def main(argv: Sequence[str] | None = None, probe: Probe | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ) if probe is None else dict(probe.env)
    device = env.get("FOVEA_DEVICE", "auto")
    if device.startswith("cuda"):
        problem = gpu_exposure_problem(gather(probe or Probe(), need_gpu=True))
        if problem:
            print(f"fovea: error: FOVEA_DEVICE={device} but {problem}", file=sys.stderr)
            return EXIT_NO_GPU
    if env.get("FOVEA_SKIP_DOCTOR") != "1":
        checked = subprocess.run(doctor_argv(device, args, env), check=False)
        if checked.returncode != 0:
            print("fovea: error: `fovea doctor` failed (above); not serving. FOVEA_SKIP_DOCTOR=1 skips it.",
                  file=sys.stderr)
            return checked.returncode
    serve = serve_argv(device, args, env)
    sys.stdout.flush()
    os.execvp(serve[0], serve)  # the server becomes the container's main process and gets its signals
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
