"""RMSNorm and SiLU * up handing their rows on quantised to FP8 (``triton_ops.add_rms_norm_fp8``,
``silu_mul_fp8``): the codes and scales must be bit for bit those of the unfused pair (the
producer's output in the model dtype, then ``fp8_quantize``'s quantiser), per token and per
group, for rows narrower than their lanes, and with a zero row. Runs where triton imports and
either CUDA is present or TRITON_INTERPRET=1 (``test_kernels_interpreted`` runs it in the CPU
interpreter)."""

import pytest
import torch
from kernel_helpers import DEVICE, needs_triton


def rand(*shape, seed=0, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def assert_same_quantisation(got, x, group):
    """``got`` (an Fp8Activation) is ``quantize_per_token_group(x, group)`` exactly."""
    from fovea.engine.kernels.fp8_quantize import quantize_groups_torch

    q, scale = quantize_groups_torch(x, group)
    assert got.q.dtype == torch.float8_e4m3fn and got.q.shape == x.shape
    assert got.scale.shape == scale.shape and got.group == group and got.dtype == x.dtype
    assert torch.equal(got.scale, scale)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))  # (NaN-free bytes: exact codes)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols,group", [(200, 200), (256, 256), (320, 64), (200, 128)])
def test_add_rms_norm_fp8_is_the_norm_then_the_quantiser(cols, group, dtype):
    """Per token (one group a row: 200 columns in 256 lanes, and 256) and per power-of-2 group
    (320 = 5 groups of 64 in 512 lanes; 200 in groups of 128, the last one partial); with the
    residual added in place as ``add_rms_norm`` adds it; one row with a large value, so that its
    other values quantise coarsely."""
    from fovea.engine.kernels.triton_ops import add_rms_norm, add_rms_norm_fp8

    x, residual, weight = rand(3, cols, seed=1, dtype=dtype), rand(3, cols, seed=2, dtype=dtype), \
        1 + rand(cols, seed=3, scale=0.1, dtype=dtype)
    x[1, 5] = 40.0
    residual_fused = residual.clone()
    normed = add_rms_norm(x, weight, 1e-5, residual=residual)
    got = add_rms_norm_fp8(x, weight, 1e-5, group, residual=residual_fused)
    assert torch.equal(residual_fused, residual)
    assert_same_quantisation(got, normed, group)
    assert_same_quantisation(add_rms_norm_fp8(x, weight, 1e-6, group), add_rms_norm(x, weight, 1e-6), group)


@needs_triton
@pytest.mark.parametrize("block", [1024, 128])
@pytest.mark.parametrize("inter,group", [(300, 300), (384, 128), (1000, 1000), (1000, 64)])
def test_silu_mul_fp8_is_silu_mul_then_the_quantiser(inter, group, block, monkeypatch):
    """Per token and per group of 128 or 64, the row in one block and in several (the last partial);
    the second row all zeros gets the quantiser's smallest scale and zero codes."""
    from fovea.engine.kernels import triton_ops
    from fovea.engine.kernels.triton_ops import silu_mul, silu_mul_fp8

    monkeypatch.setattr(triton_ops, "SILU_FP8_BLOCK", block)

    gate_up = rand(2, 2 * inter, seed=4, scale=3.0)
    gate_up[1] = 0
    got = silu_mul_fp8(gate_up, group)
    assert_same_quantisation(got, silu_mul(gate_up), group)
    assert not got.q[1].float().any()


@needs_triton
def test_rows_a_producer_cannot_quantise_are_refused():
    """A group that is neither a power of 2 nor a whole row cannot be lanes of the producer's row,
    and rows wider than ``MAX_FP8_ROW`` are not held whole: refused, not quantised wrongly."""
    from fovea.engine.kernels.triton_ops import MAX_FP8_ROW, add_rms_norm_fp8, fp8_row_fits, silu_mul_fp8

    assert fp8_row_fits(3584, 3584) and fp8_row_fits(3584, 128) and fp8_row_fits(18944, 18944)
    assert not fp8_row_fits(3584, 96) and not fp8_row_fits(MAX_FP8_ROW + 1, MAX_FP8_ROW + 1)
    with pytest.raises(ValueError, match="groups of 96"):
        add_rms_norm_fp8(rand(1, 3584), 1 + rand(3584, seed=1), 1e-5, 96)
    with pytest.raises(ValueError, match="groups of 48"):
        silu_mul_fp8(rand(1, 2 * 200), 48)


@needs_triton
@pytest.mark.parametrize("rows", [1, 3])
def test_the_products_of_quantised_inputs_are_those_of_the_unquantised(rows):
    """``fp8_quantised_product`` on the quantiser's codes through the Triton kernels (a matrix-vector
    and a tensor-core configuration, one split over K) equals ``fp8_linear``'s torch product of the
    unquantised rows up to float32 sums; the block-scaled product likewise."""
    from fovea.engine.kernels.fp8_quantize import quantize_per_token, quantize_per_token_group
    from fovea.engine.kernels.quant_gemv import GemvConfig
    from fovea.engine.kernels.quant_matmul import (
        GemmConfig,
        fp8_block_linear,
        fp8_block_quantised_product,
        fp8_linear,
        fp8_quantised_product,
    )
    from fovea.quant.weights import Fp8Weight
    from fovea.testing.tolerance import assert_close_for

    n, k = 48, 256
    gen = torch.Generator().manual_seed(7)
    w = Fp8Weight.random(n, k, generator=gen).to(DEVICE)
    x = rand(rows, k, seed=8)
    bias = rand(n, seed=9)
    ref = fp8_linear(x, w.weight, w.scale, bias, impl="torch").float()
    xq, xs = quantize_per_token(x)
    for config in (GemvConfig(16, 64, split_k=2), GemmConfig(16, 16, 64)):
        got = fp8_quantised_product(xq, xs, w.weight, w.scale, bias, x.dtype, impl="triton", config=config)
        assert got.dtype == x.dtype
        assert_close_for(got.float(), ref, torch.float32, k, storage=torch.bfloat16)
    blocked = Fp8Weight.random(n, k, (16, 128), generator=gen).to(DEVICE)
    xq, xs = quantize_per_token_group(x, 128)
    got = fp8_block_quantised_product(xq, xs, blocked.weight, blocked.scale, (16, 128), None, x.dtype)
    assert torch.equal(got, fp8_block_linear(x, blocked.weight, blocked.scale, (16, 128)))


@needs_triton
def test_fused_linear_takes_quantised_inputs_only_for_the_weight_they_were_quantised_for():
    """Codes quantised per token are not the input of a block-scaled weight (it wants groups of
    its bk), nor of an int4 or bf16 weight: refused, not multiplied with the wrong scales."""
    from fovea.engine.kernels.triton_ops import add_rms_norm, add_rms_norm_fp8
    from fovea.engine.model.quant_linear import fp8_input_group, fused_linear
    from fovea.quant.weights import Fp8Weight, Int4Weight

    gen = torch.Generator().manual_seed(10)
    channel = Fp8Weight.random(32, 256, generator=gen).to(DEVICE)
    blocked = Fp8Weight.random(32, 256, (16, 128), generator=gen).to(DEVICE)
    x, norm = rand(2, 256, seed=11), 1 + rand(256, seed=12, scale=0.1)
    assert fp8_input_group(channel, x.device) == 256 and fp8_input_group(blocked, x.device) == 128
    assert fp8_input_group(Int4Weight.random(32, 256, 128, generator=gen), x.device) is None
    per_token = add_rms_norm_fp8(x, norm, 1e-5, 256)
    want = fused_linear(add_rms_norm(x, norm, 1e-5), channel)
    assert torch.equal(fused_linear(per_token, channel), want)
    for weight in (blocked, Int4Weight.random(32, 256, 128, generator=gen).to(DEVICE), rand(32, 256, seed=13)):
        with pytest.raises(ValueError, match="groups of 256"):
            fused_linear(per_token, weight)


@needs_triton
def test_the_start_up_check_notices_a_producer_that_quantises_wrongly(monkeypatch):
    """``fp8_producers_problem`` passes the producers as they are and names the one whose codes
    differ from the quantiser's (a scale one ulp off is enough)."""
    from types import SimpleNamespace

    from fovea.engine.kernels import triton_ops
    from fovea.engine.kernels.fp8_activation import Fp8Activation
    from fovea.engine.model.quant_linear import fp8_producers_problem
    from fovea.quant.weights import Fp8Weight

    gen = torch.Generator().manual_seed(14)
    layer = SimpleNamespace(qkv=Fp8Weight.random(48, 256, generator=gen).to(DEVICE), qkv_bias=None,
                            in_norm=1 + rand(256, seed=15, scale=0.1),
                            down=Fp8Weight.random(256, 384, (16, 128), generator=gen).to(DEVICE))
    assert fp8_producers_problem([layer], torch.bfloat16, DEVICE) is None
    real = triton_ops.silu_mul_fp8

    def off_by_an_ulp(*args):
        got = real(*args)
        return Fp8Activation(got.q, got.scale.nextafter(torch.full_like(got.scale, 1.0)), got.group, got.dtype)

    monkeypatch.setattr(triton_ops, "silu_mul_fp8", off_by_an_ulp)
    problem = fp8_producers_problem([layer], torch.bfloat16, DEVICE)
    assert problem is not None and problem.startswith("silu_mul_fp8: scales differ")
