"""The model contract: everything that must agree for the image to reach the language model.

Built from the model directory and the loaded modules, checked before the first request:

- widths: vision features -> projector input; projector output -> language-model hidden size;
- the image token: in the tokenizer, with the id the model expects;
- the chat template: one placeholder per image;
- the same prompt everywhere: fovea's token ids for a chat equal transformers'
  ``apply_chat_template(..., tokenize=True)`` with the model's own processor;
- the expansion: each image's placeholder becomes exactly as many image tokens as the vision
  stage returns rows for it (probe images of two sizes: dynamic-resolution families differ);
- placement: every parameter and buffer on the one configured device and dtype;
- the preprocessing recipe: equal to the model's own processor config (run-time overrides
  that touch normalisation are refused unless forced, and then reported); and where a family
  splits the processor (Qwen-VL: the resize in the API process, rescale, normalisation and
  patches in the vision stage), both halves together equal the processor's own output on the
  probe images, bit for bit;
- the vision output is finite on a probe image (a float16 vision stage that overflows is
  kept in bfloat16/float32 instead, and the hand-off casts explicitly).

Each violation names the part, the expected and actual values, and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoImageProcessor

from fovea.errors import ModelLoadError
from fovea.guard.probe_images import probe_image
from fovea.loading.loader import LoadedModel, is_position_buffer
from fovea.models.base import EncodedPrompt

log = logging.getLogger("fovea.contract")

# Each family names its recipe's fields and, of those, the ones whose change alters what the
# tower was trained to see (values and channel order): ModelAdapter.recipe_fields / normalisation_fields.
PROBE_SIZES = ((256, 256), (200, 120))


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


def recipe_of(image_processor: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    return {name: _jsonable(getattr(image_processor, name, None)) for name in fields}


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
    # Image tokens of each probe image (PROBE_SIZES): equal for fixed-resolution families.
    probe_image_tokens: list[int]
    recipe: dict[str, Any]
    recipe_fingerprint: str
    model_fingerprint: str
    processor_override: dict[str, Any] = field(default_factory=dict)
    override_forced: bool = False
    notes: list[str] = field(default_factory=list)
    quantization: str | None = None  # the checkpoint's format (its label); None: unquantized
    quantized_layers: int = 0
    load_format: str = "auto"  # "dummy": random weights (the canary means nothing)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply_processor_override(loaded: LoadedModel, override: dict[str, Any], force: bool) -> list[str]:
    """Apply ``--processor-override``; normalisation changes need ``--force-processor-override``."""
    if not override:
        return []
    ip = loaded.codec.image_processor
    fields = loaded.adapter.recipe_fields
    unknown = sorted(set(override) - set(fields))
    if unknown:
        raise ModelLoadError(f"--processor-override names unknown field(s) {unknown}; allowed: {list(fields)}.")
    changed = [k for k, v in override.items() if _jsonable(getattr(ip, k, None)) != _jsonable(v)]
    risky = sorted(set(changed) & loaded.adapter.normalisation_fields)
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
    return directory_fingerprint(loaded.path)


def directory_fingerprint(path: Path) -> str:
    """The model directory's config and safetensors headers (names, shapes, offsets), hashed."""
    parts = [(path / "config.json").read_text()]
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            parts.append(f.read(min(size, 50_000_000)).decode("utf-8", "replace"))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _placement_violations(loaded: LoadedModel, vision_dtype: torch.dtype) -> list[Violation]:
    vision_ids = {id(t) for m in loaded.adapter.vision_modules(loaded.model)
                  for t in list(m.parameters()) + list(m.buffers())}
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
    adapter, codec = loaded.adapter, loaded.codec
    config = loaded.model.config
    tokenizer = loaded.tokenizer
    violations: list[Violation] = []
    notes: list[str] = []

    # Widths along the hand-off.
    widths = adapter.widths(loaded.model)
    embed_width = loaded.model.get_input_embeddings().weight.shape[1]
    if widths.projector_in != widths.vision_width:
        violations.append(Violation(
            "projector input width", f"{widths.vision_width} ({widths.explain_in})",
            f"{widths.projector_in} (first projector layer)", widths.fix_in))
    if widths.projector_out != widths.lm_hidden or embed_width != widths.lm_hidden:
        violations.append(Violation(
            "projector output width", f"{widths.lm_hidden} (language model hidden_size)",
            f"{widths.projector_out} (last projector layer); token embeddings are {embed_width} wide",
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
        try:
            text = codec.render(probe_chat(n))
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
    fields = adapter.recipe_fields
    in_use = recipe_of(codec.image_processor, fields)
    try:
        on_disk = recipe_of(AutoImageProcessor.from_pretrained(loaded.path, local_files_only=True), fields)
    except Exception as exc:  # noqa: BLE001
        on_disk = in_use
        notes.append(f"could not re-read the image processor config: {exc}")
    differs = sorted(k for k in fields if in_use[k] != on_disk[k] and k not in changed)
    if differs:
        violations.append(Violation(
            "preprocessing recipe", "the model's own processor config: " + ", ".join(f"{k}={on_disk[k]}" for k in differs),
            ", ".join(f"{k}={in_use[k]}" for k in differs),
            "serve with the processor from the model directory, or pass the change explicitly with "
            "--processor-override (and --force-processor-override for normalisation)"))
    # The preprocessing as it is done (Qwen-VL: resized in the API process or, on CUDA, in the vision
    # stage, rescaled, normalised and patched in the vision stage) against the image processor's own
    # output, bit for bit.
    try:
        problem = adapter.preprocessing_problem(loaded, [probe_image(*size, seed=i)
                                                         for i, size in enumerate(PROBE_SIZES)])
    except Exception as exc:  # noqa: BLE001 - a failure here is a contract failure
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        violations.append(Violation(
            "preprocessing path", "the image processor's own pixel_values and grids for the probe images, bit for bit",
            problem, "fovea's split of the processor (resize on the host or the device, normalisation on the device) disagrees "
            "with this processor: report it with the processor's class and transformers' version"))
    forced = bool(set(changed) & adapter.normalisation_fields)
    if changed:
        notes.append(f"processor override in effect: {', '.join(f'{k}={in_use[k]}' for k in changed)}"
                     + (" (forced: normalisation differs from the model's)" if forced else ""))

    # The same prompt as transformers builds, then expansion, finiteness and width of the vision
    # output on probe images. The vision stage may differ from the model dtype only when this
    # check itself moved it (float16 overflow).
    vision_dtype = loaded.dtype
    probe_tokens: list[int] = []
    if not any(v.part in ("projector input width", "chat template") for v in violations):
        try:
            violations.extend(prompt_equality_violations(loaded))
            violations.extend(position_violations(loaded))
            probe_tokens, vision_dtype = _probe_vision(loaded, violations, notes)
        except Exception as exc:  # noqa: BLE001 - any failure here is a contract failure
            violations.append(Violation("vision probe", "the vision stage to run on a probe image",
                                        f"{type(exc).__name__}: {exc}", "see the error; check the model files"))

    violations.extend(_placement_violations(loaded, vision_dtype))
    quantized = quantization_violations(loaded, violations)
    if loaded.load_format == "dummy":
        notes.append("--load-format dummy: the weights are random; answers and the canary mean nothing")
    if violations:
        raise ContractError(loaded.name, violations)
    return ModelContract(
        model=loaded.name, model_type=config.model_type, device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."), vision_dtype=str(vision_dtype).removeprefix("torch."),
        vision_width=widths.vision_width, projector_in=widths.projector_in, projector_out=widths.projector_out,
        lm_hidden=widths.lm_hidden, image_token=loaded.image_token, image_token_id=loaded.image_token_id,
        probe_image_tokens=probe_tokens, recipe=in_use, recipe_fingerprint=fingerprint(in_use),
        model_fingerprint=model_fingerprint(loaded), processor_override={k: in_use[k] for k in changed},
        override_forced=forced, notes=notes,
        quantization=loaded.quantization.label if loaded.quantization is not None else None,
        quantized_layers=quantized, load_format=loaded.load_format,
    )


def quantization_violations(loaded: LoadedModel, violations: list[Violation]) -> int:
    """Quantized layers only where fovea runs them (the language model's decoder): the vision
    tower and projector stay in the served dtype, as every supported format leaves them. Returns
    how many layers are quantized."""
    from fovea.loading.quantized import quantized_linears

    layers = quantized_linears(loaded.model)
    if loaded.quantization is None:
        if layers:
            violations.append(Violation("quantization", "no quantized layers (config.json has no quantization_config)",
                                        f"{len(layers)}, e.g. {next(iter(layers))}", "report this: a loader bug"))
        return 0
    decoder = loaded.adapter.lm_spec(loaded.model).language_model.layers
    inside = {id(m) for m in decoder.modules()}
    outside = sorted(name for name, m in layers.items() if id(m) not in inside)
    if outside:
        violations.append(Violation(
            "quantized layers", "the language model's decoder layers only (vision tower, projector and lm_head "
            f"in {str(loaded.dtype).removeprefix('torch.')})",
            f"{len(outside)} outside it, e.g. {', '.join(outside[:3])}",
            "use a checkpoint that leaves the vision tower and projector unquantized (its recipe's ignore list)"))
    if not layers:
        violations.append(Violation("quantized layers", f"the decoder's linear layers in {loaded.quantization.label}",
                                    "none found in the checkpoint's tensors",
                                    "the config says quantized but the weights are not: fix config.json"))
    return len(layers)


def deepstack_levels(loaded: LoadedModel) -> int:
    return int(loaded.adapter.lm_spec(loaded.model).deepstack_layers)


def vision_row_width(loaded: LoadedModel) -> int:
    """Width of one image token's row from the vision stage (what an encode worker hands over):
    the LM's hidden size, times 1 + the DeepStack levels for DeepStack families."""
    return int(loaded.model.get_input_embeddings().weight.shape[1]) * (1 + deepstack_levels(loaded))


def probe_chat(images: int, text: str = "What is in the image?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


def prompt_equality_violations(loaded: LoadedModel) -> list[Violation]:
    """fovea's token ids for a chat against transformers' own, with 0, 1 and 2 images."""
    codec = loaded.codec
    out = []
    for n in (0, 1, 2):
        messages = probe_chat(n, "probe")
        images = [probe_image(*size, seed=i) for i, size in enumerate(PROBE_SIZES[:n])]
        ours = codec.encode(codec.render(messages), images).input_ids
        theirs = codec.reference_ids(messages, images)
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            out.append(Violation(
                "prompt token ids", f"transformers' apply_chat_template(tokenize=True) ids ({len(theirs)} tokens)",
                f"{len(ours)} tokens, first difference at position {first} "
                f"({ours[first:first + 3]} vs {theirs[first:first + 3]}) with {n} image(s)",
                "fovea and transformers must build the same prompt: check the chat template's BOS handling "
                "and the tokenizer's add_special_tokens"))
            break
    return out


def position_violations(loaded: LoadedModel) -> list[Violation]:
    """M-RoPE families: the codec's position rows for a two-image prompt against transformers'."""
    images = [probe_image(*size, seed=i) for i, size in enumerate(PROBE_SIZES)]
    prompt = loaded.codec.encode(loaded.codec.render(probe_chat(len(images), "probe")), images)
    theirs = loaded.adapter.reference_positions(loaded.model, prompt, loaded.image_token_id)
    if theirs is None or (prompt.positions, prompt.position_delta) == theirs:
        return []
    return [Violation("position ids", f"transformers' get_rope_index rows (delta {theirs[1]})",
                      f"fovea's rows (delta {prompt.position_delta}), which differ",
                      "the family's adapter computes M-RoPE positions differently from this transformers "
                      "version; report it (answers would ignore where things are in the image)")]


def _probe_vision(loaded: LoadedModel, violations: list[Violation], notes: list[str]) -> tuple[list[int], torch.dtype]:
    codec, adapter = loaded.codec, loaded.adapter
    images = [probe_image(*size, seed=i) for i, size in enumerate(PROBE_SIZES)]
    prompt = codec.encode(codec.render(probe_chat(len(images), "probe")), images)
    expanded = sum(1 for t in prompt.input_ids if t == loaded.image_token_id)
    encode = adapter.vision_forward(loaded)
    rows = _encode(loaded, encode, prompt)
    vision_dtype = loaded.dtype
    if not all(torch.isfinite(r).all() for r in rows):
        modules = adapter.vision_modules(loaded.model)
        if loaded.dtype == torch.float16 and next(modules[0].parameters()).dtype == torch.float16:
            safer = torch.bfloat16 if (loaded.device.type != "cuda" or torch.cuda.is_bf16_supported()) else torch.float32
            for module in modules:
                module.to(safer)
            rows = _encode(loaded, encode, prompt)
            if all(torch.isfinite(r).all() for r in rows):
                vision_dtype = safer
                message = (f"vision output overflowed in float16; the vision stage runs in "
                           f"{str(safer).removeprefix('torch.')} and its output is cast to float16 at the hand-off")
                log.warning(message)
                notes.append(message)
        if not all(torch.isfinite(r).all() for r in rows):
            violations.append(Violation("vision output", "finite values on a probe image",
                                        "NaN or infinity", "check the vision weights and dtype (try --dtype float32)"))
    returned = [int(r.shape[0]) for r in rows]
    if returned != prompt.image_token_counts or sum(returned) != expanded:
        violations.append(Violation(
            "image token expansion", f"{returned} image tokens for the probe images (rows the vision stage returns)",
            f"{prompt.image_token_counts} (tokens the processor inserts; {expanded} image tokens in the prompt)",
            "make the processor config (patch_size, merge_size, num_additional_image_tokens, "
            "vision_feature_select_strategy) match the vision tower"))
    # DeepStack families return the embedding and each feature level side by side.
    embed_width = vision_row_width(loaded)
    if any(r.shape[-1] != embed_width for r in rows):
        violations.append(Violation("image embedding width", f"{embed_width}", f"{rows[0].shape[-1]}",
                                    "fix the projector"))
    return returned, vision_dtype


def _encode(loaded: LoadedModel, encode, prompt: EncodedPrompt) -> list[torch.Tensor]:
    images = [dataclasses.replace(image, pixels=image.pixels.to(loaded.device)) for image in prompt.images]
    with torch.inference_mode():
        return encode(images)
