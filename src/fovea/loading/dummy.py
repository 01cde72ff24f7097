"""``--load-format dummy``: a model of the config's shapes and quantization format with random
weights made on the device, with no weight files read (vLLM's flag of the same name).

It lets benchmarks and capacity planning run shapes whose files would not fit on disk (a 72B
model in FP8 is 73 GB). The language model's decoder linears take the checkpoint's format (FP8,
block FP8 or int4), as the released checkpoints quantize them; everything else is in the served
dtype. Norm weights are ones and biases zeros, the rest normal with std 0.02, so activations keep
a sane scale through the layers. Nothing such a model answers means anything: the start-up log,
``/health`` and the canary say so.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fovea.loading.quantized import QuantLinear, build_structure
from fovea.quant.formats import QuantFormat
from fovea.quant.weights import Fp8Weight, Int4Weight

INIT_STD = 0.02


def random_quant(fmt: QuantFormat, linear: nn.Linear, device: torch.device, dtype: torch.dtype,
                 generator: torch.Generator):
    n, k = linear.out_features, linear.in_features
    if fmt.is_int4:
        return Int4Weight.random(n, k, fmt.group_size, fmt.symmetric, dtype, device, generator=generator)
    return Fp8Weight.random(n, k, fmt.block, device, generator=generator)


def dummy_model(model_class: type, path: Path, fmt: QuantFormat | None, device: torch.device,
                dtype: torch.dtype, seed: int = 0) -> nn.Module:
    from fovea.loading.loader import generation_config, hf_config
    from fovea.models import adapter_for

    config = hf_config(path)
    model = build_structure(model_class, config, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    if fmt is not None:
        decoder = adapter_for(config.model_type).lm_spec(model).language_model.layers
        for layer in decoder:
            for name, module in list(layer.named_modules()):
                if isinstance(module, nn.Linear):
                    bias = torch.zeros(module.out_features, device=device, dtype=dtype) if module.bias is not None else None
                    parent, _, leaf = name.rpartition(".")
                    setattr(layer.get_submodule(parent) if parent else layer, leaf,
                            QuantLinear(random_quant(fmt, module, device, dtype, generator), bias))
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        tensor = torch.empty(param.shape, device=device, dtype=dtype)
        if leaf == "bias":
            tensor.zero_()
        elif "norm" in name.rsplit(".", 2)[-2].lower() or isinstance(owner, nn.LayerNorm):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    model.tie_weights()
    model.generation_config = generation_config(path, config)
    return model
