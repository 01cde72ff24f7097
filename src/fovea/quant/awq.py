"""AWQ GEMM checkpoints: AutoAWQ's packing, converted to fovea's ``Int4Weight`` at load (and back, for tests).

An AWQ GEMM linear stores ``qweight`` int32 ``[K, N // 8]``, ``qzeros`` int32 ``[K // g, N // 8]`` and ``scales``
fp16 ``[K // g, N]``; dequantised ``W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]``. The eight 4-bit codes
of a word are eight neighbouring *output* columns, interleaved: nibble i (bits 4i..4i+3) of word c holds column
``8c + AWQ_ORDER[i]`` (AutoAWQ 0.2.9, ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``'s
``order_map``; ``awq/utils/packing_utils.py`` undoes it with ``AWQ_REVERSE_ORDER``).
"""

from __future__ import annotations

import torch

from fovea.quant.weights import Int4Weight, pack_int4_rows, unpack_int4_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble i holds column AWQ_ORDER[i] of its group of eight
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
_SHIFTS = tuple(4 * i for i in range(8))


def unpack_awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 ``[R, C // 8]`` -> uint8 codes ``[R, C]`` in column order."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"AWQ tensors are 2-D int32, got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, C // 8, 8], nibble order
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles[:, :, order].reshape(packed.shape[0], -1).to(torch.uint8)


def pack_awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[R, C]`` (0..15) -> AWQ-packed int32 ``[R, C // 8]``."""
    rows, cols = codes.shape
    if cols % 8:
        raise ValueError(f"AWQ packs eight columns to a word; {cols} columns is not a multiple of 8")
    nibbles = codes.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=codes.device)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                dtype: torch.dtype | None = None) -> Int4Weight:
    """One AWQ GEMM linear as fovea's ``Int4Weight``; scales (and zeros) in ``dtype`` (default: as stored)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if scales.dim() != 2 or scales.shape[1] != n or scales.shape[0] == 0 or k % scales.shape[0]:
        raise ValueError(f"AWQ scales {list(scales.shape)} do not fit qweight {list(qweight.shape)} "
                         f"(expected [K // group, {n}] with K = {k})")
    if list(qzeros.shape) != [scales.shape[0], qweight.shape[1]]:
        raise ValueError(f"AWQ qzeros {list(qzeros.shape)} do not fit scales {list(scales.shape)} "
                         f"(expected [{scales.shape[0]}, {qweight.shape[1]}])")
    scales = scales.to(dtype or scales.dtype)
    codes = unpack_awq_columns(qweight)  # [K, N]
    zeros = unpack_awq_columns(qzeros).to(scales.dtype)
    return Int4Weight(pack_int4_rows(codes), scales.contiguous(), zeros, k // scales.shape[0])


def pack_awq(w: Int4Weight) -> dict[str, torch.Tensor]:
    """``qweight``, ``qzeros``, ``scales`` (fp16) of an AWQ GEMM checkpoint holding ``w`` (test checkpoints)."""
    zeros = torch.full_like(w.scales, 8) if w.zeros is None else w.zeros
    return {"qweight": pack_awq_columns(unpack_int4_rows(w.packed)),
            "qzeros": pack_awq_columns(zeros.round().to(torch.int64)),
            "scales": w.scales.to(torch.float16)}


def quantize_awq(weight: torch.Tensor, group: int) -> Int4Weight:
    """Round-to-nearest asymmetric 4-bit groups along K of ``weight [N, K]``, as AutoAWQ's quantizer
    (``pseudo_quantize_tensor`` with zero points) computes them; scales in fp16 as AWQ stores them."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group}")
    w = weight.to(torch.float32).reshape(n, k // group, group)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16).to(torch.float32)
    zeros = (-torch.round(lo / scales)).clamp(0, 15)
    codes = (torch.round(w / scales) + zeros).clamp(0, 15).reshape(n, k)
    return Int4Weight(pack_int4_rows(codes.t()), scales[..., 0].t().to(torch.float16).contiguous(),
                      zeros[..., 0].t().to(torch.float16).contiguous(), group)
