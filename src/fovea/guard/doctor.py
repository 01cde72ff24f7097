"""`fovea doctor`: the environment checks plus the model directory's own checks."""

from __future__ import annotations

from pathlib import Path

import torch

from fovea.errors import FoveaError
from fovea.guard.checks import Check, Status
from fovea.guard.environment import environment_checks
from fovea.guard.memory import estimate_serving_bytes
from fovea.model.loader import default_model_dir, inspect_model_dir


def model_dir_check(path: Path) -> Check:
    try:
        config = inspect_model_dir(path)
    except FoveaError as exc:
        return Check("model.directory", Status.FAIL, exc.message,
                     "point --model at a local Hugging Face-format LLaVA directory")
    return Check("model.directory", Status.PASS, f"{path}: {config.get('model_type')} model with weights, "
                 "tokenizer, image processor and chat template")


def doctor_checks(model: Path | None = None, device: str = "auto") -> list[Check]:
    path = Path(model) if model else default_model_dir()
    need_gpu = True if device.startswith("cuda") else (False if device == "cpu" else None)
    try:
        # Serving in bf16 on a GPU: weights plus a fifth for activations (the KV cache is sized later).
        required = estimate_serving_bytes(path, torch.bfloat16)
    except FoveaError:
        required = None
    checks = environment_checks(need_gpu=need_gpu, required_gpu_bytes=required)
    checks.append(model_dir_check(path))
    return checks
