"""KV-cache sizing on CPU, the block size arithmetic, and the dummy max-size step."""

import pytest
import torch

from fovea.engine.config import GPU_MODEL_MIN_PARAMETERS, PagedEngineConfig, SettingsError
from fovea.engine.memory.plan import MemoryPlanError
from fovea.engine.model.kv_cache import KVCache, KVShape
from fovea.engine.runner.model_runner import ModelRunner
from fovea.engine.vision.encoder_cache import EncoderCache

MiB, GiB = 2**20, 2**30
DEMO = KVShape(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    assert DEMO.bytes_per_block == 2 * 4 * 16 * 4 * 64 * 4 == 128 * 1024
    llama7b = KVShape(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert llama7b.bytes_per_block == 8 * MiB


def test_cpu_uses_a_byte_budget_never_the_machines_memory(demo_model):
    def plan(**kw):
        config = PagedEngineConfig(**kw).resolved(demo_model.device, demo_model.context_length)
        return ModelRunner(demo_model, config, EncoderCache()).memory_plan

    default = plan()
    per_block = default.line("kv_cache").bytes // (default.kv_blocks + 1)
    assert default.kv_blocks == 256 * MiB // per_block and default.budget_bytes is None
    assert plan(kv_cache_memory=MiB).kv_blocks == MiB // per_block
    assert plan(num_blocks=5).kv_blocks == 5
    assert {line.name for line in default.lines} == {"weights", "kv_cache", "encoder cache", "prompt embeddings",
                                                  "penalty counts"}
    with pytest.raises(MemoryPlanError, match="holds no KV block"):
        plan(kv_cache_memory=1024)


def test_the_cache_has_one_scratch_block_past_the_managed_ones():
    cache = KVCache(DEMO, 3, torch.device("cpu"))
    assert cache.k[0].shape == (4, 16, 4, 64) and len(cache.v) == 4
    assert cache.scratch_block == 3 and cache.scratch_slot == 48


def test_the_profiling_step_runs_at_the_largest_size(demo_model):
    config = PagedEngineConfig(num_blocks=4, max_num_batched_tokens=100, max_num_seqs=8)
    runner = ModelRunner(demo_model, config.resolved(demo_model.device, demo_model.context_length), EncoderCache())
    logits = runner.dummy_step(KVCache(runner.llama.kv_shape(16), 7, runner.device))
    assert logits.shape == (8, demo_model.model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    assert runner.kv_plan.num_blocks == 4 and runner.graphs is None


def test_the_profiling_step_splits_a_budget_longer_than_one_sequence(demo_model):
    """A step may hold more tokens than one sequence can: the profile covers all of them,
    as several chunks no longer than max_model_len."""
    config = PagedEngineConfig(num_blocks=4, max_num_batched_tokens=100, max_num_seqs=8, max_model_len=40)
    runner = ModelRunner(demo_model, config.resolved(demo_model.device, demo_model.context_length), EncoderCache())
    assert runner._dummy_spans() == [(0, 40), (40, 40), (80, 20)]
    logits = runner.dummy_step(KVCache(runner.llama.kv_shape(16), 9, runner.device))
    assert logits.shape == (8, demo_model.model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_config_defaults_depend_on_the_device():
    cpu = PagedEngineConfig().resolved(torch.device("cpu"), 4096)
    assert (cpu.max_num_batched_tokens, cpu.max_num_seqs, cpu.max_model_len) == (512, 16, 4096)
    assert not cpu.cuda_graphs and not cpu.triton_decode
    gpu = PagedEngineConfig().resolved(torch.device("cuda"), 4096)
    assert (gpu.max_num_batched_tokens, gpu.max_num_seqs) == (8192, 256) and gpu.cuda_graphs and gpu.triton_decode
    assert not PagedEngineConfig(cuda_graphs=False).resolved(torch.device("cuda"), 4096).cuda_graphs
    assert PagedEngineConfig(max_num_batched_tokens=8).resolved(torch.device("cpu"), 4096).max_num_seqs == 8
    assert PagedEngineConfig(max_model_len=1000).resolved(torch.device("cpu"), 4096).max_model_len == 1000
    with pytest.raises(SettingsError, match="longer than the model's context of 4096"):
        PagedEngineConfig(max_model_len=9999).resolved(torch.device("cpu"), 4096)
    with pytest.raises(ValueError):
        PagedEngineConfig(max_num_seqs=0)


def test_step_overlap_and_fused_vision_default_on_only_for_large_models_on_a_gpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    big, small = GPU_MODEL_MIN_PARAMETERS, GPU_MODEL_MIN_PARAMETERS - 1
    on = PagedEngineConfig().resolved(cuda, 4096, big)
    assert on.overlap_steps is True and on.fused_vision is True
    for device, params in ((cuda, small), (cpu, big)):
        off = PagedEngineConfig().resolved(device, 4096, params)
        assert off.overlap_steps is False and off.fused_vision is False
    forced = PagedEngineConfig(overlap_steps=True, fused_vision=False).resolved(cuda, 4096, small)
    assert forced.overlap_steps is True and forced.fused_vision is False
