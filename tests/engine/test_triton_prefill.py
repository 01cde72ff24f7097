"""The Triton paged-prefill kernel against the torch reference. The kernel tests run where triton
imports and either CUDA is present or TRITON_INTERPRET=1 (triton's CPU interpreter); the
reference's own test always runs."""


import pytest
import torch
from kernel_helpers import DEVICE, needs_triton

from fovea.engine.kernels import triton_prefill as tp
from fovea.engine.kernels.cases import prefill_torch_reference, random_prefill_case
from fovea.testing.tolerance import assert_close_for, attention_path_len

SMALL_TILES = tp.PrefillConfig(16, 16, 4, 2)  # many query and key tiles even for short chunks


def _dtypes(extra_on_cpu=()):
    if DEVICE.type == "cuda":
        return [torch.float32, torch.bfloat16, torch.float16]
    return [torch.float32, *extra_on_cpu]


def _compare(spans, heads, kv_heads, dim, block_size, dtype, config=None, seed=0):
    q, kc, vc, cu, qs, bt, max_len = random_prefill_case(spans, heads, kv_heads, dim, block_size, dtype,
                                                         DEVICE, seed)
    scale = dim ** -0.5
    got = tp.paged_prefill(q, kc, vc, cu, qs, bt, scale, max_len, config=config)
    assert got.dtype == dtype and got.shape == q.shape
    ref = prefill_torch_reference(q.float(), kc.float(), vc.float(), cu, qs, bt, scale, max_len)
    # float32 accumulators; a narrower dtype rounds the weights and the output. NaN (a read of a
    # poisoned slot past the causal bound) fails too.
    context = max(start + length for start, length in spans)
    assert_close_for(got.float(), ref, torch.float32, attention_path_len(dim, context), storage=dtype,
                     what=str(dtype))


@needs_triton
@pytest.mark.parametrize("case", [
    # heads, kv_heads, head_dim, block_size, spans (start, length) per chunk
    (4, 4, 64, 16, [(0, 1)]),  # a single token from position 0
    (8, 2, 64, 16, [(0, 37), (21, 1), (40, 70), (16, 16)]),  # GQA, ragged, a block-aligned start
    (4, 1, 64, 8, [(0, 20), (33, 9), (8, 1), (5, 3)]),  # block_size 8, four query heads per KV head
    (2, 2, 32, 16, [(3, 1), (0, 2), (31, 1)]),  # only single-token and tiny chunks
], ids=["one-token", "gqa-ragged", "bs8-gqa4", "tiny"])
def test_paged_prefill_matches_reference(case):
    heads, kv_heads, dim, block_size, spans = case
    for dtype in _dtypes():
        _compare(spans, heads, kv_heads, dim, block_size, dtype)


@needs_triton
def test_paged_prefill_small_tiles_cross_tile_boundaries():
    """16x16 tiles: several query tiles per chunk, fully visible and causal key tiles, starts
    inside and at the edge of tiles, an empty chunk, a single token far into its sequence."""
    spans = [(0, 50), (13, 41), (100, 1), (7, 0), (32, 33)]
    for dtype in _dtypes(extra_on_cpu=(torch.float16,)):
        _compare(spans, 4, 2, 64, 16, dtype, config=SMALL_TILES, seed=1)
        _compare(spans, 2, 1, 64, 8, dtype, config=SMALL_TILES, seed=2)


@needs_triton
def test_paged_prefill_padded_head_dim():
    """head_dim 48 (padded to 64 in the kernel) and block_size 32."""
    _compare([(0, 40), (65, 30)], 6, 2, 48, 32, torch.float32)


@needs_triton
def test_paged_prefill_strided_q_and_out():
    """q as a view of a fused qkv buffer (row stride > H*D) written into a given ``out``."""
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    q, kc, vc, cu, qs, bt, max_len = random_prefill_case([(0, 9), (20, 12)], heads, kv_heads, dim, bs,
                                                         torch.float32, DEVICE, seed=3)
    qkv = torch.zeros(q.shape[0], heads + 2 * kv_heads, dim, device=DEVICE)
    qkv[:, :heads] = q
    out = torch.full((q.shape[0], heads, dim), float("nan"), device=DEVICE)
    got = tp.paged_prefill(qkv[:, :heads], kc, vc, cu, qs, bt, 0.1, max_len, out)
    assert got is out
    ref = prefill_torch_reference(q, kc, vc, cu, qs, bt, 0.1, max_len)
    assert_close_for(out, ref, torch.float32, attention_path_len(dim, 32))


def test_prefill_reference_equals_naive_attention():
    """The reference itself, against per-query attention over unpaged K/V written into a
    shuffled paged cache."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, scale = 6, 2, 16, 4, 0.3
    spans = [(0, 7), (5, 4), (9, 1), (0, 1)]
    num_blocks = 20
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-(s + n) // bs) for s, n in spans)
    tables = torch.zeros(len(spans), width, dtype=torch.int32)
    seqs = []
    for i, (start, n) in enumerate(spans):
        total = start + n
        k = torch.randn(total, kv_heads, dim, generator=gen)  # the sequence's K/V, unpaged
        v = torch.randn(total, kv_heads, dim, generator=gen)
        for j in range(-(-total // bs)):
            tables[i, j] = perm.pop()
        for p in range(total):
            block, offset = int(tables[i, p // bs]), p % bs
            k_cache[block, offset], v_cache[block, offset] = k[p], v[p]
        seqs.append((k, v))
    q = torch.randn(sum(n for _, n in spans), heads, dim, generator=gen)
    cu = torch.tensor([0] + torch.tensor([n for _, n in spans]).cumsum(0).tolist(), dtype=torch.int32)
    starts = torch.tensor([s for s, _ in spans], dtype=torch.int32)
    out = prefill_torch_reference(q, k_cache, v_cache, cu, starts, tables, scale, 7)

    group = heads // kv_heads
    for i, (start, n) in enumerate(spans):
        k, v = seqs[i]
        for j in range(n):
            row, pos = int(cu[i]) + j, start + j
            for h in range(heads):
                w = torch.softmax(k[:pos + 1, h // group] @ q[row, h] * scale, dim=0)
                assert_close_for(out[row, h], w @ v[:pos + 1, h // group], torch.float32,
                                 attention_path_len(dim, pos + 1))
    with pytest.raises(ValueError):  # a chunk longer than max_q_len
        prefill_torch_reference(q, k_cache, v_cache, cu, starts, tables, scale, 6)
