"""The fused forward (fused q/k/v and gate/up weights, Triton norm/rotary/activation
kernels) against the torch-op forward on the demo model. The kernels run where triton
imports and either CUDA is present or TRITON_INTERPRET=1 (triton's CPU interpreter)."""

import copy
import importlib.util
import os

import pytest
import torch

from fovea.engine.paged.attention import AttnMeta, DecodeAttention, PrefillBatch, PrefillSpan
from fovea.engine.paged.kv_cache import KVCache
from fovea.engine.paged.llama import PagedLlama, fuse_rows

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")


def test_fuse_rows_shares_memory_and_is_idempotent():
    torch.manual_seed(0)
    mods = [torch.nn.Linear(8, rows, bias=False) for rows in (4, 2, 2)]
    before = [m.weight.detach().clone() for m in mods]
    fused = fuse_rows(mods, "weight")
    assert fused.shape == (8, 8)
    assert torch.equal(fused, torch.cat(before))
    for m, b in zip(mods, before):
        assert torch.equal(m.weight, b)
        assert m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # a view
    with torch.no_grad():
        fused[0, 0] = 42.0
    assert mods[0].weight[0, 0].item() == 42.0
    assert fuse_rows(mods, "weight") is fused  # a second engine on the same model reuses it
    assert fuse_rows(mods, "bias") is None


def _prefill_then_decode(llama: PagedLlama, prompts: list[list[int]], next_ids: list[int]):
    """Prefill each prompt (one step, two spans), then one decode step for both. Returns
    (prefill logits of each span's last row, decode logits, the cache)."""
    block_size = 16
    cache = KVCache(llama.kv_shape(block_size), 32, torch.device("cpu"))
    tables, offset, slots, spans, positions, last_rows = [], 0, [], [], [], []
    for i, ids in enumerate(prompts):
        blocks = list(range(i * 8, i * 8 + 8))  # room for 128 tokens each
        tables.append(blocks)
        n = len(ids)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
        spans.append(PrefillSpan(offset, n, 0, torch.tensor(blocks)))
        positions += list(range(n))
        offset += n
        last_rows.append(offset - 1)
    flat = torch.tensor([t for ids in prompts for t in ids])
    meta = AttnMeta(slot_mapping=torch.tensor(slots), prefills=spans)
    if llama.decode.prefill is not None:  # the Triton path: every span in one kernel launch
        meta.prefill_batch = PrefillBatch.build(spans, tables, torch.device("cpu"))
    with torch.inference_mode():
        first = llama.forward(llama.embed_ids(flat), torch.tensor(positions), meta, cache,
                              torch.tensor(last_rows)).float()
        lens = [len(ids) for ids in prompts]
        decode_meta = AttnMeta(
            slot_mapping=torch.tensor([t[n // block_size] * block_size + n % block_size for t, n in zip(tables, lens)]),
            num_decodes=len(prompts), block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32))
        second = llama.forward(llama.embed_ids(torch.tensor(next_ids)), torch.tensor(lens), decode_meta, cache).float()
    return first, second, cache


@needs_triton
@pytest.mark.parametrize("triton_attention", [False, True], ids=["torch-attention", "triton-attention"])
def test_fused_forward_matches_the_torch_forward(demo_model, triton_attention):
    """The CUDA configuration (fused weights and kernels, Triton decode and prefill
    attention) against the CPU one (transformers' ops, torch attention)."""
    reference = PagedLlama(copy.deepcopy(demo_model.model), 256, DecodeAttention(False))
    fused = PagedLlama(copy.deepcopy(demo_model.model), 256, DecodeAttention(triton_attention), fused=True)
    assert fused.layers[0].qkv is not None and fused.layers[0].gate_up is not None
    gen = torch.Generator().manual_seed(3)
    vocab = reference.embed.shape[0]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 20)]
    ref_first, ref_second, ref_cache = _prefill_then_decode(reference, prompts, [5, 9])
    got_first, got_second, got_cache = _prefill_then_decode(fused, prompts, [5, 9])
    assert (got_first - ref_first).abs().max().item() < 1e-4
    assert (got_second - ref_second).abs().max().item() < 1e-4
    for layer in range(len(reference.layers)):
        assert (got_cache.k[layer] - ref_cache.k[layer]).abs().max().item() < 1e-5
        assert torch.equal(got_cache.v[layer] != 0, ref_cache.v[layer] != 0)  # the same slots written


def test_prefill_batch_lays_out_spans_for_one_launch():
    spans = [PrefillSpan(0, 5, 0, torch.tensor([3])), PrefillSpan(5, 20, 16, torch.tensor([7, 2, 9]))]
    batch = PrefillBatch.build(spans, [[3], [7, 2, 9]], torch.device("cpu"))
    assert batch.cu_q_lens.tolist() == [0, 5, 25] and batch.q_starts.tolist() == [0, 16]
    assert batch.block_tables.tolist() == [[3, 3, 3], [7, 2, 9]]  # padded with a block it owns
    assert batch.block_tables.dtype == torch.int32 and batch.max_q_len == 20
