"""On a real GPU: the memory plan holds the process, and a real out-of-memory error loses no request.

Skipped without CUDA (CI has none); scripts/gpu_engine_checks.sh runs these on the lent H200.
"""

import asyncio

import pytest
import torch
from scene_helpers import collect, fresh_scene

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(max_tokens=40, temperature=0)


@pytest.fixture(scope="module")
def gpu_model():
    return load_model(None, "cuda", "bfloat16")


def prompts(model, n, seed):
    text = render_chat(model, [{"role": "user", "content": [{"type": "image"},
                                                          {"type": "text", "text": "Describe the image."}]}])
    chosen = [fresh_scene(seed + i) for i in range(n)]
    return chosen, [encode_prompt(model, text, [scenes.render(s)]) for s in chosen]


def run(engine, jobs):
    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(collect(engine, p, GREEDY) for p in jobs))
        finally:
            engine.stop()
    return asyncio.run(main())


def test_a_burst_stays_within_the_plan(gpu_model):
    engine = PagedEngine(gpu_model, PagedEngineConfig(gpu_memory_utilization=0.2, overlap_steps=True,
                                                      fused_vision=True))
    plan = engine.runner.memory_plan
    names = {line.name for line in plan.lines}
    assert {"weights", "kv_cache", "step peak", "decode graphs", "vision graphs", "encoder cache",
            "prompt embeddings", "headroom"} <= names
    assert names & {"CUDA context and runtime", "CUDA runtime"}
    assert plan.planned_bytes <= plan.budget_bytes and plan.torch_cap_bytes <= plan.planned_bytes
    held = torch.cuda.memory_reserved()
    chosen, jobs = prompts(gpu_model, 96, seed=7000)
    results = run(engine, jobs)
    peak = torch.cuda.max_memory_reserved()
    right = sum(finish.text == scenes.describe_answer(s) for s, (_, finish) in zip(chosen, results))
    assert right >= 94, right  # the demo model's accuracy, not the engine's: 99% in eval-demo
    assert peak <= plan.torch_cap_bytes, (peak, plan.torch_cap_bytes, plan.render())
    assert held <= peak and engine.oom_recoveries == 0


def test_a_real_out_of_memory_error_is_recovered(gpu_model):
    engine = PagedEngine(gpu_model, PagedEngineConfig(gpu_memory_utilization=0.2))
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Squeeze torch's allocator to what it holds now: the first step's activations cannot be had.
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
    recover = engine._recover_from_oom

    def recover_then_release(plan, exc):
        recover(plan, exc)
        assert "out of memory" in str(exc).lower()
        torch.cuda.set_per_process_memory_fraction(engine.runner.memory_plan.torch_cap_bytes / total)

    engine._recover_from_oom = recover_then_release
    chosen, jobs = prompts(gpu_model, 16, seed=7100)
    try:
        results = run(engine, jobs)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert engine.oom_recoveries >= 1
    assert [finish.text for _, finish in results] == [scenes.describe_answer(s) for s in chosen]
