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

from fovea.engine.kernels import quant_matmul, triton_ops, triton_util
from fovea.engine.kernels.fp8_activation import Fp8Activation
from fovea.engine.kernels.fp8_quantize import interpreting, quantize_per_token_group
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


def fused_linear(x: torch.Tensor | Fp8Activation, weight: Weight, bias: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``scratch``: the int4 layers' shared dequantisation buffer (``int4_scratch_elements``). ``x``
    may come quantised by its producer (``fp8_activation``) for an FP8 weight whose
    ``fp8_input_group`` it was quantised by."""
    if isinstance(x, Fp8Activation):
        return _quantised_input_linear(x, weight, bias)
    if isinstance(weight, torch.Tensor):
        return triton_ops.linear(x, weight, bias)
    if isinstance(weight, Fp8Weight):
        if weight.block is not None:
            return quant_matmul.fp8_block_linear(x, weight.weight, weight.scale, weight.block, bias)
        return quant_matmul.fp8_linear(x, weight.weight, weight.scale, bias)
    return quant_matmul.int4_linear(x, weight.packed, weight.scales, weight.zeros, weight.group, bias,
                                    scratch=scratch)


def fp8_input_group(weight: Weight | None, device: torch.device) -> int | None:
    """The columns a scale of the input that ``fused_linear`` quantises for ``weight`` on ``device``,
    where the input's producer may quantise it instead (``fp8_activation``): an FP8 weight on a GPU
    with FP8 products and triton, per token (its K) or per bk-column group (blocks) as its kernels
    take it, and rows its producer can hold (``triton_ops.fp8_row_fits``); in triton's CPU
    interpreter too (the tests). None otherwise."""
    if not isinstance(weight, Fp8Weight):
        return None
    if device.type == "cuda":
        if not (triton_util.available() and quant_matmul.fp8_capable(device)):
            return None
    elif not interpreting():
        return None
    group = _activation_group(weight)
    return group if triton_ops.fp8_row_fits(weight.in_features, group) else None


def _activation_group(weight: Fp8Weight) -> int:
    """The columns a scale of the activations an FP8 weight's products quantise: its K (per token)
    or its blocks' bk."""
    return weight.in_features if weight.block is None else weight.block[1]


def _quantised_input_linear(x: Fp8Activation, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    # (checked on every call, so the weight's own group: fp8_input_group's device checks were made
    # once, when the forward planned its producers)
    if not isinstance(weight, Fp8Weight) or x.group != _activation_group(weight):
        raise ValueError(f"activations quantised by groups of {x.group} columns are the input of an FP8 weight "
                         f"quantising its input so, not of {type(weight).__name__}")
    if weight.block is None:
        return quant_matmul.fp8_quantised_product(x.q, x.scale, weight.weight, weight.scale, bias, x.dtype)
    return quant_matmul.fp8_block_quantised_product(x.q, x.scale, weight.weight, weight.scale, weight.block, bias,
                                                    x.dtype)


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
    for name, weight in weights.items():
        row_counts = (3, quant_matmul.INT4_DEQUANT_MIN_ROWS) if isinstance(weight, Int4Weight) else (3,)
        for rows in row_counts:
            x = torch.randn(rows, weight.in_features, generator=generator).to(device, dtype)
            try:
                got = fused_linear(x, weight).float()
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is a disagreement
                return f"{type(weight).__name__} {name} ({rows} rows): {type(exc).__name__}: {exc}"
            problem = _product_problem(got, torch_linear(x, weight), dtype)
            if problem:
                return f"{type(weight).__name__} {name} ({rows} rows): {problem}"
    return None


def _product_problem(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Whether a product agrees with its reference to the output dtype's rounding: a relative error
    (norm) of a sum over K products rounded once."""
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    got, ref = got.float(), ref.float()
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    return None if err <= tolerance else f"relative error {err:.2e} > {tolerance:.0e}"


def fp8_producers_problem(layers: list, dtype: torch.dtype, device: torch.device, eps: float = 1e-6) -> str | None:
    """The start-up check of the producers that quantise FP8 products' inputs (``PagedLlama``'s
    ``fp8_groups``): on the first layer's shapes, ``add_rms_norm_fp8`` and ``silu_mul_fp8`` against
    their unfused outputs quantised by ``quantize_per_token_group`` (equal bit for bit), then the
    q/k/v product of those activations against ``torch_linear`` as ``quantized_kernels_problem``
    checks it. None when all agree (or no layer takes such inputs), else what disagreed (the engine
    then keeps the quantiser's launches)."""
    if not layers:
        return None
    first = layers[0]
    norm_group, down_group = fp8_input_group(first.qkv, device), fp8_input_group(first.down, device)
    if norm_group is None and down_group is None:
        return None
    generator = torch.Generator().manual_seed(1)
    try:
        if norm_group is not None:
            x = torch.randn(3, first.qkv.in_features, generator=generator).to(device, dtype)
            fused = triton_ops.add_rms_norm_fp8(x, first.in_norm, eps, norm_group)
            problem = _same_codes("add_rms_norm_fp8", fused, triton_ops.add_rms_norm(x, first.in_norm, eps))
            if problem:
                return problem
            problem = _product_problem(fused_linear(fused, first.qkv, first.qkv_bias),
                                       torch_linear(triton_ops.add_rms_norm(x, first.in_norm, eps), first.qkv,
                                                    first.qkv_bias), dtype)
            if problem:
                return f"the q/k/v product of add_rms_norm_fp8's rows: {problem}"
        if down_group is not None:
            gate_up = torch.randn(3, 2 * first.down.in_features, generator=generator).to(device, dtype)
            problem = _same_codes("silu_mul_fp8", triton_ops.silu_mul_fp8(gate_up, down_group),
                                  triton_ops.silu_mul(gate_up))
            if problem:
                return problem
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is a disagreement
        return f"{type(exc).__name__}: {exc}"
    return None


def _same_codes(name: str, got: Fp8Activation, unfused: torch.Tensor) -> str | None:
    q, scale = quantize_per_token_group(unfused, got.group)
    if not torch.equal(got.scale, scale):
        return f"{name}: scales differ from the quantiser's (max {float((got.scale - scale).abs().max()):.3g})"
    if not torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)):
        differ = int((got.q.view(torch.uint8) != q.view(torch.uint8)).sum())
        return f"{name}: {differ} codes differ from the quantiser's"
    return None
