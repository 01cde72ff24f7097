"""`fovea doctor`: the environment checks plus the model directory's own checks."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import torch

from fovea.errors import FoveaError
from fovea.guard.checks import Check, Status
from fovea.guard.environment import environment_checks
from fovea.guard.memory import estimate_serving_bytes
from fovea.loading.loader import default_model_dir, inspect_model_dir, resolve_dtype


def model_dir_check(path: Path) -> Check:
    try:
        config = inspect_model_dir(path)
    except FoveaError as exc:
        return Check("model.directory", Status.FAIL, exc.message,
                     "point --model at a local Hugging Face-format directory of a supported family "
                     "(docs/models.md)")
    return Check("model.directory", Status.PASS, f"{path}: {config.get('model_type')} model with weights, "
                 "tokenizer, image processor and chat template")


def memory_plan_check(loaded, engine_config, report: dict | None) -> list[Check]:
    """Plan the memory as `fovea serve` would (on a GPU: profile, size the KV cache), check the
    engine against transformers' reference on a probe image, then let go."""
    from fovea.engine import PagedEngine

    try:
        engine = PagedEngine(loaded, engine_config)
    except FoveaError as exc:
        return [Check("memory.plan", Status.FAIL, exc.message,
                      "change the flag the message names, or free the GPU")]
    plan = engine.runner.memory_plan
    if report is not None:
        report["memory_plan"] = plan.to_dict()
    budget = f" of the {plan.budget_bytes / 2**30:.2f} GiB this process may hold" if plan.budget_bytes else ""
    checks = [Check("memory.plan", Status.PASS,
                    f"{plan.planned_bytes / 2**30:.2f} GiB planned on {plan.device}{budget}: "
                    + ", ".join(f"{line.name} {line.bytes / 2**30:.2f}" for line in plan.lines)
                    + f" GiB; KV cache {plan.kv_tokens} tokens")]
    checks.append(reference_check(loaded, engine))
    del engine
    return checks


def encoder_plan_check(path: Path, device: str, dtype: str) -> Check:
    """What an encode worker (`--topology e_pd`) would load and hold on this device."""
    from fovea.disagg.encode_worker import EncodeService
    from fovea.engine.config import GPU_MODEL_MIN_PARAMETERS, VISION_BATCH
    from fovea.guard.memory import estimate_weight_bytes
    from fovea.loading.loader import resolve_device

    # The vision stage a server would give its workers: fused on a GPU for 1 B+ parameters.
    fused = (resolve_device(device).type == "cuda"
             and estimate_weight_bytes(path, torch.bfloat16) / 2 >= GPU_MODEL_MIN_PARAMETERS)
    try:
        service = EncodeService(str(path), device, dtype, VISION_BATCH, fused_vision=fused, hold=False)
        part, plan = service.part, service.plan
    except FoveaError as exc:
        return Check("encoder.plan", Status.FAIL, exc.message,
                     "free memory on that GPU or give the encode worker another one (--topology e_pd)")
    return Check("encoder.plan", Status.PASS, f"{plan.render()}; it reads {part.parameters / 1e6:.1f} M vision "
                 "parameters and no language-model tensor")


def reference_check(loaded, engine) -> Check:
    """The engine's first-token log-probabilities on a probe image against transformers' own forward."""
    from fovea.engine.core.request import ErrorEvent, FinishEvent
    from fovea.engine.reference import reference_logits
    from fovea.engine.sampling.params import SamplingParams
    from fovea.guard.probe_images import probe_image
    from fovea.loading.contract import probe_chat

    prompt = loaded.codec.encode(loaded.codec.render(probe_chat(1, "probe")), [probe_image()])

    async def first_logprobs() -> torch.Tensor:
        engine.start()
        try:
            async for event in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                               want_first_logprobs=True):
                if isinstance(event, ErrorEvent):
                    raise event.error
                if isinstance(event, FinishEvent):
                    return event.first_logprobs
        finally:
            engine.stop()
        raise RuntimeError("the engine finished without an answer")

    try:
        ours = asyncio.run(first_logprobs()).float().cpu()
    except Exception as exc:  # noqa: BLE001 - a failing engine is this check's finding
        return Check("engine.reference", Status.FAIL, f"the engine could not answer a probe request: {exc}",
                     "run the tests on this machine (pytest tests/engine) and report the failure")
    ref = torch.log_softmax(reference_logits(loaded, prompt), -1).float().cpu()
    rel = float((ours - ref).norm() / ref.norm())
    tolerance = 1e-4 if loaded.dtype == torch.float32 else 1e-2
    detail = (f"first-token log-probs on a probe image within {rel:.1e} (relative) of transformers' forward "
              f"(tolerance {tolerance:.0e}); same top token: {int(ours.argmax()) == int(ref.argmax())}")
    if rel <= tolerance:
        return Check("engine.reference", Status.PASS, detail)
    return Check("engine.reference", Status.FAIL, detail,
                 "the engine and transformers disagree on this model: serve with --dtype float32 to see whether "
                 "precision explains it, and report it")


def contract_checks(path: Path, device: str, dtype: str, engine_config=None,
                    report: dict | None = None) -> list[Check]:
    """Load the model as `fovea serve` would, check its contract and plan its memory."""
    from fovea.loading.contract import ContractError, check_contract
    from fovea.loading.loader import load_model

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
    checks.append(Check("model.quantization", Status.PASS,
                        f"{contract.quantization}: {contract.quantized_layers} decoder linear layers quantized; "
                        f"vision tower and projector in {contract.vision_dtype}" if contract.quantization is not None
                        else f"unquantized weights in {contract.dtype}"))
    for note in contract.notes:
        checks.append(Check("contract.note", Status.WARN, note, ""))
    if engine_config is not None:
        checks.extend(memory_plan_check(loaded, engine_config, report))
    del loaded  # the encode worker's plan is measured without the full model beside it
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    checks.append(encoder_plan_check(path, device, dtype))
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
