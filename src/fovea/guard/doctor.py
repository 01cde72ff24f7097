"""`fovea doctor`: the environment checks plus the model directory's own checks."""

from __future__ import annotations

from pathlib import Path

import torch

from fovea.errors import FoveaError
from fovea.guard.checks import Check, Status
from fovea.guard.environment import environment_checks
from fovea.guard.memory import estimate_serving_bytes
from fovea.model.loader import default_model_dir, inspect_model_dir, resolve_dtype


def model_dir_check(path: Path) -> Check:
    try:
        config = inspect_model_dir(path)
    except FoveaError as exc:
        return Check("model.directory", Status.FAIL, exc.message,
                     "point --model at a local Hugging Face-format LLaVA directory")
    return Check("model.directory", Status.PASS, f"{path}: {config.get('model_type')} model with weights, "
                 "tokenizer, image processor and chat template")


def memory_plan_check(loaded, engine_config, report: dict | None) -> Check:
    """Plan the memory as `fovea serve` would (on a GPU: profile, size the KV cache), then let go."""
    from fovea.engine.paged import PagedEngine

    try:
        engine = PagedEngine(loaded, engine_config)
    except FoveaError as exc:
        return Check("memory.plan", Status.FAIL, exc.message,
                     "change the flag the message names, or free the GPU")
    plan = engine.runner.memory_plan
    del engine
    if report is not None:
        report["memory_plan"] = plan.to_dict()
    budget = f" of the {plan.budget_bytes / 2**30:.2f} GiB this process may hold" if plan.budget_bytes else ""
    return Check("memory.plan", Status.PASS,
                 f"{plan.planned_bytes / 2**30:.2f} GiB planned on {plan.device}{budget}: "
                 + ", ".join(f"{line.name} {line.bytes / 2**30:.2f}" for line in plan.lines)
                 + f" GiB; KV cache {plan.kv_tokens} tokens")


def contract_checks(path: Path, device: str, dtype: str, engine_config=None,
                    report: dict | None = None) -> list[Check]:
    """Load the model as `fovea serve` would, check its contract and plan its memory."""
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
                        f"{contract.lm_hidden}; {loaded.adapter.family.name}: probe images of {contract.probe_image_tokens} "
                        f"image tokens; prompt ids equal transformers'; recipe "
                        f"{contract.recipe_fingerprint}; all on {contract.device}/{contract.dtype}"))
    for note in contract.notes:
        checks.append(Check("contract.note", Status.WARN, note, ""))
    if engine_config is not None:
        checks.append(memory_plan_check(loaded, engine_config, report))
    return checks


def serving_dtype(device: str, dtype: str) -> torch.dtype:
    """The dtype `fovea serve --device D --dtype T` would load in (auto: bfloat16 on a GPU)."""
    if dtype != "auto":
        return resolve_dtype(dtype, torch.device("cpu"))
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return torch.bfloat16 if on_gpu else torch.float32


def doctor_checks(model: Path | None = None, device: str = "auto", dtype: str = "auto", engine_config=None,
                  report: dict | None = None) -> list[Check]:
    """The environment's checks, the model directory's, its contract's, and (with an
    ``engine_config``) its memory plan's; ``report`` receives the plan itself."""
    path = Path(model) if model else default_model_dir()
    need_gpu = True if device.startswith("cuda") else (False if device == "cpu" else None)
    try:
        # Weights in the dtype serving would use plus a fifth for activations (the plan sizes the rest).
        required = estimate_serving_bytes(path, serving_dtype(device, dtype))
    except (FoveaError, ValueError):
        required = None
    checks = environment_checks(need_gpu=need_gpu, required_gpu_bytes=required)
    directory = model_dir_check(path)
    checks.append(directory)
    if directory.status is Status.PASS:
        checks.extend(contract_checks(path, device, dtype, engine_config, report))
    return checks
