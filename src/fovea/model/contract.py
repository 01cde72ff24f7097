"""The model contract: everything that must agree for the image to reach the language model.

Built from the model directory and the loaded modules, checked before the first request:

- widths: vision features -> projector input; projector output -> language-model hidden size;
- the image token: in the tokenizer, with the id the model expects;
- the chat template: one placeholder per image;
- the expansion: the processor turns one placeholder into exactly as many image tokens as
  the vision stage returns rows for the processor's image size;
- placement: every parameter and buffer on the one configured device and dtype;
- the preprocessing recipe: equal to the model's own processor config (run-time overrides
  that touch normalisation are refused unless forced, and then reported);
- the vision output is finite on a probe image (a float16 vision stage that overflows is
  kept in bfloat16/float32 instead, and the hand-off casts explicitly).

Each violation names the part, the expected and actual values, and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

import torch
from transformers import AutoImageProcessor

from fovea.errors import ModelLoadError
from fovea.model.loader import LoadedModel, is_position_buffer
from fovea.model.vision import encode_images, vision_modules

log = logging.getLogger("fovea.contract")

RECIPE_FIELDS = ("do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale",
                 "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb")
# Fields whose change alters what the tower was trained to see (values and channel order).
NORMALISATION_FIELDS = frozenset({"do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                                  "do_convert_rgb"})


@dataclass(frozen=True)
class Violation:
    part: str
    expected: str
    actual: str
    fix: str

    def __str__(self) -> str:
        return f"{self.part}: expected {self.expected}, got {self.actual}. Fix: {self.fix}"


class ContractError(ModelLoadError):
    code = "model_contract_violated"

    def __init__(self, model: str, violations: list[Violation]) -> None:
        self.violations = violations
        lines = "\n  - ".join(str(v) for v in violations)
        super().__init__(f"{model} breaks the model contract ({len(violations)} problem(s)); "
                         f"refusing to serve:\n  - {lines}")


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):  # transformers' SizeDict
        value = {k: v for k, v in asdict(value).items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in sorted(value.items())}
    if hasattr(value, "value"):  # enums such as PILImageResampling
        return value.value
    if isinstance(value, float):
        return round(value, 8)
    return value


def recipe_of(image_processor: Any) -> dict[str, Any]:
    return {name: _jsonable(getattr(image_processor, name, None)) for name in RECIPE_FIELDS}


def fingerprint(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class ModelContract:
    model: str
    model_type: str
    device: str
    dtype: str
    vision_dtype: str
    vision_width: int
    projector_in: int
    projector_out: int
    lm_hidden: int
    image_token: str
    image_token_id: int
    tokens_per_image: int
    recipe: dict[str, Any]
    recipe_fingerprint: str
    model_fingerprint: str
    processor_override: dict[str, Any] = field(default_factory=dict)
    override_forced: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply_processor_override(loaded: LoadedModel, override: dict[str, Any], force: bool) -> list[str]:
    """Apply ``--processor-override``; normalisation changes need ``--force-processor-override``."""
    if not override:
        return []
    ip = loaded.processor.image_processor
    unknown = sorted(set(override) - set(RECIPE_FIELDS))
    if unknown:
        raise ModelLoadError(f"--processor-override names unknown field(s) {unknown}; allowed: {list(RECIPE_FIELDS)}.")
    changed = [k for k, v in override.items() if _jsonable(getattr(ip, k, None)) != _jsonable(v)]
    risky = sorted(set(changed) & NORMALISATION_FIELDS)
    if risky and not force:
        raise ContractError(loaded.name, [Violation(
            "preprocessing recipe",
            f"the model's own {', '.join(f'{k}={_jsonable(getattr(ip, k, None))}' for k in risky)}",
            f"an override setting {', '.join(f'{k}={_jsonable(override[k])}' for k in risky)}",
            "drop these fields from --processor-override (the vision tower was trained with the model's own "
            "normalisation), or add --force-processor-override if you really mean it")])
    for key, value in override.items():
        setattr(ip, key, value)
    if changed:
        log.warning("processor override applied to %s: %s%s", loaded.name,
                    {k: override[k] for k in changed}, " (forced: normalisation changed)" if risky else "")
    return changed


def model_fingerprint(loaded: LoadedModel) -> str:
    parts = [(loaded.path / "config.json").read_text()]
    for file in sorted(loaded.path.glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            parts.append(f.read(min(size, 50_000_000)).decode("utf-8", "replace"))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def probe_image():
    from fovea.demo import scenes

    scene = scenes.SceneSampler(min_shapes=3, jpeg_probability=0.0).sample(random.Random(4242))
    return scenes.render(scene)


def _placement_violations(loaded: LoadedModel, vision_dtype: torch.dtype) -> list[Violation]:
    tower, projector = vision_modules(loaded)
    vision_ids = {id(t) for m in (tower, projector) for t in list(m.parameters()) + list(m.buffers())}
    wrong: list[str] = []
    named = list(loaded.model.named_parameters()) + list(loaded.model.named_buffers())
    for name, tensor in named:
        want_dtype = vision_dtype if id(tensor) in vision_ids else loaded.dtype
        bad_device = tensor.device != loaded.device
        bad_dtype = tensor.is_floating_point() and tensor.dtype != want_dtype and not is_position_buffer(name)
        if bad_device or bad_dtype:
            wrong.append(f"{name} on {tensor.device}/{str(tensor.dtype).removeprefix('torch.')}")
    if not wrong:
        return []
    shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    return [Violation(
        "parameter placement",
        f"every parameter and buffer on {loaded.device} in {str(loaded.dtype).removeprefix('torch.')}",
        shown,
        "load the whole model with one --device and --dtype; do not move parts after loading "
        "(a split across devices must be declared, and fovea does not support one yet)")]


def check_contract(loaded: LoadedModel, *, override: dict[str, Any] | None = None,
                   force_override: bool = False) -> ModelContract:
    """Check everything; raise ContractError listing every violation, or return the contract."""
    changed = apply_processor_override(loaded, override or {}, force_override)
    config = loaded.model.config
    tokenizer = loaded.tokenizer
    tower, projector = vision_modules(loaded)
    violations: list[Violation] = []
    notes: list[str] = []

    # Widths along the hand-off.
    layers = config.vision_feature_layer
    n_layers = 1 if isinstance(layers, int) else len(layers)
    vision_width = int(config.vision_config.hidden_size) * n_layers
    linears = [m for m in projector.modules() if isinstance(m, torch.nn.Linear)]
    projector_in = linears[0].in_features if linears else -1
    projector_out = linears[-1].out_features if linears else -1
    lm_hidden = int(config.text_config.hidden_size)
    embed_width = loaded.model.get_input_embeddings().weight.shape[1]
    if projector_in != vision_width:
        violations.append(Violation(
            "projector input width", f"{vision_width} (vision hidden_size {config.vision_config.hidden_size} x "
            f"{n_layers} feature layer(s))", f"{projector_in} (first projector layer)",
            "use the projector trained for this vision tower, or fix vision_config / vision_feature_layer"))
    if projector_out != lm_hidden or embed_width != lm_hidden:
        violations.append(Violation(
            "projector output width", f"{lm_hidden} (language model hidden_size)",
            f"{projector_out} (last projector layer); token embeddings are {embed_width} wide",
            "use the projector trained for this language model, or fix text_config.hidden_size"))

    # The image token.
    image_token_id = tokenizer.convert_tokens_to_ids(loaded.image_token)
    if image_token_id is None or image_token_id == tokenizer.unk_token_id:
        violations.append(Violation("image token", f"{loaded.image_token!r} in the tokenizer's vocabulary",
                                    "not found (it maps to the unknown token)",
                                    "add the image token as a special token, as the model was trained"))
    elif image_token_id != loaded.image_token_id:
        violations.append(Violation("image token id", f"{loaded.image_token_id} (config.image_token_id)",
                                    f"{image_token_id} (tokenizer)", "make config.json and the tokenizer agree"))

    # The chat template: one placeholder per image.
    for n in (1, 2):
        content = [{"type": "image"}] * n + [{"type": "text", "text": "What is in the image?"}]
        try:
            text = loaded.processor.apply_chat_template([{"role": "user", "content": content}],
                                                        add_generation_prompt=True, tokenize=False)
            found = text.count(loaded.image_token)
        except Exception as exc:  # noqa: BLE001 - a broken template is a violation, not a crash
            found, text = -1, str(exc)
        if found != n:
            violations.append(Violation(
                "chat template", f"{n} {loaded.image_token!r} placeholder(s) for {n} image(s)",
                f"{found}" if found >= 0 else f"a template error ({text})",
                "use a chat template that emits the image token for every image part (the model's own)"))
            break

    # The recipe against the model's own processor config on disk.
    in_use = recipe_of(loaded.processor.image_processor)
    try:
        on_disk = recipe_of(AutoImageProcessor.from_pretrained(loaded.path, local_files_only=True))
    except Exception as exc:  # noqa: BLE001
        on_disk = in_use
        notes.append(f"could not re-read the image processor config: {exc}")
    differs = sorted(k for k in RECIPE_FIELDS if in_use[k] != on_disk[k] and k not in changed)
    if differs:
        violations.append(Violation(
            "preprocessing recipe", "the model's own processor config: " + ", ".join(f"{k}={on_disk[k]}" for k in differs),
            ", ".join(f"{k}={in_use[k]}" for k in differs),
            "serve with the processor from the model directory, or pass the change explicitly with "
            "--processor-override (and --force-processor-override for normalisation)"))
    forced = bool(set(changed) & NORMALISATION_FIELDS)
    if changed:
        notes.append(f"processor override in effect: {', '.join(f'{k}={in_use[k]}' for k in changed)}"
                     + (" (forced: normalisation differs from the model's)" if forced else ""))

    # Expansion, finiteness and width of the vision output on a probe image. The vision stage
    # may differ from the model dtype only when this check itself moved it (float16 overflow).
    vision_dtype = loaded.dtype
    tokens_per_image = -1
    if not any(v.part in ("projector input width", "chat template") for v in violations):
        try:
            tokens_per_image, vision_dtype = _probe_vision(loaded, violations, notes)
        except Exception as exc:  # noqa: BLE001 - any failure here is a contract failure
            violations.append(Violation("vision probe", "the vision stage to run on a probe image",
                                        f"{type(exc).__name__}: {exc}", "see the error; check the model files"))

    violations.extend(_placement_violations(loaded, vision_dtype))
    if violations:
        raise ContractError(loaded.name, violations)
    return ModelContract(
        model=loaded.name, model_type=config.model_type, device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."), vision_dtype=str(vision_dtype).removeprefix("torch."),
        vision_width=vision_width, projector_in=projector_in, projector_out=projector_out, lm_hidden=lm_hidden,
        image_token=loaded.image_token, image_token_id=loaded.image_token_id, tokens_per_image=tokens_per_image,
        recipe=in_use, recipe_fingerprint=fingerprint(in_use), model_fingerprint=model_fingerprint(loaded),
        processor_override={k: in_use[k] for k in changed}, override_forced=forced, notes=notes,
    )


def _probe_vision(loaded: LoadedModel, violations: list[Violation], notes: list[str]) -> tuple[int, torch.dtype]:
    processor = loaded.processor
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "probe"}]}],
        add_generation_prompt=True, tokenize=False)
    encoded = processor(text=text, images=[probe_image()], return_tensors="pt")
    expanded = int((encoded["input_ids"][0] == loaded.image_token_id).sum())
    pixels = encoded["pixel_values"].to(loaded.device, loaded.dtype)
    rows = encode_images(loaded, pixels)
    tower, projector = vision_modules(loaded)
    vision_dtype = loaded.dtype
    if not torch.isfinite(rows).all():
        if loaded.dtype == torch.float16 and next(tower.parameters()).dtype == torch.float16:
            safer = torch.bfloat16 if (loaded.device.type != "cuda" or torch.cuda.is_bf16_supported()) else torch.float32
            tower.to(safer)
            projector.to(safer)
            vision_dtype = safer
            rows = encode_images(loaded, pixels)
            if torch.isfinite(rows).all():
                vision_dtype = safer
                message = (f"vision output overflowed in float16; the vision tower and projector run in "
                           f"{str(safer).removeprefix('torch.')} and their output is cast to float16 at the hand-off")
                log.warning(message)
                notes.append(message)
        if not torch.isfinite(rows).all():
            violations.append(Violation("vision output", "finite values on a probe image",
                                        "NaN or infinity", "check the vision weights and dtype (try --dtype float32)"))
    if rows.shape[1] != expanded:
        violations.append(Violation(
            "image token expansion", f"{rows.shape[1]} image tokens per image (rows the vision stage returns)",
            f"{expanded} (tokens the processor inserts for one placeholder)",
            "make processor_config.json's patch_size / num_additional_image_tokens / "
            "vision_feature_select_strategy match the vision tower"))
    if rows.shape[-1] != loaded.model.get_input_embeddings().weight.shape[1]:
        violations.append(Violation("image embedding width", f"{loaded.model.get_input_embeddings().weight.shape[1]}",
                                    f"{rows.shape[-1]}", "fix the projector"))
    return expanded, vision_dtype
