"""The Triton paged-decode kernel against the torch reference. Runs where triton imports and
either CUDA is present or TRITON_INTERPRET=1 (triton's CPU interpreter); skipped otherwise."""

import importlib.util
import os

import pytest
import torch

from fovea.engine.paged.attention import paged_decode_torch

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")


@needs_triton
@pytest.mark.parametrize("case", [(1, 4, 4, 64, 16, 1), (3, 8, 2, 64, 16, 40), (2, 8, 2, 128, 16, 1100),
                                  (3, 6, 2, 80, 8, 70)])
def test_triton_paged_decode_matches_torch(case):
    from fovea.engine.paged import triton_decode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, heads, kv_heads, dim, block_size, ctx = case
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else [])
    for dtype in dtypes:
        q, kc, vc, bt, cl = triton_decode.random_case(batch, heads, kv_heads, dim, block_size, ctx, dtype, device)
        got = triton_decode.paged_decode(q, kc, vc, bt, cl, dim ** -0.5).float()
        ref = paged_decode_torch(q.float(), kc.float(), vc.float(), bt, cl, dim ** -0.5)
        tol = 2e-4 if dtype == torch.float32 else 2e-2
        assert (got - ref).abs().max().item() < tol, dtype


def test_paged_decode_torch_equals_plain_attention():
    """The reference itself, against attention over the unpaged K/V."""
    from fovea.engine.paged.triton_decode import random_case

    q, kc, vc, bt, cl = random_case(3, 8, 2, 32, 4, 21, torch.float32, torch.device("cpu"))
    out = paged_decode_torch(q, kc, vc, bt, cl, 0.2)
    for b in range(3):
        n = int(cl[b])
        k = kc[bt[b].long()].flatten(0, 1)[:n].repeat_interleave(4, dim=1)  # [n, H, D]
        v = vc[bt[b].long()].flatten(0, 1)[:n].repeat_interleave(4, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * 0.2, dim=-1)
        assert torch.allclose(out[b], torch.einsum("hn,nhd->hd", weights, v), atol=1e-5)
