"""fovea's canonical quantized weights against their definitions, written out as explicit loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from fovea.quant.weights import (
    FP8_DTYPE,
    Fp8Weight,
    Int4Weight,
    dequantized_linear,
    fake_quantized_activations,
    pack_int4_rows,
    unpack_int4_rows,
)


def _fp8(n: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 50).to(FP8_DTYPE)


def _loops_fp8(w: Fp8Weight) -> torch.Tensor:
    out = torch.empty(w.out_features, w.in_features, dtype=torch.float64)
    for n in range(w.out_features):
        for k in range(w.in_features):
            s = w.scale[n] if w.block is None else w.scale[n // w.block[0], k // w.block[1]]
            out[n, k] = float(w.weight[n, k].to(torch.float32)) * float(s)
    return out


def _int4(n: int, k: int, group: int, symmetric: bool, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(k // group, n, generator=g) + 0.5).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (k // group, n), generator=g).to(dtype)
    # The packing written from its definition: bits 4j..4j+3 of packed[i, n] hold q[n, 8i + j].
    packed = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(k // 8):
        for j in range(8):
            packed[i] |= q[:, 8 * i + j] << (4 * j)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return q, Int4Weight(packed, scales, zeros, group)


def _loops_int4(q: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for n in range(q.shape[0]):
        for k in range(q.shape[1]):
            z = 8 if w.zeros is None else float(w.zeros[k // w.group, n])
            out[n, k] = (int(q[n, k]) - z) * float(w.scales[k // w.group, n])
    return out


def test_fp8_channel_dequantize():
    w = Fp8Weight(_fp8(3, 5, 0), torch.tensor([0.5, 0.01, 3.0]))
    # The product is formed in float32 (one rounding), then widened.
    assert torch.equal(w.dequantize(torch.float64), _loops_fp8(w).to(torch.float32).to(torch.float64))
    assert w.dequantize().dtype == torch.bfloat16


def test_fp8_block_dequantize_with_partial_edge_blocks():
    # 5 x 7 in 2 x 3 blocks: the last block row and column are partial.
    scale = torch.rand(3, 3, generator=torch.Generator().manual_seed(1)) + 0.1
    w = Fp8Weight(_fp8(5, 7, 2), scale, (2, 3))
    assert torch.equal(w.dequantize(torch.float64), _loops_fp8(w).to(torch.float32).to(torch.float64))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_dequantize(symmetric):
    q, w = _int4(6, 32, 16, symmetric, seed=3)
    assert torch.equal(w.dequantize(torch.float64), _loops_int4(q, w).to(torch.float32).to(torch.float64))
    assert torch.equal(w.codes(), q.to(torch.uint8))


def test_int4_pack_matches_the_definition():
    q, w = _int4(5, 24, 8, True, seed=4)
    assert torch.equal(pack_int4_rows(q.t()), w.packed)
    assert torch.equal(unpack_int4_rows(w.packed), q.t().to(torch.uint8))


def test_int4_bf16_dequantize_rounds_once():
    q, w = _int4(4, 16, 8, False, seed=5, dtype=torch.bfloat16)
    assert torch.equal(w.dequantize(torch.bfloat16), _loops_int4(q, w).to(torch.bfloat16))


def test_fp8_cat_rows():
    parts = [Fp8Weight(_fp8(n, 9, n), torch.rand(n) + 0.1) for n in (3, 5, 2)]
    fused = Fp8Weight.cat_rows(parts)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts]))


def test_fp8_block_cat_rows_and_the_block_rule():
    def part(n):
        return Fp8Weight(_fp8(n, 10, n), torch.rand(math.ceil(n / 4), 3) + 0.1, (4, 4))

    parts = [part(8), part(4), part(12)]
    fused = Fp8Weight.cat_rows(parts)
    assert fused.scale.shape == (6, 3)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts]))
    with pytest.raises(ValueError, match=r"multiple of the block's 4 rows, got \[8, 6\]"):
        Fp8Weight.cat_rows([part(8), part(6)])
    with pytest.raises(ValueError, match="different blocks"):
        Fp8Weight.cat_rows([part(8), Fp8Weight(_fp8(4, 10, 0), torch.ones(4))])


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_cat_rows(symmetric):
    parts = [_int4(n, 32, 8, symmetric, seed=n)[1] for n in (4, 7, 1)]
    fused = Int4Weight.cat_rows(parts)
    assert fused.out_features == 12
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts]))


def test_int4_cat_rows_refuses_mixed_parts():
    with pytest.raises(ValueError, match="group"):
        Int4Weight.cat_rows([_int4(4, 32, 8, True, 0)[1], _int4(4, 32, 16, True, 0)[1]])
    with pytest.raises(ValueError, match="zeros"):
        Int4Weight.cat_rows([_int4(4, 32, 8, True, 0)[1], _int4(4, 32, 8, False, 0)[1]])


def test_validation_messages():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(2, 2), torch.ones(2))
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        Fp8Weight(_fp8(2, 2, 0), torch.ones(3))
    with pytest.raises(ValueError, match=r"shape \[1, 2\]"):
        Fp8Weight(_fp8(2, 5, 0), torch.ones(1, 1), (128, 4))
    with pytest.raises(ValueError, match="float32"):
        Fp8Weight(_fp8(2, 2, 0), torch.ones(2, dtype=torch.bfloat16))
    _, w = _int4(4, 32, 8, False, 0)
    with pytest.raises(ValueError, match="divisor"):
        Int4Weight(w.packed, w.scales, w.zeros, 12)
    with pytest.raises(ValueError, match=r"shape \[4, 4\]"):
        Int4Weight(w.packed, w.scales[:2], None, 8)
    with pytest.raises(ValueError, match="zeros must match"):
        Int4Weight(w.packed, w.scales, w.zeros.to(torch.float16), 8)
    with pytest.raises(ValueError, match="int32"):
        Int4Weight(w.packed.to(torch.int64), w.scales, None, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_linear(dtype):
    q, w4 = _int4(24, 64, 16, False, seed=6)
    w8 = Fp8Weight(_fp8(24, 64, 7), torch.rand(24) * 0.01)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    bias = torch.randn(24).to(dtype)
    for w, ref in ((w4, _loops_int4(q, w4)), (w8, _loops_fp8(w8))):
        out = dequantized_linear(x, w, bias)
        assert out.dtype == dtype and out.shape == (3, 5, 24)
        xin = x
        if isinstance(w, Fp8Weight):  # W8A8: the activations are quantised to e4m3 per token first
            xin = fake_quantized_activations(x, 64)
            scale = x.float().abs().amax(-1, keepdim=True) / 448
            assert not torch.equal(xin, x)  # really quantised
            # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4, or 2^-9 of the scale when subnormal;
            # then rounded back to ``dtype``.
            err_bound = 2**-4 * x.float().abs() + 2**-9 * scale + torch.finfo(dtype).eps * x.float().abs()
            assert bool(((xin.float() - x.float()).abs() <= err_bound).all())
        assert torch.equal(out, F.linear(xin, w.dequantize(dtype), bias))
        exact = xin.double() @ ref.t() + bias.double()
        # Rounding of the weights, inputs' products and the sum to ``dtype``: a few eps of the magnitudes summed.
        eps = torch.finfo(dtype).eps
        bound = 4 * eps * ((xin.double().abs() @ ref.abs().t()) + bias.double().abs()) + 1e-30
        assert bool(((out.double() - exact).abs() <= bound).all())


def test_random_weights_look_like_an_initialised_linear():
    g = torch.Generator().manual_seed(9)
    for w in (Fp8Weight.random(256, 512, None, generator=g), Fp8Weight.random(256, 512, (128, 128), generator=g),
              Int4Weight.random(256, 512, 128, True, torch.bfloat16, generator=g),
              Int4Weight.random(256, 512, 64, False, torch.float16, generator=g)):
        std = float(w.dequantize(torch.float32).std())
        assert 0.018 < std < 0.022, (type(w).__name__, std)
        assert (w.out_features, w.in_features) == (256, 512)
    a = Int4Weight.random(8, 16, 8, generator=torch.Generator().manual_seed(1))
    b = Int4Weight.random(8, 16, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.packed, b.packed)


def test_nbytes_and_to():
    _, w = _int4(16, 64, 32, False, 0, dtype=torch.bfloat16)
    assert w.nbytes == 8 * 16 * 4 + 2 * (2 * 16 * 2)
    f = Fp8Weight(_fp8(16, 64, 0), torch.ones(16))
    assert f.nbytes == 16 * 64 + 16 * 4
    moved = f.to("cpu")
    assert moved is not f and torch.equal(moved.dequantize(), f.dequantize())
