"""The matrix-vector kernels for quantised weights (``quant_gemv``: decode, 1-4 rows) against the
references of ``test_quant_kernels`` (the weight layouts' definitions, torch's FP8 cast), and their
place among the kernel choices. Runs where triton imports and either CUDA is present or
TRITON_INTERPRET=1 (``test_kernels_interpreted`` runs this file in the CPU interpreter)."""

import dataclasses

import pytest
import torch
from kernel_helpers import needs_triton
from test_quant_kernels import FP8, check_fp8, expand_scales, make_fp8, make_int4, rand, torch_quant

from fovea.testing.tolerance import assert_close_for


def fp8_weight(n, k, seed):
    w = rand(n, k, seed=seed, scale=0.05)
    scale = (w.abs().amax(dim=1) / 448.0).float()
    return (w / scale[:, None]).to(FP8), scale


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_fp8_gemv_equals_the_quantised_product(rows, out_dtype):
    """Per-token quantisation (the quantiser's launch) is torch's cast bit for bit, so the product
    equals the float32 product of torch's quantised activations and the dequantised weight, up to
    float32 sums; N and K not multiples of the tiles, split over K and not, with a bias; rows 3
    (a 4-row kernel whose last row is not stored)."""
    from fovea.engine.kernels.quant_gemv import GemvConfig, fp8_gemv

    n, k = 50, 200
    weight, scale = fp8_weight(n, k, seed=1)
    x = rand(rows, k, seed=2 + rows, dtype=torch.bfloat16)
    x[0, 7] = 30.0  # one large value sets row 0's scale: the other columns quantise coarsely
    bias = rand(n, seed=9, dtype=torch.bfloat16)
    xq, xs = torch_quant(x, k)
    exact = (xq.float() @ weight.float().t()) * xs * scale[None, :]
    for config, with_bias in ((GemvConfig(16, 64), False), (GemvConfig(8, 32, split_k=3), True),
                              (GemvConfig(64, 16, split_k=2), False),
                              (GemvConfig(16, 64, prefetch=True), False),
                              (GemvConfig(8, 32, split_k=3, prefetch=True), True),
                              (GemvConfig(16, 8, split_k=2, prefetch=True), False),  # whole steps
                              (GemvConfig(16, 8, split_k=32), True)):  # 25 steps, one a program
        y = fp8_gemv(x, weight, scale, bias if with_bias else None, out_dtype, config)
        ref = exact + (bias.float() if with_bias else 0)
        assert y.dtype == out_dtype and y.shape == (rows, n)
        assert_close_for(y.float(), ref, torch.float32, k, storage=out_dtype if out_dtype != torch.float32 else None)


@needs_triton
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_block_gemv_scales_each_step_by_its_blocks(rows):
    """Block-scaled weights (128x128, partial blocks in N and K; 64x32 blocks with a step narrower
    than the group): each step is scaled by its K group's activation scale and its weight blocks'
    scales, as the tensor-core kernel's tiles are; split over K and not, with a bias."""
    from fovea.engine.kernels.quant_gemv import GemvConfig
    from fovea.engine.kernels.quant_matmul import fp8_block_linear

    for n, k, block, config in ((136, 320, (128, 128), GemvConfig(32, 128)),
                                (136, 320, (128, 128), GemvConfig(16, 128, split_k=2)),
                                (136, 320, (128, 128), GemvConfig(16, 128, split_k=2, prefetch=True)),
                                (96, 192, (64, 32), GemvConfig(8, 16, split_k=3)),
                                (96, 192, (64, 32), GemvConfig(8, 16, split_k=3, prefetch=True))):
        weight, scale, w = make_fp8(n, k, seed=30 + block[1], block=block)
        x = rand(rows, k, seed=31, dtype=torch.bfloat16)
        x[:, 64:128] *= 30  # the groups differ in scale, as real activations do
        bias = rand(n, seed=32, dtype=torch.bfloat16)
        y = fp8_block_linear(x, weight, scale, block, bias, config=config)
        xq, xs = torch_quant(x, block[1])
        check_fp8(y, x, w, expand_scales(xs, block[1], k), xq, bias, torch.bfloat16, k)
    with pytest.raises(ValueError, match="must divide"):
        weight, scale, _ = make_fp8(32, 64, seed=33, block=(16, 32))
        fp8_block_linear(rand(1, 64, seed=34), weight, scale, (16, 32), config=GemvConfig(8, 64))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_zeros", [True, False])
def test_int4_gemv_equals_the_dequantised_product(dtype, with_zeros):
    """bf16/fp16 take the zero points off once per group (the codes as 256 + q and 16 + q, every
    code of the packed int32 in turn); float32 off each weight. Rows 1, 2 and 3, groups 32, 64 and
    128, split over K, N not a multiple of the tile, a bias."""
    from fovea.engine.kernels.quant_gemv import GemvConfig, int4_gemv

    n, k = 40, 512
    for group, rows, config in ((128, 1, GemvConfig(32, 16)), (64, 3, GemvConfig(16, 8, split_k=3)),
                                (32, 2, GemvConfig(64, 4, split_k=2)),
                                (64, 1, GemvConfig(16, 8, prefetch=True)),
                                (32, 3, GemvConfig(16, 4, split_k=3, prefetch=True)),
                                (32, 2, GemvConfig(16, 4, split_k=32))):  # 16 groups, one a program
        packed, scales, zeros, w = make_int4(k, n, group, seed=20 + group, with_zeros=with_zeros, dtype=dtype)
        x = rand(rows, k, seed=21 + rows, dtype=dtype)
        bias = rand(n, seed=23, dtype=dtype) if rows > 1 else None
        y = int4_gemv(x, packed, scales, zeros, group, bias, config)
        ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
        assert y.dtype == dtype and y.shape == (rows, n)
        assert_close_for(y.float(), ref, torch.float32, k, storage=dtype if dtype != torch.float32 else None)


@needs_triton
def test_the_kernels_refuse_what_they_do_not_take():
    from fovea.engine.kernels.quant_gemv import GEMV_MAX_ROWS, GemvConfig, fp8_gemv, int4_gemv

    weight, scale = fp8_weight(16, 64, seed=3)
    with pytest.raises(ValueError, match="at most"):
        fp8_gemv(rand(GEMV_MAX_ROWS + 1, 64, seed=4), weight, scale, None, torch.float32, GemvConfig(16, 64))
    packed, scales, zeros, _ = make_int4(64, 16, 32, seed=5, with_zeros=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="whole group"):
        int4_gemv(rand(1, 64, seed=6), packed, scales, zeros, 32, None, GemvConfig(16, 8))  # 8 rows > 4 a group


def test_splits_over_8_are_timed_only_for_products_whose_columns_do_not_fill_the_gpu():
    """q/k/v, o and down (N 3584-4608 at 7B, 8192-10240 at 72B) are also timed split 16 and 32
    ways over K; gate/up (N 37888 at 7B) is not, its columns alone make 1,184-2,368 programs."""
    from fovea.engine.kernels import quant_gemv
    from fovea.engine.kernels import quant_matmul as qm

    def wide(key):
        return sorted({c.split_k for c in qm.candidates_for(key)
                       if isinstance(c, quant_gemv.GemvConfig) and c.split_k > 8})

    for n in (3584, 4608, 10240):
        assert wide(("fp8", 1, n, 3584, "torch.bfloat16")) == [16, 32]
        assert wide(("int4", 1, n, 3584, 128, "torch.bfloat16", True)) == [16, 32]
        assert wide(("fp8-block", 1, n, 3584, "torch.bfloat16", 128, 128)) == [16, 32]
    for key in (("fp8", 1, 37888, 3584, "torch.bfloat16"), ("int4", 1, 37888, 3584, 128, "torch.bfloat16", True),
                ("fp8-block", 1, 59136, 8192, "torch.bfloat16", 128, 128)):
        assert wide(key) == []
        assert any(isinstance(c, quant_gemv.GemvConfig) for c in qm.candidates_for(key))
    assert quant_gemv.MAX_SPLIT_K >= 32


def test_the_choice_offers_the_matrix_vector_kernels_for_few_rows_only():
    from fovea.engine.kernels import quant_gemv
    from fovea.engine.kernels import quant_matmul as qm

    for rows in (1, 2, 4):
        block = qm.candidates_for(("fp8-block", rows, 64, 256, "torch.bfloat16", 128, 128))
        assert any(isinstance(c, quant_gemv.GemvConfig) for c in block)
        assert all(128 % c.block_k == 0 for c in block if isinstance(c, quant_gemv.GemvConfig))
        fp8 = qm.candidates_for(("fp8", rows, 64, 64, "torch.bfloat16"))
        int4 = qm.candidates_for(("int4", rows, 64, 256, 128, "torch.bfloat16", True))
        assert any(isinstance(c, quant_gemv.GemvConfig) for c in fp8)
        assert any(isinstance(c, quant_gemv.GemvConfig) for c in int4)
        assert all(c.block_k == 128 // 8 for c in int4 if isinstance(c, quant_gemv.GemvConfig))
        # the default (first, used where nothing can be timed) stays the tensor-core kernel
        assert isinstance(fp8[0], qm.GemmConfig) and isinstance(int4[0], qm.GemmConfig)
    for key in (("fp8", 8, 64, 64, "torch.bfloat16"), ("fp8-mma", 1, 64, 64, "torch.bfloat16"),
                ("fp8-block", 8, 64, 256, "torch.bfloat16", 128, 128),
                ("fp8-block", 1, 64, 240, "torch.bfloat16", 128, 40),  # 8 columns a group step: none
                ("int4", 8, 64, 256, 128, "torch.bfloat16", True),
                ("int4-mma", 1, 64, 256, 128, "torch.bfloat16", True)):
        assert not any(isinstance(c, quant_gemv.GemvConfig) for c in qm.candidates_for(key))
    # groups the kernel does not take a step at a time (not 8 times a power of 2, or over 256) get none
    for group in (96, 512):
        assert quant_gemv.int4_gemv_candidates(1, group) == []
        assert not any(isinstance(c, quant_gemv.GemvConfig)
                       for c in qm.candidates_for(("int4", 1, 64, 1024, group, "torch.bfloat16", True)))
    assert qm.config_from_fields({"block_n": 16, "block_k": 64}) == quant_gemv.GemvConfig(16, 64)
    assert qm.config_from_fields({"block_n": 16, "block_k": 64, "prefetch": True}).prefetch
    # prefetching variants are timed at one row only (batch-1 decode), beside the plain ones
    for rows in (1, 2, 4):
        for configs in (quant_gemv.fp8_gemv_candidates(rows), quant_gemv.int4_gemv_candidates(rows, 128),
                        quant_gemv.fp8_block_gemv_candidates(rows, (128, 128))):
            fetching = [c for c in configs if c.prefetch]
            assert len(configs) == len(set(configs))
            assert bool(fetching) == (rows == 1)
            assert all(dataclasses.replace(c, prefetch=False) in configs for c in fetching)
    assert qm.config_from_fields({"block_m": 16, "block_n": 64, "block_k": 128}) == qm.GemmConfig(16, 64, 128)


@needs_triton
def test_a_chosen_matrix_vector_configuration_runs_the_matrix_vector_kernel(monkeypatch):
    """fp8_linear and int4_linear run whichever kernel the choice holds for the shape."""
    from fovea.engine.kernels import quant_gemv
    from fovea.engine.kernels import quant_matmul as qm

    ran = []
    for name in ("fp8_gemv", "int4_gemv"):
        real = getattr(quant_gemv, name)
        monkeypatch.setattr(quant_gemv, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    monkeypatch.setattr(qm, "_CHOSEN", {})
    weight, scale = fp8_weight(24, 64, seed=7)
    x = rand(2, 64, seed=8, dtype=torch.bfloat16)
    qm._CHOSEN[("fp8", 2, 24, 64, "torch.bfloat16")] = quant_gemv.GemvConfig(8, 32)
    y = qm.fp8_linear(x, weight, scale, impl="triton")
    xq, xs = torch_quant(x, 64)
    assert_close_for(y.float(), (xq.float() @ weight.float().t()) * xs * scale, torch.float32, 64,
                     storage=torch.bfloat16)
    packed, scales, zeros, w = make_int4(128, 24, 64, seed=9, with_zeros=True, dtype=torch.bfloat16)
    xi = rand(1, 128, seed=10, dtype=torch.bfloat16)
    qm._CHOSEN[("int4", 1, 24, 128, 64, "torch.bfloat16", True)] = quant_gemv.GemvConfig(16, 8)
    yi = qm.int4_linear(xi, packed, scales, zeros, 64, impl="fused")
    assert_close_for(yi.float(), xi.float() @ w.t(), torch.float32, 128, storage=torch.bfloat16)
    assert ran == ["fp8_gemv", "int4_gemv"]
