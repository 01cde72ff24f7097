"""Check and time fovea against transformers on a random-weight Qwen2.5-VL-7B directory (one GPU).

    python bench/gpu_qwen2_5_vl.py --out $OUT [--image-side 896] [--throughput-runs 3]

The sibling of ``gpu_llava7b.py`` for the adapter's second family, with the same four
figures against their floors: decode ms/step, TTFT, the vision stage and a 256-request burst.
The directory is written by ``fovea.testing.random_qwen2_5_vl`` (Qwen2.5-VL-7B-Instruct's
config, processor and special tokens, seeded random bf16 weights) and loaded by fovea's own
loader, as a user's would be. Each request carries one distinct image of ``--image-side`` px
square (896 px: a 64 x 64 patch grid, 1,024 image tokens after the 2 x 2 merge) and 64 text
tokens, and asks for 128 greedy tokens with ``ignore_eos``.
Exit status 1 when the engine disagrees with transformers or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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

from gpu_llava7b import ceilings, compiled_triton_kernels, hf_generate, log, time_cuda

from fovea.engine.paged import PagedEngine, PagedEngineConfig
from fovea.engine.reference import reference_generate, reference_logits
from fovea.engine.request import ErrorEvent, FinishEvent, TokenEvent
from fovea.engine.sampling import SamplingParams
from fovea.model.contract import check_contract
from fovea.model.loader import load_model
from fovea.models.base import EncodedPrompt, ImageInput
from fovea.testing import random_qwen2_5_vl


def template_prompt(loaded, side: int) -> EncodedPrompt:
    """One request as the server builds it: the chat template, 64 words, one side x side image."""
    words = random_qwen2_5_vl.prompt_words("qwen2.5-vl-7b", 64, seed=1)
    image = Image.effect_noise((side, side), 50).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words}]}]
    return loaded.codec.encode(loaded.codec.render(messages), [image])


def variant(template: EncodedPrompt, seed: int) -> EncodedPrompt:
    """The template with new pixels (so no encoder- or prefix-cache hit): speed does not
    depend on their values."""
    g = torch.Generator().manual_seed(seed)
    image = template.images[0]
    pixels = torch.randn(image.pixels.shape, generator=g).to(image.pixels.dtype)
    return dataclasses.replace(template, images=[dataclasses.replace(image, pixels=pixels, hash=f"bench-{seed}")])


async def run_requests(engine: PagedEngine, prompts: list[EncodedPrompt], max_tokens: int) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt):
        start, stamps = time.perf_counter(), []
        async for event in engine.generate(prompt, params):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                stamps.append(time.perf_counter() - start)
            elif isinstance(event, ErrorEvent):
                return {"error": f"{type(event.error).__name__}: {event.error}"}
            elif isinstance(event, FinishEvent):
                return {"ttft": event.first_token_s, "tokens": event.completion_tokens, "stamps": stamps}
        return {"error": "no finish event"}

    return await asyncio.gather(*(one(p) for p in prompts))


def counts(loaded) -> dict:
    named = list(loaded.model.named_parameters())
    vision = sum(p.numel() for n, p in named if ".visual." in f".{n}")
    return {"vision": vision, "lm": sum(p.numel() for _, p in named) - vision}


def vision_flops(loaded, image: ImageInput) -> float:
    """Matrix FLOPs of one image through the tower: every block's linears over its patches,
    attention over windows (window blocks) or the whole image (full blocks), the merger."""
    cfg = loaded.model.config.vision_config
    t, h, w = image.grid
    patches = t * h * w
    hidden, merge = cfg.hidden_size, cfg.spatial_merge_size
    block = 4 * hidden * hidden + 3 * hidden * cfg.intermediate_size  # qkv + proj, gate/up/down
    window = (cfg.window_size // cfg.patch_size) ** 2  # patches per window
    full = len(cfg.fullatt_block_indexes)
    attention = 4 * hidden * patches * (full * patches + (cfg.depth - full) * min(window, patches))
    merger = (hidden * merge * merge) ** 2 + hidden * merge * merge * cfg.out_hidden_size
    return 2 * (cfg.depth * block * patches + merger * patches / (merge * merge)) + attention


def prefill_flops(loaded, tokens: int, lm_params: int) -> float:
    cfg = loaded.model.config.text_config
    return 2 * lm_params * tokens + 2 * cfg.num_hidden_layers * tokens * tokens * cfg.hidden_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/fovea-qwen2.5-vl-7b"))
    parser.add_argument("--image-side", type=int, default=896)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--throughput-runs", type=int, default=3)
    parser.add_argument("--singles", type=int, default=5)
    parser.add_argument("--vision-batch", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=16384,
                        help="the engine's per-sequence limit (the model's own is 128,000 positions)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    nan = float("nan")
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "gpu": torch.cuda.get_device_name(0),
                     "torch": torch.__version__}
    problems: list[str] = []
    c = ceilings()
    results["ceilings"] = c
    log(f"ceilings: copy {c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    if not (args.model_dir / "config.json").is_file():
        t = time.time()
        random_qwen2_5_vl.write_model_dir(args.model_dir, "qwen2.5-vl-7b", device="cuda")
        log(f"wrote {args.model_dir} in {time.time() - t:.1f} s")
    loaded = load_model(args.model_dir, "cuda", "bfloat16")
    log(f"loaded in {loaded.load_seconds:.1f} s; {counts(loaded)}")
    t = time.time()
    contract = check_contract(loaded)
    log(f"contract held in {time.time() - t:.1f} s: probe images of {contract.probe_image_tokens} tokens")
    template = template_prompt(loaded, args.image_side)
    n_prompt, n_image = len(template.input_ids), template.images[0].num_tokens
    log(f"request: {n_prompt} prompt tokens, {n_image} of them the image (grid {template.images[0].grid})")
    params = counts(loaded)
    lm_bytes = 2 * params["lm"]
    text = loaded.model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
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
    pixels = torch.cat([im.pixels for im in vision_batch]).to("cuda")
    grid = torch.tensor([im.grid for im in vision_batch], device="cuda")
    if not args.skip_hf:
        one = variant(template, 1)
        hf["ttft"] = statistics.median(hf_generate(loaded, [one], 1) for _ in range(3))
        hf["step"] = (hf_generate(loaded, [one], 65) - hf["ttft"]) / 64
        with torch.inference_mode():
            hf["vision_s"] = time_cuda(lambda: loaded.model.model.get_image_features(
                pixel_values=pixels, image_grid_thw=grid), reps=3, warmup=1)
        hf["batch_tok_s"] = 16 * 128 / hf_generate(loaded, [variant(template, 2 + i) for i in range(16)], 128)
    log(f"transformers: {hf}")
    results["hf"] = hf

    engine = PagedEngine(loaded, PagedEngineConfig(max_num_seqs=256, max_queue=4096, max_model_len=args.max_model_len))
    engine.start()
    rows = []
    try:
        images = engine.runner.embedder.images
        on_device = images.to_device(vision_batch)
        with torch.inference_mode():
            vis_s = time_cuda(lambda: images.run(on_device), reps=5, warmup=1)
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
            compiled = compiled_triton_kernels()
            start = time.perf_counter()
            outs = asyncio.run(run_requests(engine, prompts, 128))
            wall = time.perf_counter() - start
            bad = [o["error"] for o in outs if "error" in o]
            problems += bad[:3]
            tokens = sum(o.get("tokens", 0) for o in outs)
            bursts.append({"tok_s": tokens / wall, "wall_s": wall, "failed": len(bad),
                           "ttft_p50_s": statistics.median(o["ttft"] for o in outs if "ttft" in o),
                           "compiled_kernels": compiled_triton_kernels() - compiled})
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
    Path(args.out, "gpu_qwen2_5_vl.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\n{'section':<10}{'metric':<34}{'fovea':>18}{'HF':>16}{'floor/bound':>20}")
    for r in rows:
        print(f"{r[0]:<10}{r[1]:<34}{r[2]:>18}{r[3]:>16}{r[4]:>20}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


async def _first(engine: PagedEngine, prompt: EncodedPrompt) -> dict:
    tokens, logprobs = [], None
    async for event in engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0),
                                       want_first_logprobs=True):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            logprobs = event.first_logprobs
        elif isinstance(event, ErrorEvent):
            raise event.error
    return {"tokens": tokens, "logprobs": logprobs}


if __name__ == "__main__":
    sys.exit(main())
