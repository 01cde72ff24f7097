"""The fused forward (fused q/k/v and gate/up weights, Triton norm/rotary/activation
kernels) against the torch-op forward on the demo model. The kernels run where triton
imports and either CUDA is present or TRITON_INTERPRET=1 (triton's CPU interpreter)."""

import copy

import pytest
import torch
from kernel_helpers import needs_triton

from fovea.engine.model.attention import AttnMeta, PrefillBatch, PrefillSpan, attention_backend
from fovea.engine.model.kv_cache import KVCache
from fovea.engine.model.llama import PagedLlama
from fovea.engine.model.weights import fuse_rows
from fovea.models.llava import LlavaAdapter
from fovea.testing.tolerance import assert_close_for, path_len_of


def lm_spec_of(model):
    return LlavaAdapter().lm_spec(model)


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
    device = llama.embed.device
    with torch.device(device):  # the tensors below land beside the weights (CPU, or CUDA on a GPU)
        block_size = 16
        cache = KVCache(llama.kv_shape(block_size), 32, device)
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
        if llama.backend.batched_prefill:  # the Triton path: every span in one kernel launch
            with torch.device("cpu"):  # it stages its tables in pinned host memory, then copies
                meta.prefill_batch = PrefillBatch.build(spans, tables, device)
        with torch.inference_mode():
            first = llama.forward(llama.embed_ids(flat), torch.tensor(positions), meta, cache,
                                  torch.tensor(last_rows)).float()
            lens = [len(ids) for ids in prompts]
            decode_meta = AttnMeta(
                slot_mapping=torch.tensor([t[n // block_size] * block_size + n % block_size
                                           for t, n in zip(tables, lens)]),
                num_decodes=len(prompts), block_tables=torch.tensor(tables, dtype=torch.int32),
                context_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32))
            second = llama.forward(llama.embed_ids(torch.tensor(next_ids)), torch.tensor(lens), decode_meta,
                                   cache).float()
    return first, second, cache


@needs_triton
@pytest.mark.parametrize("triton_attention", [False, True], ids=["torch-attention", "triton-attention"])
def test_fused_forward_matches_the_torch_forward(demo_model, triton_attention):
    """The CUDA configuration (fused weights and kernels, Triton decode and prefill
    attention) against the CPU one (transformers' ops, torch attention)."""
    reference = PagedLlama(lm_spec_of(copy.deepcopy(demo_model.model)), 256, attention_backend("torch"))
    fused = PagedLlama(lm_spec_of(copy.deepcopy(demo_model.model)), 256, attention_backend("triton" if triton_attention else "torch"),
                       fused=True)
    assert fused.layers[0].qkv is not None and fused.layers[0].gate_up is not None
    gen = torch.Generator().manual_seed(3)
    vocab = reference.embed.shape[0]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 20)]
    ref_first, ref_second, ref_cache = _prefill_then_decode(reference, prompts, [5, 9])
    got_first, got_second, got_cache = _prefill_then_decode(fused, prompts, [5, 9])
    text, context = demo_model.model.config.text_config, max(len(p) for p in prompts) + 1
    assert_close_for(got_first, ref_first, torch.float32, path_len_of(text, context), what="prefill logits")
    assert_close_for(got_second, ref_second, torch.float32, path_len_of(text, context), what="decode logits")
    for layer in range(len(reference.layers)):
        # A layer's K comes after the layers before it, then its norm and the k projection (the
        # path's final norm and head stand for those two).
        assert_close_for(got_cache.k[layer], ref_cache.k[layer], torch.float32,
                         path_len_of(text, context, layers=layer), what=f"K cache of layer {layer}")
        assert torch.equal(got_cache.v[layer] != 0, ref_cache.v[layer] != 0)  # the same slots written


def test_prefill_batch_lays_out_spans_for_one_launch():
    spans = [PrefillSpan(0, 5, 0, torch.tensor([3])), PrefillSpan(5, 20, 16, torch.tensor([7, 2, 9]))]
    batch = PrefillBatch.build(spans, [[3], [7, 2, 9]], torch.device("cpu"))
    assert batch.cu_q_lens.tolist() == [0, 5, 25] and batch.q_starts.tolist() == [0, 16]
    assert batch.block_tables.tolist() == [[3, 3, 3], [7, 2, 9]]  # padded with a block it owns
    assert batch.block_tables.dtype == torch.int32 and batch.max_q_len == 20


@needs_triton
def test_the_runner_feeds_the_triton_prefill_kernel_whole_steps(demo_model):
    """ModelRunner.execute on the Triton attention path (one PrefillBatch per step, no
    per-span block ids): chunked prefills of two sequences and their decodes give the
    torch path's logits."""
    from scene_helpers import fresh_scene
    from test_paged_helpers import prompt_for

    from fovea.demo import scenes
    from fovea.engine.config import PagedEngineConfig
    from fovea.engine.core.block_manager import BlockManager
    from fovea.engine.core.request import EngineRequest
    from fovea.engine.core.scheduler import Scheduler
    from fovea.engine.core.sequence import Sequence
    from fovea.engine.runner.model_runner import ModelRunner
    from fovea.engine.sampling.params import SamplingParams
    from fovea.engine.vision.encoder_cache import EncoderCache

    config = PagedEngineConfig(num_blocks=64).resolved(demo_model.device, demo_model.context_length)
    prompts = [prompt_for(demo_model, scenes.render(fresh_scene(s))) for s in (11, 12)]

    def logits_of_steps(triton_attention: bool) -> list[torch.Tensor]:
        runner = ModelRunner(demo_model, config, EncoderCache())
        if triton_attention:
            runner.attention = runner.llama.backend = attention_backend("triton")
        sched = Scheduler(BlockManager(runner.kv_plan.num_blocks, runner.block_size), 40, 4)
        seqs = []
        for i, prompt in enumerate(prompts):
            request = EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0), emit=lambda e: None)
            seqs.append(Sequence(i, request, demo_model.image_token_id, demo_model.device, demo_model.tokenizer))
            sched.add(seqs[-1])
        out, decode_steps = [], 0
        for _ in range(7):
            plan = sched.schedule()
            runner.embedder.fill([c.seq for c in plan.chunks
                                  if c.start < c.seq.prompt_len and c.seq.prompt_embeds is None])
            logits = runner.execute(plan)
            sched.on_computed(plan)
            for row, chunk in enumerate([c for c in plan.chunks if c.sample]):
                chunk.seq.token_ids.append(int(logits[row].argmax()))
            out.append(logits)
            decode_steps += plan.num_decodes > 0
        assert decode_steps >= 2 and len(sched.running) == 2  # both prefilled, then decoded together
        return out

    path = path_len_of(demo_model.model.config.text_config, max(len(p.input_ids) for p in prompts) + 7)
    for got, ref in zip(logits_of_steps(True), logits_of_steps(False), strict=True):
        assert got.shape == ref.shape
        if got.numel():  # a step whose chunks all stop short of a prompt's end samples nothing
            assert_close_for(got, ref, torch.float32, path, what="a step's logits")


@needs_triton
@pytest.mark.parametrize("block", [None, (16, 128)], ids=["per-channel", "blocks"])
def test_fp8_inputs_quantised_by_their_producers_change_no_logit(demo_model, block, monkeypatch):
    """With FP8 weights (per channel, and 16x128 blocks: K groups of 128 over the 688-wide down
    input, the last partial), the fused forward's norms and SiLU * up quantise the products' inputs
    in their own launches; the logits of a prefill and a decode step are bit for bit those of the
    same forward with the quantiser's launches (``fp8_producers`` off)."""
    from fovea.engine.kernels import quant_matmul, triton_ops
    from fovea.engine.model.llama import FP8Inputs
    from fovea.quant.weights import Fp8Weight

    # Both forwards take each product's first candidate (a GPU would otherwise time the keys of
    # quantised and unquantised inputs apart, and might sum them in different orders).
    monkeypatch.setattr(quant_matmul, "AUTOTUNE", False)
    monkeypatch.setattr(quant_matmul, "_CHOSEN", {})
    from fovea.engine.kernels.fp8_quantize import interpreting

    device = demo_model.device
    if device.type != "cuda" and not interpreting():
        pytest.skip("the demo model is on the CPU and triton's interpreter is off; FOVEA_TEST_DEVICE=cuda loads it "
                    "on the GPU")
    model = copy.deepcopy(demo_model.model)
    gen = torch.Generator().manual_seed(5)
    for layer in lm_spec_of(model).language_model.layers:
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            module.quant = Fp8Weight.random(module.out_features, module.in_features, block, generator=gen).to(device)
    llama = PagedLlama(lm_spec_of(model), 256, attention_backend("torch"), fused=True)
    want = FP8Inputs(256, 256, 688) if block is None else FP8Inputs(128, 128, 128)
    assert llama.fp8_producers and llama.fp8_groups == [want] * len(llama.layers)
    calls = []
    for name in ("add_rms_norm_fp8", "silu_mul_fp8"):
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, llama.embed.shape[0], (n,), generator=gen).tolist() for n in (21, 9)]
    first, second, _ = _prefill_then_decode(llama, prompts, [5, 9])
    assert len(calls) == 2 * 3 * len(llama.layers)  # both steps, three producers a layer
    llama.fp8_producers = False
    unfused_first, unfused_second, _ = _prefill_then_decode(llama, prompts, [5, 9])
    assert len(calls) == 2 * 3 * len(llama.layers)
    assert torch.equal(first, unfused_first) and torch.equal(second, unfused_second)
