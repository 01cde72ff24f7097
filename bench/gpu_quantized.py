"""Quantized language models on one GPU, offline engine: decode ms/token at batch 1 and a burst,
for bf16 / FP8 (per channel, dynamic per token) / FP8 blocks / W4A16 / AWQ.

Each shape's directory holds every file but the weights (``write_model_dir(weights=False)``) and
the format's ``quantization_config`` as released checkpoints write it; the weights are made on the
GPU (``--load-format dummy``), so the 72B shape needs no 145 GB of files. Text-only prompts: the
language model's decode is what quantization changes.

Floors, read against the ceilings measured at the start of the run: one decode step reads every
weight once, so ms/token >= weight bytes / copy bandwidth.

    python3 bench/gpu_quantized.py --out $OUT --shapes 7b --formats bf16,fp8,w4a16
    python3 bench/gpu_quantized.py --out $OUT --shapes 72b --formats fp8,w4a16 --burst 256
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

_FP8_W = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
_FP8_A = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
_INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True, "dynamic": False}


def _ct(fmt: str, weights: dict, activations: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head", "re:visual.*", "re:model.visual.*"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


FORMATS: dict[str, dict | None] = {
    "bf16": None,
    "fp8": _ct("float-quantized", _FP8_W, _FP8_A),  # RedHatAI ...-FP8-Dynamic
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",  # Qwen's own FP8
                  "weight_block_size": [128, 128], "modules_to_not_convert": ["visual", "lm_head"]},
    "w4a16": _ct("pack-quantized", _INT4, None),  # RedHatAI ...-quantized.w4a16
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True,
            "modules_to_not_convert": ["visual"]},  # Qwen's own AWQ
}
SHAPES = {"7b": "qwen2.5-vl-7b", "72b": "qwen2.5-vl-72b"}


def log(message: str) -> None:
    print(f"[quant-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def copy_bandwidth() -> float:
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - start)


def shape_dir(root: Path, shape: str, fmt: str) -> Path:
    from fovea.testing.random_qwen2_5_vl import write_model_dir

    base = root / f"cfg-{shape}"
    if not (base / "config.json").is_file():
        write_model_dir(base, SHAPES[shape], weights=False)
    out = root / f"{shape}-{fmt}"
    out.mkdir(parents=True, exist_ok=True)
    for file in base.iterdir():
        if file.name != "config.json" and not (out / file.name).exists():
            (out / file.name).symlink_to(file)
    config = json.loads((base / "config.json").read_text())
    if FORMATS[fmt] is not None:
        config["quantization_config"] = FORMATS[fmt]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def measure(model_dir: Path, args, bandwidth: float) -> dict:
    from fovea.engine import PagedEngine, PagedEngineConfig
    from fovea.engine.core.request import FinishEvent, TokenEvent
    from fovea.engine.memory.profile import tensor_bytes
    from fovea.engine.sampling.params import SamplingParams
    from fovea.loading.loader import load_model
    from fovea.loading.prompt import encode_prompt, render_chat

    started = time.perf_counter()
    loaded = load_model(model_dir, "cuda", "bfloat16", load_format="dummy")
    load_s = time.perf_counter() - started
    lm = loaded.adapter.lm_spec(loaded.model).language_model
    # What one decode step reads: the decoder's weights (quantized or not), the final norm and lm_head.
    step_bytes = tensor_bytes(lm.layers) + loaded.model.get_output_embeddings().weight.numel() * 2
    engine = PagedEngine(loaded, PagedEngineConfig(max_model_len=args.max_model_len))
    engine_s = time.perf_counter() - started - load_s
    words = " ".join(["hello"] * 60)
    prompt = encode_prompt(loaded, render_chat(loaded, [{"role": "user", "content": [{"type": "text", "text": words}]}]), [])

    async def one(params):
        t0, first, n = time.perf_counter(), None, 0
        async for event in engine.generate(prompt, params):
            if isinstance(event, TokenEvent) and first is None:
                first = time.perf_counter()
            elif isinstance(event, FinishEvent):
                n = event.completion_tokens
        end = time.perf_counter()
        return first - t0, (end - first) / max(n - 1, 1), n

    async def burst(count: int, tokens: int):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(params) for _ in range(count)))
        return sum(n for _, _, n in out) / (time.perf_counter() - t0), sum(n != tokens for _, _, n in out)

    engine.start()
    try:
        singles = [asyncio.run(one(SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)))
                   for _ in range(args.singles + 1)][1:]
        tpot = statistics.median(s[1] for s in singles) * 1000
        ttft = statistics.median(s[0] for s in singles) * 1000
        bursts = [asyncio.run(burst(args.burst, 128)) for _ in range(args.runs)] if args.burst else []
    finally:
        engine.stop()
    floor = step_bytes / bandwidth * 1000
    result = {"dir": str(model_dir), "label": loaded.quantization.label if loaded.quantization else "bf16",
              "load_s": load_s, "engine_s": engine_s, "step_bytes": step_bytes, "tpot_ms": tpot, "ttft_ms": ttft,
              "floor_ms": floor, "burst_tok_s": [b[0] for b in bursts], "burst_failed": sum(b[1] for b in bursts),
              "plan_gib": engine.runner.memory_plan.planned_bytes / 2**30,
              "kv_blocks": engine.block_manager.num_blocks}
    engine = loaded = None  # released before the next format loads
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--root", type=Path, default=Path("/tmp/fovea-quant"))
    parser.add_argument("--shapes", default="7b")
    parser.add_argument("--formats", default="bf16,fp8,w4a16")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per single request")
    parser.add_argument("--singles", type=int, default=3)
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's (128000)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results, problems = [], []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            try:
                r = measure(shape_dir(args.root, shape, fmt), args, bandwidth)
            except Exception as exc:  # noqa: BLE001 - one format's failure is reported; the others still run
                problems.append(f"{shape} {fmt}: {type(exc).__name__}: {exc}")
                log(problems[-1])
                continue
            r.update(shape=shape, format=fmt)
            results.append(r)
            log(json.dumps(r))
            (args.out / "quantized.json").write_text(json.dumps(results, indent=2))
            if r["burst_failed"]:
                problems.append(f"{shape} {fmt}: {r['burst_failed']} burst request(s) failed")
    print(f"\n{'shape':<6}{'format':<11}{'ms/token b1':>12}{'floor':>8}{'of floor':>9}{'TTFT ms':>9}"
          f"{'burst tok/s':>13}{'load s':>8}{'engine s':>9}{'KV blocks':>10}")
    for r in results:
        burst = "/".join(f"{t:.0f}" for t in r["burst_tok_s"]) or "-"
        print(f"{r['shape']:<6}{r['format']:<11}{r['tpot_ms']:>12.2f}{r['floor_ms']:>8.2f}"
              f"{r['floor_ms'] / r['tpot_ms']:>9.0%}{r['ttft_ms']:>9.1f}{burst:>13}{r['load_s']:>8.1f}"
              f"{r['engine_s']:>9.1f}{r['kv_blocks']:>10}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
