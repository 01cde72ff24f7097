"""Loading a quantized checkpoint (compressed-tensors, fine-grained FP8, AWQ) as it was downloaded.

transformers would need each format's own package (and often a GPU) to load these, and would
hand fovea its own layer types. fovea instead builds the model's structure with its parameters
on the meta device, reads every tensor from the safetensors files itself, and:

- gives each quantized linear module a ``QuantLinear`` that holds fovea's weight object
  (``fovea.quant.weights``: FP8 or int4, converted to one layout at load);
- puts every other tensor (vision tower, projector, embeddings, norms, ``lm_head``, any linear
  the format left unquantized) on the device in the served dtype, as an unquantized load does.

Checkpoint names are mapped to the model's with transformers' own renaming rules
(``conversion_mapping``), so old and new key layouts (``model.layers`` / ``model.language_model``)
both load. A parameter the checkpoint does not give is refused, never left random.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fovea.errors import ModelLoadError
from fovea.guard.memory import safetensors_files
from fovea.quant.formats import QuantFormat
from fovea.quant.readers import quantized_prefixes, read_linear
from fovea.quant.weights import Fp8Weight, Int4Weight, QuantWeight, dequantized_linear

log = logging.getLogger("fovea.model")


class QuantLinear(nn.Module):
    """A linear layer whose weight is quantized (``quant``). Its forward dequantises the weight
    for the call (the reference path that transformers' own forward takes: tests, ``fovea
    doctor``); the engine reads ``quant`` and runs its kernels on it."""

    def __init__(self, quant: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.quant = quant
        self.in_features, self.out_features = quant.in_features, quant.out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, made on each access (code outside fovea that reads ``.weight``)."""
        dtype = self.bias.dtype if self.bias is not None else quant_dtype(self.quant)
        return self.quant.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dequantized_linear(x, self.quant, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {type(self.quant).__name__}"


def quant_dtype(quant: QuantWeight) -> torch.dtype:
    """The floating dtype a weight dequantises to when no activation says so."""
    return quant.scales.dtype if isinstance(quant, Int4Weight) else torch.bfloat16


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory), while buffers
    (rotary frequencies, position ids) are computed for real: they are not in the checkpoint."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class CheckpointTensors:
    """Every tensor of a directory's safetensors files, by name, opened lazily."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.files = safetensors_files(path)
        if not self.files:
            raise ModelLoadError(f"{path} holds no safetensors weights")
        self._handles = [safe_open(str(f), framework="pt") for f in self.files]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor | None:
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)


def renamer(model: nn.Module) -> Callable[[str], str]:
    """Checkpoint name -> the model's parameter name, by transformers' own rules for this model."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = dict.fromkeys(n for n, _ in model.named_parameters())
    names.update(dict.fromkeys(n for n, _ in model.named_buffers()))
    prefix = getattr(model, "base_model_prefix", None)

    def rename(name: str) -> str:
        renamed, converter = rename_source_key(name, renamings, converters, prefix, names)
        if converter is not None:  # a tensor that transformers would split or merge: not a plain copy
            raise ModelLoadError(f"checkpoint tensor {name} needs transformers' conversion {converter!r}, which "
                                 "fovea's quantized loader does not run; re-save the checkpoint with transformers >= 5")
        return renamed

    return rename


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor, is_param: bool) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if is_param:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor


def build_structure(model_class: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """The model with its parameters on meta and no quantization config (fovea does that part)."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for sub in ("text_config", "vision_config"):
        part = getattr(config, sub, None)
        if part is not None and hasattr(part, "quantization_config"):
            del part.quantization_config
    with parameters_on_meta():
        return model_class._from_config(config, dtype=dtype)


def load_quantized(model_class: type, path: Path, config: Any, fmt: QuantFormat, device: torch.device,
                   dtype: torch.dtype) -> nn.Module:
    """``model_class`` built from ``config`` with ``path``'s tensors: the quantized linears as
    ``QuantLinear`` modules on ``device``, every other parameter in ``dtype`` on ``device``."""
    model = build_structure(model_class, config, dtype)
    tensors = CheckpointTensors(path)
    rename = renamer(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    quantized = quantized_prefixes(tensors.names(), fmt)
    taken: set[str] = set()
    for prefix in sorted(quantized):
        module_name = rename(f"{prefix}.weight").removesuffix(".weight")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise ModelLoadError(f"{path}: quantized tensors under {prefix!r} belong to no module of "
                                 f"{model_class.__name__} (expected {module_name!r})") from None
        if module is model.get_output_embeddings():
            raise ModelLoadError(f"{path}: the checkpoint quantizes the output layer ({prefix}); fovea runs lm_head "
                                 "unquantized, as the released FP8, W4A16 and AWQ checkpoints leave it")
        if not isinstance(module, nn.Linear):
            raise ModelLoadError(f"{path}: {prefix!r} is quantized in the checkpoint but is a "
                                 f"{type(module).__name__} in the model; fovea quantizes linear layers only")
        quant = read_linear(fmt, tensors.get, prefix, dtype)
        if quant is None:
            raise ModelLoadError(f"{path}: {prefix!r} has {fmt.label} tensors that do not make a whole weight")
        quant = quant.to(device)
        bias = tensors.get(f"{prefix}.bias")
        if (bias is None) != (module.bias is None):  # never a bias dropped, or one the model has no place for
            raise ModelLoadError(f"{path}: {prefix} {'has no' if bias is None else 'has a'} bias in the checkpoint, "
                                 f"but the model's layer {'has one' if bias is None else 'has none'}")
        if bias is not None:
            bias = bias.to(device=device, dtype=dtype)
            taken.add(f"{prefix}.bias")
        parent_name, _, leaf = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, QuantLinear(quant, bias))
        taken.update(n for n in tensors.names() if n.startswith(prefix + "."))
        params.pop(f"{module_name}.weight", None)
        params.pop(f"{module_name}.bias", None)
    unused = []
    for name in tensors.names():
        if name in taken:
            continue
        target = rename(name)
        is_param = target in params
        if not is_param and target not in buffers:
            unused.append(name)
            continue
        tensor = tensors.get(name)
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        set_tensor(model, target, tensor.to(device), is_param)
        params.pop(target, None)
    tie_embeddings(model, params)
    missing = sorted(n for n, p in params.items() if p.device.type == "meta")
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weight(s) are missing from the checkpoint, e.g. "
                             f"{', '.join(missing[:3])}. They would be randomly initialised; fix the checkpoint.")
    if unused:
        log.warning("%s: %d checkpoint tensor(s) unused by the model, e.g. %s", path, len(unused), unused[:3])
    for name, buffer in model.named_buffers():
        if buffer.device != device:
            set_tensor(model, name, buffer.to(device), is_param=False)
    log.info("%s: %d linear layers quantized (%s)", path.name, len(quantized), fmt.label)
    return model


def tie_embeddings(model: nn.Module, pending: dict[str, nn.Parameter]) -> None:
    """An ``lm_head`` the checkpoint leaves out because it is tied to the embeddings."""
    text = getattr(model.config, "text_config", model.config)
    tied = getattr(model.config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False)
    head = getattr(model, "lm_head", None)
    if not tied or head is None or "lm_head.weight" not in pending:
        return
    if isinstance(head, nn.Linear) and head.weight.device.type == "meta":
        head.weight = model.get_input_embeddings().weight
        pending.pop("lm_head.weight")


def quantized_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


__all__ = ["Fp8Weight", "Int4Weight", "QuantLinear", "load_quantized", "parameters_on_meta", "quantized_linears"]
