"""The language model's linear layers when their weights may be quantized.

A layer's weight is a tensor (bf16/fp16/fp32) or a ``fovea.quant`` weight object (FP8 or int4,
read from the checkpoint by ``loading/quantized``). The two executions of ``PagedLlama`` call:

- ``torch_linear``: ``F.linear``, dequantising a quantized weight for the call (CPU, tests);
- ``fused_linear``: the Triton/cuBLAS path: FP8 through ``_scaled_mm`` with per-token dynamic
  activation scales, block FP8 and int4 through their Triton kernels (int4 with many rows:
  dequantised into one scratch buffer shared by the layers, ``int4_scratch_elements``, then
  torch's matmul).

``fuse_weights`` stacks q/k/v (and gate/up) into one weight, as ``fuse_rows`` does for tensors,
and re-points each module at its rows so the memory is held once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fovea.engine.kernels import quant_matmul, triton_ops
from fovea.engine.model.weights import fuse_rows
from fovea.quant.weights import Fp8Weight, Int4Weight, QuantWeight, dequantized_linear

Weight = torch.Tensor | Fp8Weight | Int4Weight


def weight_of(module: torch.nn.Module) -> Weight:
    """A linear module's weight: its quantized weight object if it has one (``QuantLinear``)."""
    quant = getattr(module, "quant", None)
    return quant if quant is not None else module.weight


def torch_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for a quantized weight, the format's own computation in torch
    (``dequantized_linear``: FP8 layers quantise their activations first)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return dequantized_linear(x, weight, bias)


def fused_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``scratch``: the int4 layers' shared dequantisation buffer (``int4_scratch_elements``)."""
    if isinstance(weight, torch.Tensor):
        return triton_ops.linear(x, weight, bias)
    if isinstance(weight, Fp8Weight):
        if weight.block is not None:
            return quant_matmul.fp8_block_linear(x, weight.weight, weight.scale, weight.block, bias)
        return quant_matmul.fp8_linear(x, weight.weight, weight.scale, bias)
    return quant_matmul.int4_linear(x, weight.packed, weight.scales, weight.zeros, weight.group, bias,
                                    scratch=scratch)


def int4_scratch_elements(layers: list, names: tuple[str, ...] = ("qkv", "o", "gate_up", "down")) -> int:
    """Elements of the buffer the fused forward's int4 layers dequantise into (many rows: prefill):
    the largest int4 weight among the products it runs (``names`` of each layer's weights); 0
    when none is int4."""
    sizes = [w.out_features * w.in_features for layer in layers for w in (getattr(layer, n, None) for n in names)
             if isinstance(w, Int4Weight)]
    return max(sizes, default=0)


def mixed_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fused path with its quantized kernels turned off: Triton/cuBLAS for tensors, the
    dequantising torch path for quantized weights."""
    return triton_ops.linear(x, weight, bias) if isinstance(weight, torch.Tensor) else torch_linear(x, weight, bias)


def rows(weight: QuantWeight, start: int, end: int) -> QuantWeight:
    """Output rows ``start:end`` of a quantized weight, as views of its tensors."""
    if isinstance(weight, Int4Weight):
        zeros = weight.zeros[:, start:end] if weight.zeros is not None else None
        return Int4Weight(weight.packed[:, start:end], weight.scales[:, start:end], zeros, weight.group)
    if weight.block is None:
        return Fp8Weight(weight.weight[start:end], weight.scale[start:end])
    bn = weight.block[0]
    if start % bn:
        raise ValueError(f"rows {start}:{end} do not start on a {bn}-row scale block")
    return Fp8Weight(weight.weight[start:end], weight.scale[start // bn:-(-end // bn)], weight.block)


def fuse_weights(modules: list[torch.nn.Module]) -> Weight | None:
    """The modules' weights stacked by rows: ``fuse_rows`` for tensors; for quantized weights one
    weight object whose row slices the modules then hold. None when they cannot be fused (a mix of
    kinds, or block FP8 rows that do not fall on scale blocks): the layer then runs unfused."""
    quants = [getattr(m, "quant", None) for m in modules]
    if all(q is None for q in quants):
        return fuse_rows(modules, "weight")
    if any(q is None for q in quants) or len({type(q) for q in quants}) > 1:
        return None
    fused = getattr(modules[0], "_fovea_fused_quant", None)
    if fused is not None and all(getattr(m, "_fovea_fused_from", None) is fused for m in modules):
        return fused  # fused by an earlier engine on the same model
    try:
        fused = type(quants[0]).cat_rows(quants)
    except ValueError:
        return None
    start = 0
    for module, quant in zip(modules, quants, strict=True):
        module.quant = rows(fused, start, start + quant.out_features)
        module._fovea_fused_from = fused
        start += quant.out_features
    modules[0]._fovea_fused_quant = fused
    return fused


def quantized_kernels_problem(layers: list, dtype: torch.dtype, device: torch.device) -> str | None:
    """The start-up check of the quantized layers' kernels: the first layer's fused q/k/v and
    down weights through ``fused_linear`` against ``torch_linear`` (the same quantised
    activations, the dequantised weight) on a few random rows. None when they agree to the
    output dtype's rounding, else what disagreed (the engine then runs those layers on the torch
    path: slower, never wrong). Int4 layers are checked on as many rows as take the dequantising
    path too (``quant_matmul.INT4_DEQUANT_MIN_ROWS``)."""
    if not layers:
        return None
    first = layers[0]
    weights = {name: w for name, w in (("qkv", first.qkv), ("down", first.down))
               if w is not None and not isinstance(w, torch.Tensor)}
    generator = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # relative, of a sum over K products rounded once
    for name, weight in weights.items():
        row_counts = (3, quant_matmul.INT4_DEQUANT_MIN_ROWS) if isinstance(weight, Int4Weight) else (3,)
        for rows in row_counts:
            x = torch.randn(rows, weight.in_features, generator=generator).to(device, dtype)
            try:
                got = fused_linear(x, weight).float()
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is a disagreement
                return f"{type(weight).__name__} {name} ({rows} rows): {type(exc).__name__}: {exc}"
            ref = torch_linear(x, weight).float()
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
            if not err <= tolerance:
                return f"{type(weight).__name__} {name} ({rows} rows): relative error {err:.2e} > {tolerance:.0e}"
    return None
