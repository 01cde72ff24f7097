"""fovea.testing.tolerance: the bound covers any summation order and still catches a real error."""

import math

import pytest
import torch

from fovea.testing.tolerance import assert_close_for, max_error, reduction_atol, transformer_path_len


def test_the_bound_is_k_eps_sqrt_n_scale_plus_one_storage_rounding():
    e32, ebf = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert reduction_atol(torch.float32, 400, 3.0) == pytest.approx(8 * e32 * 20 * 3.0)
    assert reduction_atol(torch.float32, 400, 3.0, storage=torch.bfloat16) == pytest.approx(
        8 * (e32 * 20 + ebf) * 3)
    wider = reduction_atol(torch.float32, 400, 3.0, storage=torch.float64)  # no narrower storage: no term
    assert wider == reduction_atol(torch.float32, 400, 3.0)
    assert reduction_atol(torch.float16, 1, 1.0, k=1) == torch.finfo(torch.float16).eps


@pytest.mark.parametrize("n", [16, 256, 4096, 65536])
def test_sums_in_different_orders_stay_inside_the_bound(n):
    """float32 dot products summed forwards, backwards, pairwise and in blocks (what different CPUs,
    thread counts and kernels do) against each other."""
    gen = torch.Generator().manual_seed(n)
    a, b = torch.randn(64, n, generator=gen), torch.randn(64, n, generator=gen)
    terms = a * b
    forwards = torch.zeros(64)
    for i in range(n):
        forwards += terms[:, i]
    backwards = torch.zeros(64)
    for i in reversed(range(n)):
        backwards += terms[:, i]
    blocked = terms.view(64, -1, 16).sum(-1).sum(-1)
    for got in (backwards, blocked, (a @ b.T).diagonal()):
        assert_close_for(got, forwards, torch.float32, n)


def test_a_real_error_fails():
    """One wrong term in 4096 (what an off-by-one in a kernel's loop bound does) is far outside."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 4096, generator=gen), torch.randn(8, 4096, generator=gen)
    ref = (a * b).sum(-1)
    wrong = (a[:, :-1] * b[:, :-1]).sum(-1)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_for(wrong, ref, torch.float32, 4096)


def test_nan_and_shape_mismatch_fail():
    with pytest.raises(AssertionError):
        assert_close_for(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), torch.float32, 1)
    with pytest.raises(AssertionError, match="shape"):
        assert_close_for(torch.zeros(2), torch.zeros(3), torch.float32, 1)
    assert math.isnan(max_error(torch.tensor([float("nan")]), torch.tensor([0.0])))


def test_a_decoder_path_counts_every_reduction():
    # 2 layers of (2 norms 2·8 + qkv 8 + scores 4 + softmax and sum 2·5 + o 2·4 + gate/up 8 + down 20),
    # then the final norm and the head
    assert transformer_path_len(8, 20, 2, 5, heads=2) == 2 * (16 + 8 + 4 + 10 + 8 + 8 + 20) + 16
