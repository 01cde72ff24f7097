"""The memory plan's arithmetic and refusals, with the device's numbers given (no GPU needed)."""

from dataclasses import replace

import pytest

from fovea.engine.memory.plan import (
    ALLOCATOR_ROUNDING,
    GiB,
    KVRequest,
    MemoryPlanError,
    MiB,
    PlanLine,
    blocks_for_bytes,
    check_weights_fit,
    kv_tensor_bytes,
    plan_kv,
    process_budget,
    runtime_line,
)

H200 = 140 * GiB
LLAVA7B_KV = KVRequest(per_block=8 * MiB, tensors=64, block_size=16, min_blocks=256, need_blocks=2 * 256 * 256,
                       max_model_len=4096)


def lines(weights=13 * GiB, step=2 * GiB):
    return [PlanLine("weights", weights, "w"), PlanLine("step peak", step, "s"),
            PlanLine("CUDA runtime", 300 * MiB, "r", torch=False)]


def test_budget_is_the_share_of_the_device_or_what_is_free_whichever_is_less():
    alone = process_budget(H200, free=H200 - GiB, held=0, utilization=None)
    assert alone.bytes == int(0.9 * H200) and not alone.limited_by_free
    assert "--gpu-memory-utilization 0.90" in alone.how and "raise --gpu-memory-utilization" in alone.advice
    shared = process_budget(H200, free=12 * GiB, held=0, utilization=0.9)
    assert shared.bytes == 12 * GiB and shared.limited_by_free
    assert "other processes hold 128.00 GiB" in shared.how and "free the GPU" in shared.advice
    # What the process already holds counts as its own, not another process's.
    assert process_budget(H200, free=12 * GiB, held=20 * GiB, utilization=0.9).bytes == 32 * GiB
    assert process_budget(H200, free=50 * GiB, held=20 * GiB, utilization=0.45).bytes == int(0.45 * H200)
    exact = process_budget(H200, free=50 * GiB, held=0, utilization=0.1, exact_kv=True)
    assert exact.bytes == 50 * GiB and "--kv-cache-memory" in exact.how


def test_kv_bytes_count_the_allocators_rounding_and_the_scratch_block():
    assert kv_tensor_bytes(0, 8 * MiB, 64) == 64 * ALLOCATOR_ROUNDING  # the scratch block alone, rounded
    assert kv_tensor_bytes(63, 8 * MiB, 64) == 64 * 8 * MiB
    for available in (10 * GiB, 10 * GiB + 3 * MiB, 123_456_789_012):
        blocks = blocks_for_bytes(available, 8 * MiB, 64)
        assert kv_tensor_bytes(blocks, 8 * MiB, 64) <= available < kv_tensor_bytes(blocks + 1, 8 * MiB, 64)


def test_the_kv_cache_gets_what_the_other_lines_leave():
    budget = process_budget(H200, free=H200, held=0, utilization=0.9)
    plan = plan_kv(budget, lines(), LLAVA7B_KV, "cuda:0", H200)
    others = 13 * GiB + 2 * GiB + 300 * MiB
    assert plan.planned_bytes <= budget.bytes
    assert budget.bytes - plan.planned_bytes < 8 * MiB + 64 * ALLOCATOR_ROUNDING  # less than one block is left
    assert plan.line("kv_cache").bytes == plan.planned_bytes - others
    assert plan.kv_tokens == plan.kv_blocks * 16
    assert plan.torch_cap_bytes == plan.planned_bytes - 300 * MiB  # the runtime is outside torch's allocator
    text = plan.render()
    assert "weights" in text and "kv_cache" in text and f"{plan.kv_blocks} blocks" in text
    assert plan.to_dict()["kv_cache"]["tokens"] == plan.kv_tokens


def test_a_small_model_takes_what_it_can_use_not_the_share():
    budget = process_budget(H200, free=H200, held=0, utilization=0.9)
    small = KVRequest(per_block=128 * 1024, tensors=8, block_size=16, min_blocks=128, need_blocks=2 * 16 * 128)
    plan = plan_kv(budget, lines(weights=20 * MiB, step=50 * MiB), small, "cuda:0", H200)
    assert plan.kv_blocks == 2 * 16 * 128 and "capped" in plan.line("kv_cache").how
    assert plan.planned_bytes < GiB


def test_free_memory_at_sizing_time_limits_the_kv_cache():
    budget = process_budget(H200, free=H200, held=0, utilization=0.9)
    plan = plan_kv(budget, lines(), LLAVA7B_KV, "cuda:0", H200, free_now=60 * GiB, pending=2 * GiB)
    assert plan.line("kv_cache").bytes <= 58 * GiB and plan.notes


def test_an_exact_kv_size_is_honoured_or_refused():
    budget = process_budget(H200, free=100 * GiB, held=0, utilization=None, exact_kv=True)
    plan = plan_kv(budget, lines(), replace(LLAVA7B_KV, exact_bytes=40 * GiB), "cuda:0", H200)
    assert plan.kv_blocks == 40 * GiB // (8 * MiB) and "--kv-cache-memory" in plan.line("kv_cache").how
    with pytest.raises(MemoryPlanError, match="--kv-cache-memory 90.00 GiB") as err:
        plan_kv(budget, lines(), replace(LLAVA7B_KV, exact_bytes=90 * GiB), "cuda:0", H200)
    assert "Lower --kv-cache-memory" in err.value.message and err.value.code == "insufficient_memory"


def test_a_plan_without_room_for_one_longest_sequence_is_refused_with_need_free_and_flag():
    # Another process holds most of the device: 16 GiB are free for a 13 GiB model.
    budget = process_budget(H200, free=16 * GiB, held=0, utilization=0.9)
    with pytest.raises(MemoryPlanError) as err:
        plan_kv(budget, lines(), LLAVA7B_KV, "cuda:0", H200)
    message = err.value.message
    assert "one sequence of --max-model-len 4096 tokens" in message and "2.00 GiB" in message  # 256 blocks x 8 MiB
    assert "other processes hold" in message and "free the GPU" in message and "--max-model-len" in message


def test_weights_that_cannot_fit_are_refused_before_loading():
    check_weights_fit(13 * GiB, "bfloat16", "cuda:0", H200, free=H200, utilization=None, kv_exact=None)
    with pytest.raises(MemoryPlanError) as err:
        check_weights_fit(13 * GiB, "bfloat16", "cuda:0", H200, free=12 * GiB, utilization=None, kv_exact=None)
    message = err.value.message
    assert "weights need 13.00 GiB (bfloat16)" in message and "only 12.00 GiB is free" in message
    assert "Nothing was loaded" in message
    with pytest.raises(MemoryPlanError, match="raise --gpu-memory-utilization"):
        check_weights_fit(13 * GiB, "bfloat16", "cuda:0", H200, free=H200, utilization=0.05, kv_exact=None)


def test_the_runtime_line_is_the_processs_own_where_nvml_says():
    # This process: torch reserved 20 GiB of the 20.6 GiB NVML counts for it.
    own = runtime_line((10 * GiB, 20 * GiB), (10 * GiB + 500 * MiB, 20 * GiB + 600 * MiB), (50 * GiB, 90 * GiB), 64 * MiB)
    assert own.name == "CUDA context and runtime" and own.bytes == 600 * MiB + 64 * MiB and not own.torch
    # Without NVML only the device-wide growth is left: a neighbour's 30 GiB KV cache lands here, and the line says so.
    wide = runtime_line((10 * GiB, 20 * GiB), (None, None), (50 * GiB, 90 * GiB), 64 * MiB)
    assert wide.bytes == 30 * GiB + 64 * MiB and "other processes" in wide.how


def test_the_nvml_reading_of_a_machine_without_a_gpu_is_none():
    import torch

    from fovea.engine.memory.profile import _nvml_handle

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")

    assert _nvml_handle(torch.device("cuda", 0)) is None  # no driver library here: the device-wide fallback


def test_the_int4_scratch_is_a_line_of_its_own_sized_by_the_largest_int4_layer():
    """The fused forward's int4 layers dequantise into one buffer (prefill): the largest of the
    products it runs (q/k/v, o, gate/up, down), FP8 and plain layers not counted; the plan shows it."""
    from types import SimpleNamespace

    import torch

    from fovea.engine.memory.planner import SCRATCH, scratch_lines
    from fovea.engine.model.quant_linear import int4_scratch_elements
    from fovea.quant.weights import Fp8Weight, Int4Weight

    def layer(gate_up_n):
        return SimpleNamespace(qkv=Int4Weight.random(96, 64, 32), o=Int4Weight.random(64, 64, 32),
                               gate_up=Int4Weight.random(gate_up_n, 64, 32), down=torch.zeros(64, 160),
                               q=Int4Weight.random(4096, 64, 32))  # a row slice: the fused path never runs it
    assert int4_scratch_elements([layer(256), layer(320)]) == 320 * 64
    assert int4_scratch_elements([SimpleNamespace(qkv=Fp8Weight.random(96, 64), o=None, gate_up=None, down=None)]) == 0
    assert scratch_lines(SimpleNamespace(int4_scratch=None)) == []
    assert scratch_lines(SimpleNamespace()) == []
    (line,) = scratch_lines(SimpleNamespace(int4_scratch=torch.empty(320 * 64, dtype=torch.bfloat16)))
    assert line.name == SCRATCH and line.bytes == 2 * 320 * 64 and line.torch and "largest int4 layer" in line.how
    budget = process_budget(H200, free=H200, held=0, utilization=0.9)
    plan = plan_kv(budget, [*lines(), line], LLAVA7B_KV, "cuda:0", H200)
    assert plan.line(SCRATCH).bytes == line.bytes and SCRATCH in plan.render()
    assert plan.torch_cap_bytes == plan.planned_bytes - 300 * MiB  # in torch's cap: the allocator holds it


QWEN72B_FP8 = {"hidden": 8192, "intermediate": 29568, "q_width": 64 * 128, "kv_width": 8 * 128, "dtype_bytes": 2}


def test_prefill_activations_are_computed_from_the_shapes():
    """Qwen2.5-VL-72B (hidden 8192, intermediate 29,568, 64 heads and 8 KV heads of 128), bf16
    activations, FP8 per-channel products (a quantised byte and a float32 scale per row of the
    down product's input): per token, 2 x (4 x 8192 + 2 x 8192 + 2 x 1024) held through the MLP,
    plus the gate/up product and its SiLU (2 x 3 x 29,568), the larger of the two MLP moments."""
    from fovea.engine.memory.plan import LMShape, prefill_activation_bytes

    fp8 = LMShape(**QWEN72B_FP8, act_quant_bytes=1 + 4 / 29568)
    per_token = 2 * (4 * 8192 + 2 * 8192 + 2 * 1024) + 2 * 3 * 29568
    assert prefill_activation_bytes(32768, fp8) == 32768 * per_token  # 8.54 GiB for a 32k-token step
    assert 8.5 * GiB < prefill_activation_bytes(32768, fp8) < 8.6 * GiB
    assert prefill_activation_bytes(8192, fp8) * 4 == prefill_activation_bytes(32768, fp8)
    # The down product's moment wins where the intermediate is narrow against the hidden size.
    narrow = LMShape(hidden=4096, intermediate=1024, q_width=4096, kv_width=4096, dtype_bytes=2, act_quant_bytes=1)
    assert prefill_activation_bytes(10, narrow) == 10 * (2 * (4 * 4096 + 4 * 4096) + 2 * 1024 + 1024 + 2 * 4096)


def test_the_step_is_its_computed_activations_and_what_was_measured_beyond_them():
    from fovea.engine.memory.plan import step_lines

    act, step = step_lines(10 * GiB, 8 * GiB, 32768, "measured: two steps")
    assert (act.name, act.bytes, step.name, step.bytes) == ("prefill activations", 8 * GiB, "step peak", 2 * GiB)
    assert "32768 tokens" in act.how and act.torch and step.torch and "below" not in step.how
    act, step = step_lines(3 * GiB, 8 * GiB, 32768, "measured: two steps")  # a profile that missed part of it
    assert act.bytes + step.bytes == 8 * GiB and step.bytes == 0 and "below the computed line" in step.how
    budget = process_budget(H200, free=H200, held=0, utilization=0.9)
    plan = plan_kv(budget, [lines()[0], *step_lines(10 * GiB, 8 * GiB, 32768, "m"), lines()[2]], LLAVA7B_KV,
                   "cuda:0", H200)
    assert plan.line("prefill activations").bytes + plan.line("step peak").bytes == 10 * GiB


def test_the_planner_reads_the_widths_off_the_language_model():
    from types import SimpleNamespace

    import torch

    from fovea.engine.memory.planner import lm_shape
    from fovea.quant.weights import Fp8Weight, Int4Weight

    def llama(down):
        return SimpleNamespace(layers=[SimpleNamespace(down=down)], embed=torch.zeros(10, 64, dtype=torch.bfloat16),
                               num_heads=4, num_kv_heads=2, head_dim=16)
    plain = lm_shape(llama(torch.zeros(64, 160)))
    assert (plain.hidden, plain.intermediate, plain.q_width, plain.kv_width, plain.dtype_bytes,
            plain.act_quant_bytes) == (64, 160, 64, 32, 2, 0.0)
    assert lm_shape(llama(Fp8Weight.random(64, 160))).act_quant_bytes == 1 + 4 / 160
    assert lm_shape(llama(Fp8Weight.random(64, 256, block=(128, 128)))).act_quant_bytes == 1 + 4 / 128
    int4 = lm_shape(llama(Int4Weight.random(64, 256, 128)))
    assert int4.intermediate == 256 and int4.act_quant_bytes == 0.0
