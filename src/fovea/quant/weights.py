"""Quantized linear weights in fovea's two canonical in-memory layouts.

Every checkpoint format is converted to one of these at load, so the kernels (Triton on CUDA) and the
torch path (``dequantized_linear`` on CPU) see exactly two layouts:

* ``Fp8Weight``: float8_e4m3fn ``[N, K]`` as stored, float32 scales per output channel or per (bn, bk) block;
* ``Int4Weight``: unsigned 4-bit codes packed eight to an int32 along K, ``[K // 8, N]``, with group scales
  and optional zero codes ``[K // group, N]`` in the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
_NIBBLE_SHIFTS = tuple(4 * j for j in range(8))


def _same_device(name: str, *tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{name}: tensors on several devices {sorted(map(str, devices))}")


@dataclass
class Fp8Weight:
    """FP8 weight ``[N, K]``; dequantised ``W[n, k] = weight[n, k] * scale[n]`` or ``* scale[n // bn, k // bk]``."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"Fp8Weight.weight must be a 2-D {FP8_DTYPE} tensor [N, K], got "
                             f"{self.weight.dtype} {tuple(self.weight.shape)}")
        if self.scale.dtype != torch.float32:
            raise ValueError(f"Fp8Weight.scale must be float32, got {self.scale.dtype}")
        n, k = self.weight.shape
        if self.block is None:
            expected: tuple[int, ...] = (n,)
        else:
            self.block = (int(self.block[0]), int(self.block[1]))
            if min(self.block) <= 0:
                raise ValueError(f"Fp8Weight.block must be two positive sizes, got {self.block}")
            expected = (math.ceil(n / self.block[0]), math.ceil(k / self.block[1]))
        if tuple(self.scale.shape) != expected:
            kind = "per output channel" if self.block is None else f"per {self.block} block"
            raise ValueError(f"Fp8Weight.scale ({kind}) of a [{n}, {k}] weight must have shape {list(expected)}, "
                             f"got {list(self.scale.shape)}")
        _same_device("Fp8Weight", self.weight, self.scale)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        w = self.weight.to(torch.float32)
        if self.block is None:
            return (w * self.scale[:, None]).to(dtype)
        n, k = w.shape
        bn, bk = self.block
        full = self.scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return (w * full).to(dtype)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block)

    @staticmethod
    def cat_rows(parts: list[Fp8Weight]) -> Fp8Weight:
        """One weight whose rows are the parts' rows in order (fused q/k/v, gate/up)."""
        if not parts:
            raise ValueError("Fp8Weight.cat_rows needs at least one part")
        block = parts[0].block
        if any(p.block != block for p in parts):
            raise ValueError(f"Fp8Weight.cat_rows: parts have different blocks {[p.block for p in parts]}")
        widths = [p.in_features for p in parts]
        if len(set(widths)) > 1:
            raise ValueError(f"Fp8Weight.cat_rows: parts have different in_features {widths}")
        if block is not None and any(p.out_features % block[0] for p in parts):
            # A part ending mid-block would share its last scale row with the next part's first rows.
            raise ValueError(f"Fp8Weight.cat_rows: every part's out_features must be a multiple of the block's "
                             f"{block[0]} rows, got {[p.out_features for p in parts]}")
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), block)

    @staticmethod
    def random(n: int, k: int, block: tuple[int, int] | None = None, device: torch.device | str = "cpu",
               generator: torch.Generator | None = None) -> Fp8Weight:
        """Random weight whose dequantised values have std about 0.02, made on ``device`` (--load-format dummy)."""
        codes = torch.randn(n, k, device=device, generator=generator).clamp_(-448.0, 448.0).to(FP8_DTYPE)
        shape = (n,) if block is None else (math.ceil(n / block[0]), math.ceil(k / block[1]))
        return Fp8Weight(codes, torch.full(shape, 0.02, dtype=torch.float32, device=device), block)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q [K, N]`` (0..15, any int dtype) -> int32 ``[K // 8, N]``, bits 4j..4j+3 of row i = ``q[8i + j]``."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"int4 packing needs K divisible by 8, got K={k}")
    q = q.to(torch.int64).reshape(k // 8, 8, n)
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int64, device=q.device)[None, :, None]
    words = (q << shifts).sum(dim=1)
    # Two's complement: words above 2**31 - 1 are the negative int32 with the same bits.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4_rows``: int32 ``[K // 8, N]`` -> uint8 codes ``[K, N]``."""
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=packed.device)[None, :, None]
    codes = (packed[:, None, :] >> shifts) & 0xF  # arithmetic shift; the mask drops the sign bits
    return codes.reshape(-1, packed.shape[1]).to(torch.uint8)


@dataclass
class Int4Weight:
    """4-bit group-quantised weight; dequantised ``W[n, k] = (q[n, k] - z[k // g, n]) * s[k // g, n]``."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.int32 or self.packed.dim() != 2:
            raise ValueError(f"Int4Weight.packed must be a 2-D int32 tensor [K // 8, N], got "
                             f"{self.packed.dtype} {tuple(self.packed.shape)}")
        k, n = self.packed.shape[0] * 8, self.packed.shape[1]
        if self.group <= 0 or k % self.group:
            raise ValueError(f"Int4Weight.group must be a positive divisor of in_features {k}, got {self.group}")
        if not self.scales.dtype.is_floating_point:
            raise ValueError(f"Int4Weight.scales must be floating point (the model dtype), got {self.scales.dtype}")
        expected = [k // self.group, n]
        if list(self.scales.shape) != expected:
            raise ValueError(f"Int4Weight.scales of a [{n}, {k}] weight in groups of {self.group} must have shape "
                             f"{expected}, got {list(self.scales.shape)}")
        if self.zeros is not None and (list(self.zeros.shape) != expected or self.zeros.dtype != self.scales.dtype):
            raise ValueError(f"Int4Weight.zeros must match the scales ({expected}, {self.scales.dtype}), got "
                             f"{list(self.zeros.shape)} {self.zeros.dtype}")
        _same_device("Int4Weight", self.packed, self.scales, self.zeros)

    @property
    def out_features(self) -> int:
        return self.packed.shape[1]

    @property
    def in_features(self) -> int:
        return self.packed.shape[0] * 8

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + (0 if self.zeros is None else self.zeros.nbytes)

    def codes(self) -> torch.Tensor:
        """Unsigned codes ``q [N, K]`` (uint8, 0..15)."""
        return unpack_int4_rows(self.packed).t()

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        q = unpack_int4_rows(self.packed).to(torch.float32)  # [K, N]
        s = self.scales.to(torch.float32).repeat_interleave(self.group, dim=0)
        z = 8.0 if self.zeros is None else self.zeros.to(torch.float32).repeat_interleave(self.group, dim=0)
        # (q - z) is a small integer and s a model-dtype number, so the float32 product is exact:
        # one rounding, in the cast, like a dequantiser working in the model dtype.
        return ((q - z) * s).t().to(dtype)

    def to(self, device: torch.device | str) -> Int4Weight:
        zeros = None if self.zeros is None else self.zeros.to(device)
        return Int4Weight(self.packed.to(device), self.scales.to(device), zeros, self.group)

    @staticmethod
    def cat_rows(parts: list[Int4Weight]) -> Int4Weight:
        """One weight whose rows (output features) are the parts' in order; the packing runs along K."""
        if not parts:
            raise ValueError("Int4Weight.cat_rows needs at least one part")
        first = parts[0]
        for p in parts[1:]:
            if (p.group, p.in_features, p.scales.dtype, p.zeros is None) != (
                    first.group, first.in_features, first.scales.dtype, first.zeros is None):
                raise ValueError("Int4Weight.cat_rows: parts must share group, in_features, scale dtype and "
                                 "zeros-ness, got " + str([(q.group, q.in_features, q.scales.dtype,
                                                            q.zeros is not None) for q in parts]))
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts], dim=1)  # type: ignore[misc]
        return Int4Weight(torch.cat([p.packed for p in parts], dim=1),
                          torch.cat([p.scales for p in parts], dim=1), zeros, first.group)

    @staticmethod
    def random(n: int, k: int, group: int, symmetric: bool = True, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> Int4Weight:
        """Random weight whose dequantised values have std about 0.02, made on ``device`` (--load-format dummy)."""
        if k % 8:
            raise ValueError(f"Int4Weight needs in_features divisible by 8, got {k}")
        # Uniform random words give uniform independent nibbles: codes 0..15 have std sqrt(255 / 12).
        packed = torch.randint(-2**31, 2**31, (k // 8, n), dtype=torch.int32, device=device, generator=generator)
        scales = torch.full((k // group, n), 0.02 / math.sqrt(255 / 12), dtype=dtype, device=device)
        zeros = None
        if not symmetric:
            zeros = torch.randint(7, 9, (k // group, n), device=device, generator=generator).to(dtype)
        return Int4Weight(packed, scales, zeros, group)


QuantWeight = Fp8Weight | Int4Weight


def dequantized_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path (CPU, tests, the reference): the layer dequantised on the fly in the
    activations' dtype. An FP8 layer first quantises its activations as its format defines
    (dynamic e4m3 per token, or per token and block column group), as the GPU kernels and
    compressed-tensors' own forward do: W8A8 computed in floating point, not a W8A16 model."""
    if isinstance(w, Fp8Weight):
        x = fake_quantized_activations(x, w.block[1] if w.block is not None else x.shape[-1])
    return F.linear(x, w.dequantize(x.dtype), bias)


def fake_quantized_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` after dynamic e4m3 quantisation in column groups of ``group``, and back (in its dtype)."""
    from fovea.engine.kernels.fp8_quantize import quantize_groups_torch

    lead, k = x.shape[:-1], x.shape[-1]
    q, scale = quantize_groups_torch(x.reshape(-1, k), group)
    back = q.float() * scale.repeat_interleave(group, dim=1)[:, :k]
    return back.to(x.dtype).reshape(*lead, k)
