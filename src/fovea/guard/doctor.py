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


def contract_checks(path: Path, device: str, dtype: str) -> list[Check]:
    """Load the model as `fovea serve` would and check its contract."""
    from fovea.model.contract import ContractError, check_contract
    from fovea.model.loader import load_model

    try:
        loaded = load_model(path, device, dtype)
    except FoveaError as exc:
        return [Check("model.load", Status.FAIL, exc.message, "fix the model directory or --device/--dtype")]
    checks = [Check("model.load", Status.PASS, f"loaded on {loaded.device} in "
                    f"{str(loaded.dtype).removeprefix('torch.')} in {loaded.load_seconds:.1f} s")]
    try:
        contract = check_contract(loaded)
    except ContractError as exc:
        for v in exc.violations:
            checks.append(Check(f"contract.{v.part.replace(' ', '_')}", Status.FAIL,
                                f"expected {v.expected}, got {v.actual}", v.fix))
        return checks
    checks.append(Check("contract", Status.PASS,
                        f"widths {contract.vision_width}->{contract.projector_in}, {contract.projector_out}="
                        f"{contract.lm_hidden}; {contract.tokens_per_image} image tokens per image; recipe "
                        f"{contract.recipe_fingerprint}; all on {contract.device}/{contract.dtype}"))
    for note in contract.notes:
        checks.append(Check("contract.note", Status.WARN, note, ""))
    return checks


def doctor_checks(model: Path | None = None, device: str = "auto", dtype: str = "auto") -> list[Check]:
    path = Path(model) if model else default_model_dir()
    need_gpu = True if device.startswith("cuda") else (False if device == "cpu" else None)
    try:
        # Serving in bf16 on a GPU: weights plus a fifth for activations (the KV cache is sized later).
        required = estimate_serving_bytes(path, torch.bfloat16)
    except FoveaError:
        required = None
    checks = environment_checks(need_gpu=need_gpu, required_gpu_bytes=required)
    directory = model_dir_check(path)
    checks.append(directory)
    if directory.status is Status.PASS:
        checks.extend(contract_checks(path, device, dtype))
    return checks
