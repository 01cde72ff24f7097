"""Load a local Hugging Face VLM directory onto one device in one dtype, through its family's adapter.

Nothing is downloaded: every transformers call uses ``local_files_only`` and fovea sets
``HF_HUB_OFFLINE=1`` on import. A directory that cannot be served is refused up front
with a ``ModelLoadError`` that names what is missing and how to fix it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fovea.errors import ModelLoadError
from fovea.models import ModelAdapter, PromptCodec, adapter_for, supported_model_types
from fovea.progress import progress
from fovea.quant.formats import QuantFormat, read_format

log = logging.getLogger("fovea.model")

# Package data: in a checkout a symlink to models/fovea-shapes, in an installed wheel the files themselves.
DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model" / "fovea-shapes"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    path: Path
    name: str
    model: Any  # the family's transformers model (LlavaForConditionalGeneration, ...)
    processor: Any  # the model's own processor (or, for Qwen2.5-VL, its tokenizer and image processor)
    device: torch.device
    dtype: torch.dtype
    image_token_id: int
    image_token: str
    context_length: int
    load_seconds: float
    adapter: ModelAdapter
    codec: PromptCodec  # builds this model's prompts (picklable: worker processes get a copy)
    quantization: QuantFormat | None = None  # the checkpoint's format (None: unquantized weights)
    load_format: str = "auto"  # "dummy": random weights of the config's shapes and format

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def model_type(self) -> str:
        return str(self.model.config.model_type)

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        if ids is None:
            ids = self.tokenizer.eos_token_id
        return set(ids if isinstance(ids, list) else [ids])


def default_model_dir() -> Path:
    """The shipped demo model: inside the package (wheel or checkout), else under the working directory."""
    for candidate in (DEMO_MODEL_DIR, Path.cwd() / "models" / "fovea-shapes"):
        if (candidate / "config.json").is_file():
            return candidate
    return DEMO_MODEL_DIR


def resolve_device(name: str = "auto", flag: str = "--device") -> torch.device:
    """The device to load on, with a concrete index for CUDA: tensors report ``cuda:0``, never
    ``cuda``, so comparing a tensor's device with this one must not depend on how it was spelt.
    ``flag``: the option that asked for it, named in the errors."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ModelLoadError(
            f"{flag} {name} was asked for but torch sees no CUDA GPU "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). "
            f"Run `fovea doctor` to see why, or use {flag} cpu."
        )
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"{flag} {name} was asked for but torch sees {torch.cuda.device_count()} CUDA GPU(s) "
            f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}). Pick one of those, or check CUDA_VISIBLE_DEVICES."
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"--dtype {name!r} is not one of auto, {', '.join(DTYPES)}.")
    return DTYPES[name]


LOAD_FORMATS = ("auto", "dummy")


def inspect_model_dir(path: Path, load_format: str = "auto") -> dict:
    """Check the directory holds a servable model; return its config.json. ``load_format``
    "dummy" needs no weight files (random weights are made on the device)."""
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist (pass --model DIR, a local "
                             "Hugging Face-format model directory).")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory: config.json is missing.")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}.") from exc
    model_type = config.get("model_type")
    if adapter_for(model_type) is None:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} is not supported; fovea serves "
            f"{', '.join(supported_model_types())} models (see docs/models.md to add a family)."
        )
    read_format(config)  # a quantization format fovea does not run is refused here, in one line
    missing = []
    if load_format != "dummy" and not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        missing.append("weights (model.safetensors or model.safetensors.index.json)")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        missing.append("tokenizer (tokenizer.json or tokenizer.model)")
    if not ((path / "preprocessor_config.json").is_file() or (path / "processor_config.json").is_file()):
        missing.append("image processor (preprocessor_config.json)")
    if not has_chat_template(path):
        missing.append("chat template (chat_template.jinja, chat_template.json, or chat_template in tokenizer_config.json)")
    if missing:
        raise ModelLoadError(f"{path} cannot be served; missing: {'; '.join(missing)}.")
    return config


def has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    for name in ("tokenizer_config.json", "processor_config.json"):
        file = path / name
        if file.is_file() and "chat_template" in json.loads(file.read_text()):
            return True
    return False


def is_position_buffer(name: str) -> bool:
    """Buffers of positional constants that are computed, not learned, and kept in float32."""
    return name.endswith("inv_freq")


def refuse_partial_load(path: Path, info: dict) -> None:
    """transformers re-initialises weights it could not load (missing, or of the wrong shape)
    with a warning; served, such a model answers fluently from random vision weights."""
    mismatched = [f"{key} (checkpoint {tuple(old)} vs config {tuple(new)})"
                  for key, old, new in info.get("mismatched_keys") or []]
    missing = sorted(info.get("missing_keys") or [])
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) do not fit the config's shapes, e.g. {'; '.join(mismatched[:3])}")
    if missing:
        problems.append(f"{len(missing)} weight(s) are missing from the checkpoint, e.g. {', '.join(missing[:3])}")
    if problems:
        raise ModelLoadError(
            f"transformers could not load {path} as-is: " + "; ".join(problems)
            + ". They would be randomly initialised. Fix config.json (widths, layers) or the weights.")
    unexpected = info.get("unexpected_keys") or []
    if unexpected:
        log.warning("%s: %d checkpoint tensor(s) unused by the model, e.g. %s", path, len(unexpected), unexpected[:3])


def load_model(path: str | Path | None = None, device: str = "auto", dtype: str = "auto",
               weights: bool = True, load_format: str = "auto") -> LoadedModel:
    """``weights=False``: the model's structure on the meta device, no weight read (the API process
    of a server whose engine core holds the weights: its config, generation config, processor and
    codec are what it needs). ``load_format="dummy"``: random weights of the config's shapes and
    quantization format, made on the device (benchmarks and capacity planning of shapes whose
    files are not at hand); nothing it answers means anything."""
    started = time.perf_counter()
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"--load-format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}.")
    path = Path(path) if path else default_model_dir()
    path = path.expanduser().resolve()
    config = inspect_model_dir(path, load_format)
    quantization = read_format(config)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    adapter = adapter_for(config["model_type"])
    assert adapter is not None  # inspect_model_dir refused the others
    model_class = adapter.model_class()
    stages = progress(total=3, desc=f"loading {path.name}", unit="stage", leave=False)
    try:
        stages.set_postfix_str("processor")
        processor = adapter.load_processor(path)
        stages.update()
        stages.set_postfix_str("weights")
        info = None
        if not weights:
            model = structure_only(model_class, path, torch_dtype)
        elif load_format == "dummy":
            from fovea.loading.dummy import dummy_model

            model = dummy_model(model_class, path, quantization, torch_device, torch_dtype)
        elif quantization is not None:
            from fovea.loading.quantized import load_quantized

            model = load_quantized(model_class, path, hf_config(path), quantization, torch_device, torch_dtype)
            model.generation_config = generation_config(path, model.config)
        else:
            model, info = model_class.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                      output_loading_info=True)
        stages.update()
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        stages.close()
        raise ModelLoadError(f"transformers could not load {path}: {exc}") from exc
    if info is not None:
        refuse_partial_load(path, info)
    stages.set_postfix_str(f"to {torch_device}")
    # One device for everything and one dtype for every weight: the vision tower can never be
    # left behind on another device or in another precision. Rotary-frequency buffers stay in
    # float32 (transformers computes positions with them in float32; in bfloat16 the angle at
    # position 640 is off by about a radian). A quantized layer's weight is not a parameter: its
    # FP8 or int4 tensors keep their format.
    model.to(device=torch_device if weights else "meta").eval()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and tensor.dtype != torch_dtype and not is_position_buffer(name):
            tensor.data = tensor.data.to(torch_dtype)
    tokenizer = processor.tokenizer
    image_token, image_token_id = adapter.image_token(processor, model.config)
    if tokenizer.convert_tokens_to_ids(image_token) != image_token_id:
        raise ModelLoadError(
            f"{path}: the processor's image token {image_token!r} has id "
            f"{tokenizer.convert_tokens_to_ids(image_token)} in the tokenizer, but the model "
            f"expects image_token_id {image_token_id}. Fix config.json or the tokenizer."
        )
    stages.update()
    stages.close()
    text_config = model.config.text_config
    loaded = LoadedModel(
        path=path,
        name=path.name,
        model=model,
        processor=processor,
        device=torch_device,
        dtype=torch_dtype,
        image_token_id=image_token_id,
        image_token=image_token,
        context_length=int(getattr(text_config, "max_position_embeddings", 4096)),
        load_seconds=time.perf_counter() - started,
        adapter=adapter,
        codec=adapter.codec(processor, image_token_id, torch_dtype),
        quantization=quantization,
        load_format=load_format,
    )
    if hasattr(loaded.codec, "resize_on_device"):  # Qwen-VL: the image resize on the GPU (models.qwen_pixels)
        loaded.codec.resize_on_device = torch_device.type == "cuda"
        if loaded.codec.resize_on_device:
            import PIL

            from fovea.models.pil_resize import pillow_rule

            rule = pillow_rule()  # found now (~30 ms), not on the first request
            # said once, by the engine's load (an API process reads the codec without weights)
            if weights and rule is None:
                log.warning("images are resized in the API process: fovea's device resize does not match "
                            "Pillow %s's bicubic resize (fovea.models.pil_resize)", PIL.__version__)
            elif weights:
                log.info("Qwen-VL images are resized on %s, bit for bit as Pillow %s does it (pass order: %s)",
                         torch_device, PIL.__version__, rule)
    if not weights:
        return loaded
    log.info(
        "loaded %s (%s, %.1f M parameters%s) on device=%s dtype=%s in %.1f s%s",
        loaded.name, config["model_type"], sum(p.numel() for p in model.parameters()) / 1e6,
        "" if quantization is None else f" beside the quantized layers: {quantization.label}",
        torch_device, str(torch_dtype).removeprefix("torch."), loaded.load_seconds,
        "; --load-format dummy: RANDOM weights, answers mean nothing" if load_format == "dummy" else "",
    )
    return loaded


def hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def generation_config(path: Path, config):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # no generation_config.json: what from_pretrained would derive
        return GenerationConfig.from_model_config(config)


def structure_only(model_class: type, path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The model built on the meta device from its config, with its generation config: every
    module and shape, no memory, nothing read but the JSON files."""
    config = hf_config(path)
    if hasattr(config, "quantization_config"):  # fovea's loader reads the format, not transformers
        del config.quantization_config
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    model.generation_config = generation_config(path, config)
    return model


def load_codec(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               load_format: str = "auto") -> PromptCodec:
    """The model's prompt codec alone: its processor and config, no weights (start-up checks
    that need prompt lengths before the weights are loaded). ``load_format`` "dummy": the
    directory may hold no weight files."""
    from transformers import AutoConfig

    path = (Path(path) if path else default_model_dir()).expanduser().resolve()
    inspect_model_dir(path, load_format)
    adapter = adapter_for(json.loads((path / "config.json").read_text())["model_type"])
    assert adapter is not None  # inspect_model_dir refused the others
    try:
        processor = adapter.load_processor(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"transformers could not load {path}'s processor: {exc}") from exc
    _, image_token_id = adapter.image_token(processor, config)
    return adapter.codec(processor, image_token_id, dtype)
