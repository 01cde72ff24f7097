"""Read one quantized linear from a checkpoint, by its format's own tensor names and layouts.

``get(name)`` returns a checkpoint tensor (CPU) or None; ``prefix`` is a linear's checkpoint name
("model.layers.0.self_attn.q_proj"). Each format marks its quantized linears with one tensor (``MARKERS``); a
linear without it is not quantized in the checkpoint and ``read_linear`` returns None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from fovea.errors import ModelLoadError
from fovea.quant.awq import awq_to_int4
from fovea.quant.formats import QuantFormat
from fovea.quant.weights import FP8_DTYPE, Fp8Weight, Int4Weight, QuantWeight, pack_int4_rows

Getter = Callable[[str], torch.Tensor | None]

# (method, int4?) -> the tensor whose presence marks a quantized linear, and every tensor such a linear owns.
MARKERS = {("compressed-tensors", False): "weight_scale", ("compressed-tensors", True): "weight_packed",
           ("fp8", False): "weight_scale_inv", ("awq", True): "qweight"}
_SUFFIXES = {
    ("compressed-tensors", False): ("weight", "weight_scale", "input_scale"),
    ("compressed-tensors", True): ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                                   "weight_g_idx"),
    ("fp8", False): ("weight", "weight_scale_inv", "activation_scale", "input_scale"),
    ("awq", True): ("qweight", "qzeros", "scales"),
}
QUANT_SUFFIXES: frozenset[str] = frozenset(s for group in _SUFFIXES.values() for s in group)


def _key(fmt: QuantFormat) -> tuple[str, bool]:
    return fmt.method, fmt.is_int4


def tensor_suffixes(fmt: QuantFormat) -> frozenset[str]:
    """The tensor-name suffixes (after ``prefix.``) that belong to a quantized linear in this format."""
    return frozenset(_SUFFIXES[_key(fmt)])


def quantized_prefixes(names: Iterable[str], fmt: QuantFormat) -> set[str]:
    """The linear modules quantized in a checkpoint whose tensor names are ``names``."""
    tail = "." + MARKERS[_key(fmt)]
    return {name[: -len(tail)] for name in names if name.endswith(tail)}


def read_linear(fmt: QuantFormat, get: Getter, prefix: str, dtype: torch.dtype | None = None) -> QuantWeight | None:
    """The linear ``prefix`` in fovea's layout, or None when the checkpoint holds it unquantized.

    ``dtype`` is the model dtype for int4 scales and zeros (default: as stored); FP8 scales are float32.
    """
    marker = get(f"{prefix}.{MARKERS[_key(fmt)]}")
    if marker is None:
        # Format tensors without the marker would otherwise be dropped in silence.
        for suffix in sorted(tensor_suffixes(fmt) - {"weight"}):
            if get(f"{prefix}.{suffix}") is not None:
                raise ModelLoadError(f"{prefix}: checkpoint has {prefix}.{suffix} but no "
                                     f"{prefix}.{MARKERS[_key(fmt)]}; a {fmt.label} linear needs both")
        return None
    if fmt.method == "awq":
        w = awq_to_int4(marker, _need(get, prefix, "qzeros"), _need(get, prefix, "scales"), dtype)
        if w.group != fmt.group_size:
            raise ModelLoadError(f"{prefix}: AWQ groups of {w.group} in the tensors, {fmt.group_size} in the config")
        return w
    if fmt.is_int4:
        return _read_pack_quantized(fmt, get, prefix, marker, dtype)
    for static in ("input_scale", "activation_scale"):
        if get(f"{prefix}.{static}") is not None:
            raise ModelLoadError(f"{prefix}: checkpoint has a static activation scale {prefix}.{static}, "
                                 f"but its config says dynamic activations ({fmt.label})")
    weight = _need(get, prefix, "weight")
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ModelLoadError(f"{prefix}.weight: expected a 2-D {FP8_DTYPE} tensor, got {weight.dtype} "
                             f"{list(weight.shape)}")
    return Fp8Weight(weight, _fp8_scale(fmt, prefix, marker, *weight.shape), fmt.block)


def _need(get: Getter, prefix: str, suffix: str) -> torch.Tensor:
    t = get(f"{prefix}.{suffix}")
    if t is None:
        raise ModelLoadError(f"{prefix}: the checkpoint lacks {prefix}.{suffix}")
    return t


def _fp8_scale(fmt: QuantFormat, prefix: str, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    name = f"{prefix}.{MARKERS[_key(fmt)]}"
    if fmt.block is not None:
        bn, bk = fmt.block
        expected = [math.ceil(n / bn), math.ceil(k / bk)]
        if list(scale.shape) != expected:
            raise ModelLoadError(f"{name}: expected {bn}x{bk} block scales {expected} for a [{n}, {k}] weight, "
                                 f"got {list(scale.shape)}")
        # weight_scale_inv multiplies the fp8 values despite its name (transformers' Fp8Dequantize: q * s).
        return scale.to(torch.float32).contiguous()
    if scale.numel() == 1:  # per-tensor: one number for every row
        return scale.to(torch.float32).reshape(1).expand(n).contiguous()
    if list(scale.shape) in ([n], [n, 1]):
        return scale.to(torch.float32).reshape(n).contiguous()
    raise ModelLoadError(f"{name}: expected a per-channel [{n}, 1] or per-tensor scale, got {list(scale.shape)}")


def _read_pack_quantized(fmt: QuantFormat, get: Getter, prefix: str, packed: torch.Tensor,
                         dtype: torch.dtype | None) -> Int4Weight:
    # compressed-tensors' own unpacker: dense packing along K (along N for zero points), offset 8.
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if get(f"{prefix}.weight_g_idx") is not None:
        raise ModelLoadError(f"{prefix}: activation-ordered groups (weight_g_idx) are not supported")
    n, k = (int(v) for v in _need(get, prefix, "weight_shape").tolist())
    scale = _need(get, prefix, "weight_scale")
    group = fmt.group_size or 0
    if k % group or k % 8 or list(scale.shape) != [n, k // group]:
        raise ModelLoadError(f"{prefix}: a [{n}, {k}] int4 weight in groups of {group} needs K divisible by 8 and "
                             f"the group, and weight_scale [{n}, {k // max(group, 1)}]; got {list(scale.shape)}")
    codes = unpack_from_int32(packed, 4, torch.Size([n, k])).to(torch.int16) + 8  # signed -> unsigned codes
    scales = scale.t().contiguous().to(dtype or scale.dtype)
    zero_point = get(f"{prefix}.weight_zero_point")
    if fmt.symmetric:
        if zero_point is not None:
            raise ModelLoadError(f"{prefix}: weight_zero_point in a checkpoint whose config says symmetric")
        zeros = None
    else:
        if zero_point is None:
            raise ModelLoadError(f"{prefix}: the checkpoint lacks {prefix}.weight_zero_point (asymmetric config)")
        zp = unpack_from_int32(zero_point, 4, torch.Size([n, k // group]), packed_dim=0).to(torch.int16) + 8
        zeros = zp.t().to(scales.dtype).contiguous()
    return Int4Weight(pack_int4_rows(codes.t()), scales, zeros, group)
