"""The fused Triton kernels (add + RMSNorm, rotary + KV write, SiLU * up, matrix-vector)
against the torch ops they replace. Runs where triton imports and either CUDA is present
or TRITON_INTERPRET=1 (triton's CPU interpreter); skipped otherwise."""


import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEVICE, needs_triton

from fovea.engine.kernels.cases import rms_norm_reference, rope_reference
from fovea.testing.tolerance import assert_close_for


def rand(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("rows,cols", [(1, 64), (3, 1000)])
def test_add_rms_norm_adds_in_place_and_normalises_the_sum(rows, cols):
    from fovea.engine.kernels.triton_ops import add_rms_norm

    x, residual, weight = rand(rows, cols, seed=1), rand(rows, cols, seed=2), 1 + rand(cols, seed=3, scale=0.1)
    expected_sum = residual + x
    normed = add_rms_norm(x, weight, 1e-5, residual=residual)
    # The residual stream now holds the sum: one IEEE addition, rounded the same on every machine.
    assert torch.equal(residual, expected_sum)
    assert_close_for(normed, rms_norm_reference(expected_sum, weight, 1e-5), torch.float32, cols)
    assert_close_for(add_rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), torch.float32, cols)


@needs_triton
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_rope_write_kv_rotates_q_and_k_and_fills_the_cache_slots(heads, kv_heads):
    from fovea.engine.kernels.triton_ops import rope_write_kv

    tokens, dim, block_size = 5, 32, 4
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, seed=4)
    original = qkv.clone()
    positions = torch.tensor([0, 7, 3, 11, 2], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([torch.arange(16).float()[:, None] * inv[None]] * 2, -1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    k_cache = torch.zeros(6, block_size, kv_heads, dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, 0, 23, 4, 13], device=DEVICE)
    rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads, dim)
    q, k, v = original.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    c, s = cos[positions][:, None], sin[positions][:, None]
    # Rotation: x·cos + rotated(x)·sin, a sum of two products.
    q_ref = rope_reference(q.view(tokens, heads, dim), c, s)
    assert_close_for(qkv[:, :heads * dim].view(tokens, heads, dim), q_ref, torch.float32, 2)
    k_ref = rope_reference(k.view(tokens, kv_heads, dim), c, s)
    assert_close_for(k_cache.view(-1, kv_heads, dim)[slots], k_ref, torch.float32, 2)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v.view(tokens, kv_heads, dim))
    untouched = torch.ones(k_cache.shape[0] * block_size, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not k_cache.view(-1, kv_heads, dim)[untouched.to(DEVICE)].any()  # no other slot written


@needs_triton
def test_silu_mul_and_gemv_match_torch():
    from fovea.engine.kernels.triton_ops import gemv, silu_mul

    gate_up = rand(3, 2 * 300, seed=5)
    gate, up = gate_up.split(300, dim=1)
    assert_close_for(silu_mul(gate_up), F.silu(gate) * up, torch.float32, 1)  # elementwise: no reduction
    for rows, n, k in ((1, 40, 96), (3, 70, 300)):
        x, w = rand(rows, k, seed=6), rand(n, k, seed=7, scale=0.05)
        assert_close_for(gemv(x, w), x @ w.T, torch.float32, k)


@needs_triton
def test_the_startup_check_passes_and_names_a_broken_kernel(monkeypatch):
    """An engine runs this before trusting the kernels; a wrong kernel sends it to the torch path."""
    from fovea.engine.kernels import triton_ops
    from fovea.engine.runner.kernel_selfcheck import triton_self_check

    assert triton_self_check(DEVICE, torch.float32) is None
    monkeypatch.setattr(triton_ops, "silu_mul", lambda gate_up: torch.zeros_like(gate_up[:, : gate_up.shape[1] // 2]))
    assert "silu_mul" in triton_self_check(DEVICE, torch.float32)
