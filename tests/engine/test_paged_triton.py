"""The Triton paged-decode kernel against the torch reference. Runs where triton imports and
either CUDA is present or TRITON_INTERPRET=1 (triton's CPU interpreter); skipped otherwise."""


import pytest
import torch
from kernel_helpers import needs_triton

from fovea.engine.kernels.cases import poison_past_context, random_decode_case
from fovea.engine.model.attention import paged_decode_torch
from fovea.testing.tolerance import assert_close_for, attention_path_len


@needs_triton
@pytest.mark.parametrize("case", [(1, 4, 4, 64, 16, 1), (3, 8, 2, 64, 16, 40), (2, 8, 2, 128, 16, 1100),
                                  (3, 6, 2, 80, 8, 70)])
def test_triton_paged_decode_matches_torch(case):
    from fovea.engine.kernels import triton_decode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, heads, kv_heads, dim, block_size, ctx = case
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else [])
    for dtype in dtypes:
        q, kc, vc, bt, cl = random_decode_case(batch, heads, kv_heads, dim, block_size, ctx, dtype, device)
        got = triton_decode.paged_decode(q, kc, vc, bt, cl, dim ** -0.5).float()
        ref = paged_decode_torch(q.float(), kc.float(), vc.float(), bt, cl, dim ** -0.5)
        # The kernel accumulates in float32; a narrower dtype rounds its weights and its output.
        assert_close_for(got, ref, torch.float32, attention_path_len(dim, ctx), storage=dtype,
                         what=str(dtype))


def test_paged_decode_torch_equals_plain_attention():
    """The reference itself, against attention over the unpaged K/V."""
    q, kc, vc, bt, cl = random_decode_case(3, 8, 2, 32, 4, 21, torch.float32, torch.device("cpu"))
    out = paged_decode_torch(q, kc, vc, bt, cl, 0.2)
    for b in range(3):
        n = int(cl[b])
        k = kc[bt[b].long()].flatten(0, 1)[:n].repeat_interleave(4, dim=1)  # [n, H, D]
        v = vc[bt[b].long()].flatten(0, 1)[:n].repeat_interleave(4, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * 0.2, dim=-1)
        want = torch.einsum("hn,nhd->hd", weights, v)
        assert_close_for(out[b], want, torch.float32, attention_path_len(32, n))


def test_choose_config_policy():
    """The automatic split for LLaVA-7B shapes (32 KV heads, block 16) on 132 SMs: a few
    programs per SM at small batch, one pass with no merge at large batch, and a graph's wide
    table (256 blocks) adding no partitions past MAX_PARTS."""
    from fovea.engine.kernels.triton_decode import MAX_PARTS, choose_config

    parts = {(b, w): choose_config(b, 32, w, 16, 132).num_parts for b in (1, 32, 256) for w in (45, 256)}
    assert parts == {(1, 45): 12, (1, 256): MAX_PARTS, (32, 45): 3, (32, 256): 3, (256, 45): 1, (256, 256): 1}
    assert all(choose_config(b, 32, w, 16, 132).part_tokens == 0 for b, w in parts)  # sized on device
    assert choose_config(3, 8, 1, 16, 132).num_parts == 1  # never more partitions than tiles
    explicit = choose_config(1, 32, 45, 16, 132, partition_tokens=512)
    assert (explicit.num_parts, explicit.part_tokens) == (2, 512)
    assert choose_config(1, 32, 45, 16, 132, partition_tokens=4096).num_parts == 1


@needs_triton
@pytest.mark.parametrize("case", [
    # batch, heads, kv_heads, head_dim, block_size, max_ctx, table width, partition_tokens
    (1, 8, 8, 64, 16, 300, 128, None),   # automatic split, partitions past the context
    (2, 6, 2, 80, 8, 9, 40, None),       # contexts inside one tile, most partitions empty
    (3, 8, 2, 64, 16, 300, 48, 4096),    # one partition: a single pass over several tiles
    (3, 8, 2, 64, 16, 300, 48, 16),      # explicit partitions smaller than a tile
    (2, 8, 4, 64, 8, 250, 40, 100),      # explicit, not a multiple of the block or tile
])
def test_triton_paged_decode_wide_table(case):
    """Tables much wider than the contexts (as captured in a CUDA graph), with the columns
    past each context pointing at a block of NaN: any read of them would show."""
    from fovea.engine.kernels import triton_decode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, heads, kv_heads, dim, block_size, ctx, width, part = case
    q, kc, vc, bt, cl = random_decode_case(batch, heads, kv_heads, dim, block_size, ctx,
                                           torch.float32, device, seed=1, width=width)
    kc, vc, bt, ref_bt = poison_past_context(kc, vc, bt, cl)
    got = triton_decode.paged_decode(q, kc, vc, bt, cl, dim ** -0.5, part)
    ref = paged_decode_torch(q, kc, vc, ref_bt, cl, dim ** -0.5)
    assert torch.isfinite(got).all()
    assert_close_for(got, ref, torch.float32, attention_path_len(dim, ctx))
