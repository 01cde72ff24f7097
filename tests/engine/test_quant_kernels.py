"""The quantised-weight kernels (FP8 activation quantiser, FP8 channel and block products, the int4
dequantising product) against references built here from the weight layouts' definitions. Runs
where triton imports and either CUDA is present or TRITON_INTERPRET=1 (triton's CPU interpreter);
the torch fallbacks are checked everywhere.

FP8 products are checked twice: against the float32 product of the same quantised activations and
the dequantised weight (the kernels' own error: float32 summation), and that product against the
unquantised one within the bound e4m3 rounding allows (a relative 2^-4 per element for normals,
half the subnormal step 2^-9 times the scale below them), summed over K with |W|."""

import pytest
import torch
from kernel_helpers import DEVICE, needs_triton

from fovea.testing.tolerance import assert_close_for

FP8 = torch.float8_e4m3fn


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def torch_quant(x, group):
    """The quantiser's definition: per row and group of columns, scale = max(absmax / 448, 1/(448*512)),
    q = e4m3(clamp(x / scale, -448, 448)), rounded as torch casts."""
    k = x.shape[1]
    xf = x.float()
    scales, qs = [], []
    for start in range(0, k, group):
        part = xf[:, start:start + group]
        # a tensor divisor: true division on CUDA too (a Python number there is multiplied by its reciprocal)
        s = (part.abs().amax(dim=1, keepdim=True) / torch.full((), 448.0, device=x.device)).clamp(
            min=1.0 / (448.0 * 512.0))
        scales.append(s)
        qs.append((part / s).clamp(-448.0, 448.0).to(FP8))
    return torch.cat(qs, 1), torch.cat(scales, 1)


def expand_scales(xs, group, k):
    return xs.repeat_interleave(group, dim=1)[:, :k]


def quantisation_bound(x, xs_full, w):
    """|quant(x) @ W^T - x @ W^T| <= (2^-4 |x| + 2^-10 scale) @ |W|^T, elementwise."""
    return (2.0 ** -4 * x.float().abs() + 2.0 ** -10 * xs_full) @ w.abs().t()


def make_int4(k, n, group, seed, with_zeros, dtype):
    """(packed [K/8, N] int32, scales, zeros or None, W [N, K] float32), W from the layout's definition."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    groups = k // group
    s = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).to(dtype)
    z = torch.randint(0, 16, (groups, n), generator=g).to(dtype) if with_zeros else None
    zf = z.float() if with_zeros else torch.full((groups, n), 8.0)
    w = torch.empty(n, k)
    for kk in range(k):
        w[:, kk] = (q[:, kk].float() - zf[kk // group]) * s[kk // group].float()
    packed = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        packed |= q[:, j::8].t().to(torch.int64) << (4 * j)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed.to(DEVICE), s.to(DEVICE), (z.to(DEVICE) if z is not None else None), w.to(DEVICE)


def make_fp8(n, k, seed, block=None):
    """(weight fp8 [N, K], scale, W [N, K] float32): per-channel scales [N] or block scales."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    if block is None:
        scale = torch.rand(n, generator=g) * 1e-3 + 1e-4
        w = weight.float() * scale[:, None]
    else:
        bn, bk = block
        scale = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 1e-3 + 1e-4
        w = weight.float() * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.to(DEVICE), scale.to(DEVICE), w.to(DEVICE)


def e4m3_edge_values():
    """(every finite e4m3 value, the midpoints between neighbours (ties) and the floats either side)."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    return vals, torch.cat([mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])


# ----------------------------------------------------------------------------------------------- quantiser


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_per_token_rounds_as_torch_casts(dtype):
    from fovea.engine.kernels.fp8_quantize import quantize_per_token

    exact, ties = e4m3_edge_values()
    rows = torch.zeros(5, exact.numel() + ties.numel())
    rows[0] = torch.cat([exact, ties])  # the scale is 1: x / scale are the edge values themselves
    rows[1] = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(1)) * 1e3
    rows[2] = 0.0  # a zero row
    rows[3] = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(2)) * 1e-9  # below the min scale
    rows[4] = -rows[1] * 1e-5
    x = rows.to(dtype).to(DEVICE)
    q, s = quantize_per_token(x)
    q_ref, s_ref = torch_quant(x, x.shape[1])
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (5, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # bit for bit, ties and signed zeros too
    if dtype == torch.float32:
        assert torch.equal(q[0, :exact.numel()].float().cpu(), exact)  # representable values come back exactly
    assert not q[2].float().any() and s[2].item() == pytest.approx(1 / (448 * 512))
    qf = q.float()
    assert qf.isfinite().all() and qf.abs().max() <= 448
    assert torch.equal(qf[[0, 1, 4]].abs().amax(dim=1).cpu(), torch.full((3,), 448.0))  # each row's max saturates


@needs_triton
def test_the_quotients_are_torch_s_for_scales_that_are_not_powers_of_two():
    """x / scale rounded once to float32, as torch divides, for 2,048 rows of scales spread over
    twelve decades: on the GPU the quotient comes from the scale's reciprocal and one correction
    (``fp8_rounding.correctly_rounded_quotient``), and a quotient one ulp off lands on the other
    side of an e4m3 tie now and then. The e4m3 ties scaled by 3 and 5/7 make such quotients on
    purpose; the random rows (~8 million values) find the rest."""
    from fovea.engine.kernels.fp8_quantize import quantize_per_token

    exact, ties = e4m3_edge_values()
    edges = torch.cat([exact, ties])
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(2048, 4096, generator=g) * torch.pow(10.0, torch.rand(2048, 1, generator=g) * 12 - 6)
    rows[0, :edges.numel()] = edges * 3.0
    rows[1, :edges.numel()] = edges * (5.0 / 7.0)
    x = rows.to(DEVICE)
    q, s = quantize_per_token(x)
    q_ref, s_ref = torch_quant(x, x.shape[1])
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@needs_triton
def test_quantize_per_token_group_and_the_two_pass_path(monkeypatch):
    from fovea.engine.kernels import fp8_quantize

    x = rand(3, 200, seed=3, scale=5.0, dtype=torch.bfloat16)
    x[1, 64:128] = 0  # one zero group
    q, s = fp8_quantize.quantize_per_token_group(x, 64)
    q_ref, s_ref = torch_quant(x, 64)
    assert s.shape == (3, 4)  # the last group holds 8 columns
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    monkeypatch.setattr(fp8_quantize, "MAX_ONE_PASS", 64)  # a row wider than one pass: absmax, then quantise
    q, s = fp8_quantize.quantize_per_token(x)
    q_ref, s_ref = torch_quant(x, 200)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_the_torch_quantiser_is_the_same(monkeypatch):
    from fovea.engine.kernels import fp8_quantize

    monkeypatch.setattr(fp8_quantize, "can_run_triton", lambda t: False)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4)) * 3
    for group in (96, 32, 40):
        q, s = fp8_quantize.quantize_per_token_group(x, group)
        q_ref, s_ref = torch_quant(x, group)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# ----------------------------------------------------------------------------------------------- FP8


def check_fp8(y, x, w, xs_full, xq, bias, out_dtype, k):
    """y against quant(x) @ W^T (+ bias), and that against x @ W^T within the quantisation bound."""
    ref_q = (xq.float() * xs_full) @ w.t()
    if bias is not None:
        ref_q = ref_q + bias.float()
    assert y.dtype == out_dtype and y.shape == ref_q.shape
    assert_close_for(y.float(), ref_q, torch.float32, k, storage=out_dtype if out_dtype != torch.float32 else None,
                     what="kernel vs the same quantised activations")
    exact = x.float() @ w.t() + (bias.float() if bias is not None else 0)
    slack = 8 * 2.0 ** -24 * k ** 0.5 * float(exact.abs().max())
    excess = (ref_q - exact).abs() - quantisation_bound(x, xs_full, w) - slack
    assert excess.max() <= 0, f"activation quantisation error beyond e4m3's bound by {excess.max():.3g}"


@needs_triton
@pytest.mark.parametrize("rows,impl", [(1, "triton"), (3, "triton"), (3, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_channel_scales(rows, impl, dtype):
    from fovea.engine.kernels.quant_matmul import fp8_linear

    n, k = 40, 96  # N not a multiple of the tile
    weight, scale, w = make_fp8(n, k, seed=5)
    x = rand(rows, k, seed=6, dtype=dtype)
    bias = rand(n, seed=7, dtype=dtype) if rows == 3 else None
    y = fp8_linear(x, weight, scale, bias, impl=impl)
    xq, xs = torch_quant(x, k)
    check_fp8(y, x, w, expand_scales(xs, k, k), xq, bias, dtype, k)


@needs_triton
def test_fp8_gemm_split_over_k_and_leading_dims():
    from fovea.engine.kernels.quant_matmul import GemmConfig, fp8_gemm, fp8_linear

    n, k = 24, 128
    weight, scale, w = make_fp8(n, k, seed=8)
    x = rand(2, 3, k, seed=9)
    xq, xs = torch_quant(x.reshape(-1, k), k)
    y = fp8_gemm(xq, xs, weight, scale, None, torch.float32, config=GemmConfig(16, 16, 32, split_k=3))
    check_fp8(y, x.reshape(-1, k), w, expand_scales(xs, k, k), xq, None, torch.float32, k)
    assert fp8_linear(x, weight, scale, impl="triton").shape == (2, 3, n)


@needs_triton
@pytest.mark.parametrize("rows,split", [(1, 0), (3, 2)])
def test_fp8_block_linear(rows, split):
    from fovea.engine.kernels.quant_matmul import GemmConfig, fp8_block_linear

    n, k, block = 136, 320, (128, 128)  # a partial block in N and in K
    weight, scale, w = make_fp8(n, k, seed=10, block=block)
    assert scale.shape == (2, 3)
    x = rand(rows, k, seed=11, dtype=torch.bfloat16)
    x[:, 128:256] *= 30  # the groups differ in scale, as real activations do
    bias = rand(n, seed=12, dtype=torch.bfloat16)
    y = fp8_block_linear(x, weight, scale, block, bias, config=GemmConfig(16, 64, 128, split_k=split))
    xq, xs = torch_quant(x, 128)
    check_fp8(y, x, w, expand_scales(xs, 128, k), xq, bias, torch.bfloat16, k)


@needs_triton
def test_fp8_block_scales_are_read_per_block():
    """A wrong block scale (the kernel reading [n // bn, k // bk] wrongly) moves the result."""
    from fovea.engine.kernels.quant_matmul import fp8_block_linear

    n, k, block = 32, 64, (16, 32)
    weight, scale, _ = make_fp8(n, k, seed=13, block=block)
    x = rand(1, k, seed=14)
    base = fp8_block_linear(x, weight, scale, block)
    scale2 = scale.clone()
    scale2[1, 0] *= 2  # rows 16..31, columns 0..31
    moved = fp8_block_linear(x, weight, scale2, block)
    assert torch.equal(moved[:, :16], base[:, :16]) and not torch.equal(moved[:, 16:], base[:, 16:])
    xq, xs = torch_quant(x, 32)
    w2 = weight.float() * scale2.repeat_interleave(16, 0).repeat_interleave(32, 1)
    check_fp8(moved, x, w2, expand_scales(xs, 32, k), xq, None, torch.float32, k)


def test_fp8_torch_paths(monkeypatch):
    """Without a kernel (CPU, no interpreter): the same quantised computation in torch."""
    from fovea.engine.kernels import fp8_quantize, quant_matmul

    monkeypatch.setattr(fp8_quantize, "can_run_triton", lambda t: False)
    monkeypatch.setattr(quant_matmul, "can_run_triton", lambda t: False)
    n, k = 20, 64
    weight, scale, w = make_fp8(n, k, seed=15)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(16)).to(DEVICE)
    xq, xs = torch_quant(x, k)
    check_fp8(quant_matmul.fp8_linear(x, weight, scale, impl="torch"), x, w, expand_scales(xs, k, k), xq, None,
              torch.float32, k)
    weight, scale, w = make_fp8(n, k, seed=17, block=(16, 32))
    monkeypatch.setattr(quant_matmul, "_triton_fp8_runs", lambda t: False)
    xq, xs = torch_quant(x, 32)
    check_fp8(quant_matmul.fp8_block_linear(x, weight, scale, (16, 32)), x, w, expand_scales(xs, 32, k), xq, None,
              torch.float32, k)


# ----------------------------------------------------------------------------------------------- int4


@needs_triton
@pytest.mark.parametrize("rows,group,with_zeros,dtype", [
    (1, 32, True, torch.bfloat16), (3, 64, False, torch.bfloat16), (3, 128, True, torch.float32),
    (1, 64, False, torch.float16)])
def test_int4_linear_matches_the_dequantised_weight(rows, group, with_zeros, dtype):
    from fovea.engine.kernels.quant_matmul import int4_linear

    n, k = 72, 128  # N not a multiple of 8 tiles of 64
    packed, scales, zeros, w = make_int4(k, n, group, seed=18, with_zeros=with_zeros, dtype=dtype)
    x = rand(rows, k, seed=19, dtype=dtype)
    bias = rand(n, seed=20, dtype=dtype) if with_zeros else None
    y = int4_linear(x, packed, scales, zeros, group, bias)
    ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
    assert y.dtype == dtype and y.shape == (rows, n)
    assert_close_for(y.float(), ref, torch.float32, k, storage=dtype if dtype != torch.float32 else None)


@needs_triton
@pytest.mark.parametrize("config", [(16, 32, 32, 2), (32, 64, 64, 1)])
def test_int4_gemm_configs_split_and_tiled(config):
    from fovea.engine.kernels.quant_matmul import GemmConfig, int4_gemm

    n, k, group = 48, 256, 64
    packed, scales, zeros, w = make_int4(k, n, group, seed=21, with_zeros=True, dtype=torch.float32)
    x = rand(5, k, seed=22)
    bias = rand(n, seed=23)
    y = int4_gemm(x, packed, scales, zeros, group, bias, GemmConfig(*config))
    assert_close_for(y, x @ w.t() + bias, torch.float32, k)


@needs_triton
def test_int4_sees_every_nibble_and_the_zeros():
    """Swapping two nibbles of one packed word changes exactly that output column, as the
    reference of the swapped weight says; the zero points change the result."""
    from fovea.engine.kernels.quant_matmul import int4_linear

    n, k, group = 16, 64, 32
    packed, scales, zeros, w = make_int4(k, n, group, seed=24, with_zeros=True, dtype=torch.float32)
    x = rand(1, k, seed=25)
    base = int4_linear(x, packed, scales, zeros, group)
    word = int(packed[3, 5])
    lo, hi = word & 0xF, (word >> 4) & 0xF
    assert lo != hi  # the seed gives a word whose first two nibbles differ
    swapped = packed.clone()
    new = (word & ~0xFF) | (lo << 4) | hi
    swapped[3, 5] = new - (1 << 32) if new >= (1 << 31) else new
    y = int4_linear(x, swapped, scales, zeros, group)
    changed = (y != base).nonzero()[:, 1].unique().tolist()
    assert changed == [5]
    w2 = w.clone()
    w2[5, 24], w2[5, 25] = w[5, 25], w[5, 24]
    assert_close_for(y, x @ w2.t(), torch.float32, k)
    symmetric = int4_linear(x, packed, scales, None, group)
    assert not torch.allclose(symmetric, base)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_nibble,fold", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("with_zeros", [True, False])
def test_int4_gemm_magic_unpacking(dtype, per_nibble, fold, with_zeros):
    """The codes made floats from their bits (one product per nibble position or not; the zero
    points taken off each weight or off the accumulator) give the product of the dequantised
    weight, split over K and not; rows 1 and 5 (decode). (Float32 activations never fold.)"""
    from fovea.engine.kernels.quant_matmul import GemmConfig, int4_gemm

    n, k, group = 40, 512, 128
    packed, scales, zeros, w = make_int4(k, n, group, seed=40, with_zeros=with_zeros, dtype=dtype)
    for rows, split in ((1, 0), (5, 1)):
        x = rand(rows, k, seed=41 + rows, dtype=dtype)
        bias = rand(n, seed=43, dtype=dtype) if split else None
        config = GemmConfig(16, 32, 128, split, 4, 3, magic=True, per_nibble=per_nibble, fold=fold)
        y = int4_gemm(x, packed, scales, zeros, group, bias, config)
        ref = x.float() @ w.t() + (bias.float() if bias is not None else 0)
        assert y.dtype == dtype
        assert_close_for(y.float(), ref, torch.float32, k, storage=dtype if dtype != torch.float32 else None)


def test_int4_candidates_keep_the_old_unpacking_and_fit_the_group():
    from fovea.engine.kernels.quant_matmul import int4_candidates

    for rows in (1, 8, 64, 256, 2048):
        every = int4_candidates(rows, 128)
        assert every[0].magic and any(c.fold for c in every)
        assert [c for c in every if not c.magic] == int4_candidates(rows, 128, "shift")[:1]  # the old default stays
        assert all(c.magic for c in int4_candidates(rows, 128, "magic"))
    assert all(c.block_k == 32 and not c.per_nibble for c in int4_candidates(1, 32))
    with pytest.raises(ValueError, match="unpack"):
        int4_candidates(1, 128, "lop3")


def test_the_choice_skips_a_candidate_that_cannot_run(monkeypatch):
    """A candidate that fails (a tile past the GPU's shared memory) is logged and skipped; the
    fastest of the others is kept. Only when none runs does the error surface."""
    from fovea.engine.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "_cannot_time", lambda: False)
    monkeypatch.setattr(qm, "_CHOSEN", {})
    monkeypatch.setattr(qm, "launch_time", lambda launch: launch())
    cands = [qm.GemmConfig(16, 64, 128), qm.GemmConfig(16, 32, 128), qm.GemmConfig(16, 128, 128)]

    def launch(c):
        if c.block_n == 64:
            raise RuntimeError("out of resources: shared memory")
        return {32: 2.0, 128: 1.0}[c.block_n]
    assert qm._choose(("int4", 1), cands, launch) == cands[2]
    with pytest.raises(RuntimeError, match="out of resources"):
        qm._choose(("int4", 2), [cands[0], cands[0]], launch)  # (one candidate alone is not timed)


def test_a_candidate_that_disagrees_with_the_first_is_never_chosen(monkeypatch, caplog):
    """Each candidate's output is compared with the first one's before it is timed: one that a
    compiler got wrong here (a misread weight) is logged and left out, however fast; one that
    differs by output rounding alone stays a candidate."""
    from fovea.engine.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "_cannot_time", lambda: False)
    monkeypatch.setattr(qm, "_CHOSEN", {})
    ref = torch.linspace(-2, 2, 64).to(torch.bfloat16).reshape(2, 32)
    outputs = {64: ref, 32: ref.float().mul(1 + 2 ** -8).to(torch.bfloat16),  # one rounding step off: agrees
               128: ref.flip(1)}  # the fastest, and wrong
    speed = {id(outputs[64]): 3.0, id(outputs[32]): 2.0, id(outputs[128]): 1.0}
    monkeypatch.setattr(qm, "launch_time", lambda launch: speed[id(launch())])
    cands = [qm.GemmConfig(16, 64, 128), qm.GemmConfig(16, 32, 128), qm.GemmConfig(16, 128, 128)]
    assert qm._choose(("fp8", 1), cands, lambda c: outputs[c.block_n]) == cands[1]
    assert "16x128x128" in caplog.text and "disagrees" in caplog.text
    assert qm._disagreement(ref, ref.float()) is None
    assert "shape" in qm._disagreement(ref[:1], ref)
    assert qm._disagreement(torch.full_like(ref, float("nan")), ref) is not None


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_zeros", [True, False])
def test_int4_dequantize_is_the_weight_rounded_once(dtype, with_zeros):
    """The Triton dequantiser computes (q - z) * s in float32, as the reference does, and rounds
    once to the dtype: bit for bit the reference weight, into a flat scratch buffer's front."""
    from fovea.engine.kernels.quant_matmul import int4_dequantize

    n, k, group = 200, 256, 64  # N not a multiple of the 128-column tile
    packed, scales, zeros, w = make_int4(k, n, group, seed=44, with_zeros=with_zeros, dtype=dtype)
    scratch = torch.full((k * n + 77,), -1.0, dtype=dtype, device=DEVICE)
    got = int4_dequantize(packed, scales, zeros, group, scratch)
    assert got.shape == (k, n) and got.data_ptr() == scratch.data_ptr()
    assert torch.equal(got, w.t().to(dtype))
    assert torch.equal(scratch[k * n:], torch.full((77,), -1.0, dtype=dtype, device=DEVICE))  # nothing past it
    with pytest.raises(ValueError, match="needs"):
        int4_dequantize(packed, scales, zeros, group, scratch[:k * n - 1])
    with pytest.raises(ValueError, match="needs"):
        int4_dequantize(packed, scales, zeros, group, torch.empty(k * n, dtype=torch.float16, device=DEVICE))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_takes_the_dequantising_path_from_the_threshold(dtype, monkeypatch):
    """From INT4_DEQUANT_MIN_ROWS rows (lowered here: the interpreter is slow) the weight is
    dequantised into the caller's scratch buffer and multiplied by torch. Its error bound: the
    float32 sums' (as the fused kernel), plus the weight's one rounding to the dtype, at most
    eps(dtype) / 2 of each |x_k w_k| term."""
    from fovea.engine.kernels import quant_matmul
    from fovea.testing.tolerance import eps, reduction_atol

    monkeypatch.setattr(quant_matmul, "INT4_DEQUANT_MIN_ROWS", 4)
    n, k, group = 72, 256, 128
    packed, scales, zeros, w = make_int4(k, n, group, seed=45, with_zeros=True, dtype=dtype)
    scratch = torch.zeros(k * n, dtype=dtype, device=DEVICE)
    calls = []
    real = quant_matmul.int4_dequantize
    monkeypatch.setattr(quant_matmul, "int4_dequantize", lambda *a: calls.append(a[-1]) or real(*a))
    for rows, path in ((3, "fused"), (4, "dequant"), (9, "dequant")):
        x = rand(rows, k, seed=46 + rows, dtype=dtype)
        bias = rand(n, seed=47, dtype=dtype)
        calls.clear()
        y = quant_matmul.int4_linear(x, packed, scales, zeros, group, bias, scratch=scratch)
        assert bool(calls) == (path == "dequant") and all(c is scratch for c in calls)
        ref = x.float() @ w.t() + bias.float()
        rounding = eps(dtype) / 2 * (x.float().abs() @ w.abs().t())
        storage = dtype if dtype != torch.float32 else None
        atol = reduction_atol(torch.float32, k, float(ref.abs().max()), storage=storage)
        assert y.dtype == dtype and y.shape == (rows, n)
        excess = (y.float() - ref).abs() - rounding - atol
        assert excess.max() <= 0, f"{path}: beyond the bound by {excess.max():.3g}"
    assert torch.equal(scratch.view(k, n), w.t().to(dtype))  # the last call's weight, in the scratch
    # Forced either way, with no scratch (a temporary), the same results within the bound
    x = rand(6, k, seed=48, dtype=dtype)
    fused = quant_matmul.int4_linear(x, packed, scales, zeros, group, impl="fused").float()
    dequant = quant_matmul.int4_linear(x, packed, scales, zeros, group, impl="dequant").float()
    bound = eps(dtype) / 2 * (x.float().abs() @ w.abs().t()) + 2 * reduction_atol(
        torch.float32, k, float(fused.abs().max()), storage=dtype if dtype != torch.float32 else None)
    assert ((fused - dequant).abs() <= bound).all()
    with pytest.raises(ValueError, match="impl"):
        quant_matmul.int4_linear(x, packed, scales, zeros, group, impl="cublas")


@needs_triton
def test_the_start_up_check_runs_both_int4_paths(monkeypatch):
    """The quantized layers' start-up check runs the int4 layers on few rows (the fused kernel) and
    on INT4_DEQUANT_MIN_ROWS rows (the dequantiser and torch's matmul), and notices either wrong."""
    from types import SimpleNamespace

    from fovea.engine.kernels import quant_matmul
    from fovea.engine.model.quant_linear import quantized_kernels_problem
    from fovea.quant.weights import Int4Weight

    monkeypatch.setattr(quant_matmul, "INT4_DEQUANT_MIN_ROWS", 16)  # the interpreter is slow
    gen = torch.Generator().manual_seed(50)
    layers = [SimpleNamespace(qkv=Int4Weight.random(48, 128, 32, symmetric=False, generator=gen).to(DEVICE),
                              down=Int4Weight.random(32, 64, 32, generator=gen).to(DEVICE))]
    real = quant_matmul.int4_dequantize
    calls = []
    monkeypatch.setattr(quant_matmul, "int4_dequantize", lambda *a: calls.append(1) or real(*a))
    assert quantized_kernels_problem(layers, torch.bfloat16, DEVICE) is None
    assert len(calls) == 2  # q/k/v and down, once each
    monkeypatch.setattr(quant_matmul, "int4_dequantize", lambda *a: real(*a).mul_(1.1))
    problem = quantized_kernels_problem(layers, torch.bfloat16, DEVICE)
    assert problem is not None and "qkv (16 rows): relative error" in problem


def test_int4_torch_path(monkeypatch):
    from fovea.engine.kernels import quant_matmul

    monkeypatch.setattr(quant_matmul, "can_run_triton", lambda t: False)
    n, k, group = 24, 64, 32
    for with_zeros in (True, False):
        packed, scales, zeros, w = make_int4(k, n, group, seed=26, with_zeros=with_zeros, dtype=torch.float32)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(27)).to(DEVICE)
        assert_close_for(quant_matmul.int4_linear(x, packed, scales, zeros, group), x @ w.t(), torch.float32, k)
    with pytest.raises(ValueError, match="do not fit"):
        quant_matmul.int4_linear(torch.zeros(1, 48, device=DEVICE), packed, scales, zeros, group)


# ----------------------------------------------------------------------------------------------- graphs


# Defined only where CUDA is (not skipped elsewhere: the interpreter run of these files, in
# test_kernels_interpreted, takes any skip for a kernel that did not run).
if torch.cuda.is_available():
    def test_the_products_replay_in_a_cuda_graph():
        from fovea.engine.kernels.quant_matmul import fp8_block_linear, fp8_linear, int4_linear

        n, k, group = 256, 512, 128
        packed, scales, zeros, _ = make_int4(k, n, group, seed=28, with_zeros=True, dtype=torch.bfloat16)
        weight, scale, _ = make_fp8(n, k, seed=29)
        bweight, bscale, _ = make_fp8(n, k, seed=30, block=(128, 128))
        x = rand(4, k, seed=31, dtype=torch.bfloat16)
        calls = [lambda: int4_linear(x, packed, scales, zeros, group), lambda: fp8_linear(x, weight, scale),
                 lambda: fp8_block_linear(x, bweight, bscale, (128, 128))]
        eager = [f() for f in calls]  # chooses and compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [f() for f in calls]
        x.copy_(rand(4, k, seed=32, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        again = [f() for f in calls]
        for got, want, before in zip(outs, again, eager, strict=True):
            assert torch.equal(got, want) and not torch.equal(got, before)

    def test_the_dequantising_int4_path_replays_in_a_cuda_graph_into_its_scratch():
        from fovea.engine.kernels.quant_matmul import INT4_DEQUANT_MIN_ROWS, int4_linear

        n, k, group = 256, 512, 128
        packed, scales, zeros, _ = make_int4(k, n, group, seed=33, with_zeros=True, dtype=torch.bfloat16)
        scratch = torch.empty(k * n, dtype=torch.bfloat16, device=DEVICE)
        x = rand(INT4_DEQUANT_MIN_ROWS, k, seed=34, dtype=torch.bfloat16)
        eager = int4_linear(x, packed, scales, zeros, group, scratch=scratch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = int4_linear(x, packed, scales, zeros, group, scratch=scratch)
        x.copy_(rand(INT4_DEQUANT_MIN_ROWS, k, seed=35, dtype=torch.bfloat16))
        scratch.zero_()  # what another layer would leave there
        graph.replay()
        torch.cuda.synchronize()
        again = int4_linear(x, packed, scales, zeros, group, scratch=scratch)
        assert torch.equal(out, again) and not torch.equal(out, eager)
