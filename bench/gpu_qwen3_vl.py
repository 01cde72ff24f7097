"""Check and time fovea against transformers on a random-weight Qwen3-VL-8B directory (one GPU).

    python bench/gpu_qwen3_vl.py --out $OUT [--image-side 1024] [--throughput-runs 3]
    python bench/gpu_qwen3_vl.py --arch tiny --requests 8 --singles 2 --throughput-runs 1 --out /tmp/q3smoke

The sibling of ``gpu_qwen2_5_vl.py`` for Qwen3-VL, with the same four figures against their
floors: decode ms/step, TTFT, the vision stage and a 256-request burst; and the parity check
against transformers' forward and ``generate``. The directory is written by
``fovea.testing.random_qwen3_vl`` (Qwen3-VL-8B-Instruct's config, processor files and special
tokens, seeded random bf16 weights) and loaded by fovea's own loader. Each request carries one
distinct image of ``--image-side`` px square (1,024 px: a 64 x 64 grid of 16 px patches, 1,024
image tokens after the 2 x 2 merge, each with its three DeepStack levels) and 64 text tokens,
and asks for 128 greedy tokens with ``ignore_eos``. Without a GPU, ``--arch tiny`` runs the same
script on the CPU (no floors: a check that it runs and writes its JSON).
Exit status 1 when the engine disagrees with transformers or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_llava7b import ceilings, compiled_triton_kernels, log, time_cuda
from gpu_qwen2_5_vl import _first, counts, prefill_flops, run_requests, variant

from fovea.engine.paged import PagedEngine, PagedEngineConfig
from fovea.engine.reference import reference_generate, reference_logits
from fovea.model.contract import check_contract
from fovea.model.loader import load_model
from fovea.models.base import EncodedPrompt, ImageInput
from fovea.testing import random_qwen3_vl


def template_prompt(loaded, arch: str, side: int) -> EncodedPrompt:
    """One request as the server builds it: the chat template, 64 words, one side x side image."""
    words = random_qwen3_vl.prompt_words(arch, 64, seed=1)
    image = Image.effect_noise((side, side), 50).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words}]}]
    return loaded.codec.encode(loaded.codec.render(messages), [image])


def timed(device: str, fn, reps: int = 20, warmup: int = 3) -> float:
    """Seconds per call: CUDA events on a GPU, the wall clock on the CPU."""
    if device == "cuda":
        return time_cuda(fn, reps=reps, warmup=warmup)
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def generate_seconds(loaded, prompts: list[EncodedPrompt], max_new: int) -> float:
    """Seconds of transformers' ``generate`` over the prompts as one batch (equal lengths)."""
    ids = torch.tensor([loaded.adapter.reference_ids(p, loaded.image_token_id) for p in prompts], device=loaded.device)
    inputs = [loaded.adapter.reference_inputs(p, loaded.device, loaded.image_token_id) for p in prompts]
    extra = {k: torch.cat([i[k] for i in inputs]) for k in inputs[0]}
    sync = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                              max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    sync()
    return time.perf_counter() - t


def vision_flops(loaded, image: ImageInput) -> float:
    """Matrix FLOPs of one image through the tower: every block's linears over its patches, full
    attention over the image in every block, the merger and each DeepStack merger."""
    cfg = loaded.model.config.vision_config
    t, h, w = image.grid
    patches = t * h * w
    hidden, merge = cfg.hidden_size, cfg.spatial_merge_size
    block = 4 * hidden * hidden + 2 * hidden * cfg.intermediate_size  # qkv + proj, fc1/fc2
    attention = 4 * hidden * patches * patches * cfg.depth
    merged = hidden * merge * merge
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * (merged * merged + merged * cfg.out_hidden_size)
    return 2 * (cfg.depth * block * patches + mergers * patches / (merge * merge)) + attention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--arch", choices=sorted(random_qwen3_vl.ARCHITECTURES), default="qwen3-vl-8b",
                        help="tiny: a CPU smoke run of this script (no floors)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: /tmp/fovea-<arch>")
    parser.add_argument("--image-side", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--throughput-runs", type=int, default=3)
    parser.add_argument("--singles", type=int, default=5)
    parser.add_argument("--vision-batch", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=16384,
                        help="the engine's per-sequence limit (the model's own is 262,144 positions)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    nan = float("nan")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    args.model_dir = args.model_dir or Path(f"/tmp/fovea-{args.arch}")
    if not cuda and args.arch != "tiny":
        parser.error("without a GPU only --arch tiny runs (a smoke run of this script)")
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()},
                     "gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU smoke run)",
                     "torch": torch.__version__}
    problems: list[str] = []
    c = ceilings() if cuda else {"copy_bandwidth_Bps": nan, "bf16_matmul_flops": nan}
    results["ceilings"] = c
    log(f"ceilings: copy {c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    if not (args.model_dir / "config.json").is_file():
        t = time.time()
        random_qwen3_vl.write_model_dir(args.model_dir, args.arch, device=device)
        log(f"wrote {args.model_dir} in {time.time() - t:.1f} s")
    loaded = load_model(args.model_dir, device, dtype)
    log(f"loaded in {loaded.load_seconds:.1f} s; {counts(loaded)}")
    t = time.time()
    contract = check_contract(loaded)
    log(f"contract held in {time.time() - t:.1f} s: probe images of {contract.probe_image_tokens} tokens")
    template = template_prompt(loaded, args.arch, args.image_side)
    n_prompt, n_image = len(template.input_ids), template.images[0].num_tokens
    log(f"request: {n_prompt} prompt tokens, {n_image} of them the image (grid {template.images[0].grid})")
    params = counts(loaded)
    lm_bytes = 2 * params["lm"]
    text = loaded.model.config.text_config
    head_dim = text.head_dim  # Qwen3 states it (128 for 8B, with 32 heads of a 4,096 hidden)
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 2
    per_image = vision_flops(loaded, template.images[0])
    floor_step = lm_bytes / c["copy_bandwidth_Bps"]
    floor_ttft = (prefill_flops(loaded, n_prompt, params["lm"]) + per_image) / c["bf16_matmul_flops"]
    vis_floor = args.vision_batch * per_image / c["bf16_matmul_flops"]
    n = args.requests
    ctx = n_prompt + 64
    bound_s = (n * (prefill_flops(loaded, n_prompt, params["lm"]) + per_image) / c["bf16_matmul_flops"]
               + max(n * 128 * 2 * params["lm"] / c["bf16_matmul_flops"],
                     (128 * lm_bytes + n * 128 * ctx * kv_per_token) / c["copy_bandwidth_Bps"]))
    roofline = n * 128 / bound_s

    # -- transformers in the same run.
    hf = {"ttft": nan, "step": nan, "vision_s": nan, "batch_tok_s": nan}
    vision_batch = [variant(template, 90_000 + i).images[0] for i in range(args.vision_batch)]
    pixels = torch.cat([im.pixels for im in vision_batch]).to(device)
    grid = torch.tensor([im.grid for im in vision_batch], device=device)
    if not args.skip_hf:
        one = variant(template, 1)
        hf["ttft"] = statistics.median(generate_seconds(loaded, [one], 1) for _ in range(3))
        hf["step"] = (generate_seconds(loaded, [one], 65) - hf["ttft"]) / 64
        with torch.inference_mode():
            hf["vision_s"] = timed(device, lambda: loaded.model.model.get_image_features(
                pixel_values=pixels, image_grid_thw=grid), reps=3, warmup=1)
        hf["batch_tok_s"] = 16 * 128 / generate_seconds(loaded, [variant(template, 2 + i) for i in range(16)], 128)
    log(f"transformers: {hf}")
    results["hf"] = hf

    engine = PagedEngine(loaded, PagedEngineConfig(max_num_seqs=256, max_queue=4096,
                                                   max_model_len=min(args.max_model_len, loaded.context_length)))
    engine.start()
    rows = []
    try:
        images = engine.runner.embedder.images
        on_device = images.to_device(vision_batch)
        with torch.inference_mode():
            vis_s = timed(device, lambda: images.run(on_device), reps=5, warmup=1)
        rows.append(("vision", f"images/s (b{args.vision_batch}, {n_image} tokens)", f"{args.vision_batch / vis_s:.0f}",
                     f"{args.vision_batch / hf['vision_s']:.0f}", f"{args.vision_batch / vis_floor:.0f} (FLOPs)"))
        # -- correctness against transformers' own forward and generate.
        check = variant(template, 7)
        ref_tokens = reference_generate(loaded, check, 16)
        ref_lp = torch.log_softmax(reference_logits(loaded, check), -1)
        got = asyncio.run(_first(engine, check))
        rel = float((got["logprobs"].to(ref_lp.device) - ref_lp).norm() / ref_lp.norm())
        agree = next((i for i, (a, b) in enumerate(zip(got["tokens"], ref_tokens)) if a != b), len(ref_tokens))
        results["check"] = {"first_logprobs_rel_err": rel, "greedy_prefix_equal": agree, "of": len(ref_tokens)}
        log(f"check: first-token log-prob rel. error {rel:.2e}; greedy tokens equal for {agree}/{len(ref_tokens)}")
        if not rel < 1e-2:
            problems.append(f"first-token log-probs differ from transformers' by {rel:.2e} (> 1e-2)")
        rows.append(("check", "logprob rel err / tokens", f"{rel:.1e}", f"{agree}/{len(ref_tokens)} equal", "< 1e-2"))
        # -- single requests.
        singles = [asyncio.run(run_requests(engine, [variant(template, 100 + i)], 128))[0]
                   for i in range(args.singles + 1)][1:]
        failed = [s for s in singles if "error" in s]
        problems += [s["error"] for s in failed]
        ok = [s for s in singles if "error" not in s]
        step = statistics.median((s["stamps"][-1] - s["stamps"][0]) / (len(s["stamps"]) - 1) for s in ok)
        ttft = statistics.median(s["ttft"] for s in ok)
        rows.append(("single", "decode ms/step", f"{1e3 * step:.2f}", f"{1e3 * hf['step']:.2f}",
                     f"{1e3 * floor_step:.2f} (bytes)"))
        rows.append(("single", f"TTFT ms ({n_prompt} tokens)", f"{1e3 * ttft:.1f}", f"{1e3 * hf['ttft']:.1f}",
                     f"{1e3 * floor_ttft:.1f} (FLOPs)"))
        results["single"] = {"step_ms": 1e3 * step, "ttft_ms": 1e3 * ttft, "floor_step_ms": 1e3 * floor_step,
                             "floor_ttft_ms": 1e3 * floor_ttft}
        log(f"single: {results['single']}")
        # -- bursts, fresh images each run.
        bursts = []
        for run in range(args.throughput_runs):
            prompts = [variant(template, 1_000_000 * (run + 1) + i) for i in range(n)]
            compiled = compiled_triton_kernels() if cuda else 0
            start = time.perf_counter()
            outs = asyncio.run(run_requests(engine, prompts, 128))
            wall = time.perf_counter() - start
            bad = [o["error"] for o in outs if "error" in o]
            problems += bad[:3]
            tokens = sum(o.get("tokens", 0) for o in outs)
            bursts.append({"tok_s": tokens / wall, "wall_s": wall, "failed": len(bad),
                           "ttft_p50_s": statistics.median(o["ttft"] for o in outs if "ttft" in o),
                           "compiled_kernels": (compiled_triton_kernels() if cuda else 0) - compiled})
            log(f"burst {run + 1}: {bursts[-1]}")
        median = sorted(bursts, key=lambda b: b["tok_s"])[len(bursts) // 2]
        results["throughput"] = {"requests": n, **median, "runs": [b["tok_s"] for b in bursts],
                                 "roofline_tok_s": roofline}
        rows.append((f"{n} requests", "output tok/s", f"{median['tok_s']:.0f} ({median['failed']} failed)",
                     f"{hf['batch_tok_s']:.0f} (b16)", f"{roofline:.0f} (roofline)"))
        results["memory"] = engine.memory_report()
    finally:
        engine.stop()
    results["problems"] = problems
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gpu_qwen3_vl.json" if cuda else "gpu_qwen3_vl_smoke.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\n{'section':<10}{'metric':<34}{'fovea':>18}{'HF':>16}{'floor/bound':>20}")
    for r in rows:
        print(f"{r[0]:<10}{r[1]:<34}{r[2]:>18}{r[3]:>16}{r[4]:>20}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
