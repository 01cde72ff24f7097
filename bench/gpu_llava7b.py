"""Build, check and time fovea against transformers on a random-weight LLaVA-1.5-7B (one GPU).

    python bench/gpu_llava7b.py --out $OUT [--quick]

One run, one table. Every figure stands beside the Hugging Face baseline measured in the
same run and beside its floor, computed from FLOPs and bytes with the ceilings measured at
the start of the run (device-to-device copy bandwidth, bf16 matrix rate). Speed does not
depend on the weights' values, so the weights are random (seeded); the architecture is
llava-hf/llava-1.5-7b-hf's: CLIP ViT-L/14 at 336 px (576 image tokens, feature layer -2),
a two-layer GELU projector, and a Llama-2-7B language model.

Sections: ceilings; correctness (fovea's logits vs transformers' within bf16 tolerance,
and greedy tokens); single request (TTFT, decode ms/step); vision stage at batch 32;
throughput (256 requests x (1 image + 64 text tokens) -> 128 greedy tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fovea.engine.core.request import FinishEvent, TokenEvent
from fovea.engine.kernels import triton_util
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import LoadedModel
from fovea.loading.prompt import EncodedPrompt, ImageInput
from fovea.models.base import pixel_hash
from fovea.models.clip_vision import encode_images
from fovea.models.llava import LlavaAdapter

IMAGE_TOKEN = 32000
VOCAB = 32064


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the model -------------------------------------------------------------------------

def llava7b_config():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                       projector_hidden_act="gelu", vision_feature_select_strategy="default",
                       vision_feature_layer=-2, image_seq_length=576)


class NumberTokenizer:
    """Stands in for the Llama tokenizer: speed does not depend on the text."""

    eos_token_id = -1  # never produced: requests run to max_tokens
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t[1:]) for t in text.split()]}


class Processor:
    tokenizer = NumberTokenizer()


def build_model(device: torch.device) -> LoadedModel:
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = llava7b_config()
    with torch.device(device):
        model = LlavaForConditionalGeneration(config).eval()
    # Random values everywhere (never time zeros or uninitialised memory): N(0, 0.02) for
    # matrices and embeddings, 1 +- 0.02 for norm scales, small biases.
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=g)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.02, generator=g)
            else:
                p.normal_(0.0, 0.002, generator=g)
            p.data = p.data.to(torch.bfloat16)  # weights in bf16; rotary buffers stay float32
    # Never stop early: every request makes exactly max_tokens tokens, in fovea and in HF.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    adapter = LlavaAdapter()
    loaded = LoadedModel(path=ROOT, name="llava-1.5-7b-random", model=model, processor=Processor(), device=device,
                         dtype=torch.bfloat16, image_token_id=IMAGE_TOKEN, image_token="<image>",
                         context_length=4096, load_seconds=0.0, adapter=adapter,
                         codec=adapter.codec(Processor(), IMAGE_TOKEN, torch.bfloat16))
    return loaded


def make_prompt(loaded: LoadedModel, seed: int, text_tokens: int = 64) -> EncodedPrompt:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 31000, (text_tokens,), generator=g).tolist()
    ids = [1] + text[:5] + [IMAGE_TOKEN] * 576 + text[5:]
    pixels = torch.randn(3, 336, 336, generator=g).to(loaded.dtype)
    return EncodedPrompt(ids, [ImageInput(pixels, 576, pixel_hash(pixels))], "")


# ---- ceilings --------------------------------------------------------------------------

def time_cuda(fn, reps: int = 20, warmup: int = 3) -> float:
    return triton_util.time_cuda(fn, reps, warmup)


def ceilings() -> dict:
    n = 2 * 1024**3  # 2 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    copy_s = time_cuda(lambda: b.copy_(a))
    bandwidth = 2 * n / copy_s  # bytes read + written
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_s = time_cuda(lambda: x @ y, reps=10)
    flops = 2 * m**3 / mm_s
    return {"copy_bandwidth_Bps": bandwidth, "bf16_matmul_flops": flops}


# ---- counting ----------------------------------------------------------------------------

def lm_params(loaded) -> int:
    return sum(p.numel() for n, p in loaded.model.named_parameters() if "language_model" in n or "lm_head" in n)


def vision_params(loaded) -> int:
    return sum(p.numel() for n, p in loaded.model.named_parameters()
               if "vision_tower" in n or "multi_modal_projector" in n)


def vision_flops_per_image(loaded) -> float:
    cfg = loaded.model.config.vision_config
    tokens = (cfg.image_size // cfg.patch_size) ** 2 + 1
    linear = 2 * vision_params(loaded) * tokens
    attention = 4 * cfg.num_hidden_layers * tokens * tokens * cfg.hidden_size
    return linear + attention


def prefill_flops(loaded, prompt_tokens: int) -> float:
    cfg = loaded.model.config.text_config
    return 2 * lm_params(loaded) * prompt_tokens + 2 * cfg.num_hidden_layers * prompt_tokens**2 * cfg.hidden_size


# ---- runs --------------------------------------------------------------------------------

async def run_requests(engine, prompts, max_tokens: int) -> list[dict]:
    async def one(p):
        start = time.perf_counter()
        stamps = []
        async for event in engine.generate(p, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                stamps.append(time.perf_counter())
            elif isinstance(event, FinishEvent):
                return {"ttft": event.first_token_s, "total": event.total_s, "tokens": event.completion_tokens,
                        "stamps": [s - start for s in stamps]}
        return {}
    return await asyncio.gather(*(one(p) for p in prompts))


def make_engine(kind: str, loaded: LoadedModel, max_batch: int, batched_tokens: int | None = None):
    """fovea's one engine (``kind`` names it in the table: "paged")."""
    from fovea.engine import PagedEngine, PagedEngineConfig

    return PagedEngine(loaded, PagedEngineConfig(max_num_seqs=max_batch, max_queue=4096,
                                                 max_num_batched_tokens=batched_tokens))


def hf_generate(loaded, prompts: list[EncodedPrompt], max_new: int) -> float:
    """Seconds of transformers' ``generate`` over the prompts as one batch (equal lengths)."""
    ids = torch.tensor([p.input_ids for p in prompts], device=loaded.device)
    inputs = [loaded.adapter.reference_inputs(p, loaded.device, loaded.image_token_id) for p in prompts]
    extra = {k: torch.cat([i[k] for i in inputs]) for k in inputs[0]}
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                              max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--engines", default="paged", help="the engine's label in the table (one engine: paged)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines (reported as nan)")
    parser.add_argument("--throughput-runs", type=int, default=1,
                        help="time the request burst this many times and report the median")
    parser.add_argument("--batched-tokens", type=int, default=None,
                        help="the paged engine's max_num_batched_tokens (default: the engine's)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one request and a 32-request burst per engine (tables under --out)")
    args = parser.parse_args()
    device = torch.device("cuda")
    results: dict = {"engines": args.engines, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    rows: list[tuple[str, str, str, str, str]] = []

    c = ceilings()
    results["ceilings"] = c
    log(f"ceilings: copy {c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 matmul {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    t0 = time.time()
    loaded = build_model(device)
    log(f"model built in {time.time() - t0:.1f} s: LM {lm_params(loaded) / 1e9:.2f} B, vision+projector "
        f"{vision_params(loaded) / 1e9:.3f} B parameters")
    weight_bytes = 2 * sum(p.numel() for p in loaded.model.parameters())
    lm_bytes = 2 * lm_params(loaded)

    reps = 3 if args.quick else 7
    n = 32 if args.quick else args.requests
    p = make_prompt(loaded, 7)
    n_prompt = len(p.input_ids)
    # -- transformers baselines, once (NaN with --skip-hf, for a quick re-measure of fovea alone).
    nan = float("nan")
    hf = {"ttft": nan, "step": nan, "vision_s": nan, "batch_tok_s": nan}
    pixels = torch.randn(32, 3, 336, 336, device=device, dtype=torch.bfloat16)
    prompts = [make_prompt(loaded, 1000 + i) for i in range(n)]
    if not args.skip_hf:
        hf["ttft"] = statistics.median(hf_generate(loaded, [p], 1) for _ in range(3))
        hf_129 = statistics.median(hf_generate(loaded, [p], 129) for _ in range(2))
        hf["step"] = (hf_129 - hf["ttft"]) / 128
        with torch.inference_mode():
            hf["vision_s"] = time_cuda(lambda: loaded.model.get_image_features(
                pixel_values=pixels, vision_feature_layer=-2, vision_feature_select_strategy="default"), reps=5)
        hf_b = min(32, n)
        hf["batch_tok_s"] = hf_b * 128 / hf_generate(loaded, prompts[:hf_b], 128)
    log(f"transformers: {hf}")

    floor_step = lm_bytes / c["copy_bandwidth_Bps"]
    floor_ttft = (prefill_flops(loaded, n_prompt) + vision_flops_per_image(loaded)) / c["bf16_matmul_flops"]
    vis_floor = 32 * vision_flops_per_image(loaded) / c["bf16_matmul_flops"]
    prefill = n * (prefill_flops(loaded, n_prompt) + vision_flops_per_image(loaded))
    cfg = loaded.model.config.text_config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.hidden_size * 2
    ctx = n_prompt + 64
    decode_bytes = 128 * lm_bytes + n * 128 * ctx * kv_per_token
    decode_flops = n * 128 * 2 * lm_params(loaded)
    bound_s = prefill / c["bf16_matmul_flops"] + max(decode_flops / c["bf16_matmul_flops"],
                                                     decode_bytes / c["copy_bandwidth_Bps"])
    vis_s = time_cuda(lambda: encode_images(loaded, pixels), reps=5 if args.quick else 10)
    results["vision"] = {"fovea_images_per_s": 32 / vis_s, "hf_images_per_s": 32 / hf["vision_s"],
                         "floor_images_per_s": 32 / vis_floor}
    rows.append(("vision b32", "images/s", f"{32 / vis_s:.0f}", f"{32 / hf['vision_s']:.0f}",
                 f"{32 / vis_floor:.0f} (FLOPs)"))
    from fovea.engine.vision.vision_graphs import try_graphed_vision

    graphed = try_graphed_vision(loaded, 32)
    if graphed is not None:
        vis_g = time_cuda(lambda: graphed(pixels), reps=5 if args.quick else 10)
        results["vision"]["fovea_graphed_images_per_s"] = 32 / vis_g
        rows.append(("vision b32 (graph)", "images/s", f"{32 / vis_g:.0f}", f"{32 / hf['vision_s']:.0f}",
                     f"{32 / vis_floor:.0f} (FLOPs)"))
        del graphed
    # The vision stage the engine picks (fused Triton kernels where they pass their check).
    from fovea.engine.vision.vision_fused import FusedVision, choose_vision_encoder

    fused, label = choose_vision_encoder(loaded)
    log(f"vision stage of the engine: {label}")
    if isinstance(fused, FusedVision):
        vis_f = time_cuda(lambda: fused(pixels), reps=5 if args.quick else 10)
        results["vision"]["fovea_fused_images_per_s"] = 32 / vis_f
        rows.append(("vision b32 (fused)", "images/s", f"{32 / vis_f:.0f}", f"{32 / hf['vision_s']:.0f}",
                     f"{32 / vis_floor:.0f} (FLOPs)"))
        graphed = try_graphed_vision(loaded, 32, encode=fused)
        if graphed is not None:
            vis_fg = time_cuda(lambda: graphed(pixels), reps=5 if args.quick else 10)
            results["vision"]["fovea_fused_graphed_images_per_s"] = 32 / vis_fg
            rows.append(("vision b32 (fused+graph)", "images/s", f"{32 / vis_fg:.0f}",
                         f"{32 / hf['vision_s']:.0f}", f"{32 / vis_floor:.0f} (FLOPs)"))
            del graphed
    results["hf"] = hf

    for kind in args.engines.split(","):
        engine = make_engine(kind, loaded, max_batch=256, batched_tokens=args.batched_tokens)
        engine.start()
        try:
            run_engine(kind, engine, loaded, device, reps, prompts, results, rows, hf, floor_step, floor_ttft,
                       bound_s, n_prompt, args.throughput_runs)
            if args.profile:
                profile_engine(kind, engine, loaded, Path(args.out))
        except Exception:
            traceback.print_exc()
        finally:
            engine.stop()
            del engine
            torch.cuda.empty_cache()
    results["weight_bytes"] = weight_bytes
    Path(args.out, "gpu_bench.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'section':<22}{'metric':<28}{'fovea':>12}{'HF':>16}{'floor/bound':>20}")
    for r in rows:
        print(f"{r[0]:<22}{r[1]:<28}{r[2]:>12}{r[3]:>16}{r[4]:>20}")
    return 0


def run_engine(kind, engine, loaded, device, reps, prompts, results, rows, hf, floor_step, floor_ttft, bound_s,
               n_prompt, throughput_runs: int = 1) -> None:
    out: dict = {}
    results[kind] = out
    # -- correctness: first-token log-probabilities and greedy tokens vs transformers.
    prompt = make_prompt(loaded, 1)
    ids = torch.tensor([prompt.input_ids], device=device)
    extra = loaded.adapter.reference_inputs(prompt, device, loaded.image_token_id)
    with torch.inference_mode():
        ref = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                                    max_new_tokens=16, min_new_tokens=16,
                                    do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, ids.shape[1]:].tolist()
    ref_logprobs = torch.log_softmax(ref.logits[0][0].float(), dim=-1)
    tokens, logprobs = asyncio.run(_tokens_and_logits(engine, prompt))
    rel = float((logprobs.to(device) - ref_logprobs).norm() / ref_logprobs.norm())
    agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
    out["check"] = {"first_logprobs_rel_err": rel, "greedy_prefix_equal": agree, "of": len(ref_tokens)}
    log(f"{kind} check: first-token log-prob rel. error {rel:.2e}; greedy tokens equal for {agree}/{len(ref_tokens)}")
    rows.append((f"{kind}: check", "logprob rel err / tokens", f"{rel:.1e}", f"{agree}/{len(ref_tokens)} equal", "< 1e-2"))
    # -- single request.
    singles = [asyncio.run(run_requests(engine, [make_prompt(loaded, 100 + i)], 128))[0] for i in range(reps + 1)][1:]
    log_phases(engine, f"{kind} single ({reps + 1} requests)")
    step = statistics.median((s["stamps"][-1] - s["stamps"][0]) / (len(s["stamps"]) - 1) for s in singles)
    ttft = statistics.median(s["ttft"] for s in singles)
    out["single"] = {"step_ms": 1e3 * step, "ttft_ms": 1e3 * ttft, "floor_step_ms": 1e3 * floor_step,
                     "floor_ttft_ms": 1e3 * floor_ttft, "prompt_tokens": n_prompt}
    rows.append((f"{kind}: single", "decode ms/step", f"{1e3 * step:.2f}", f"{1e3 * hf['step']:.2f}",
                 f"{1e3 * floor_step:.2f} (bytes)"))
    rows.append((f"{kind}: single", "TTFT ms", f"{1e3 * ttft:.1f}", f"{1e3 * hf['ttft']:.1f}",
                 f"{1e3 * floor_ttft:.1f} (FLOPs)"))
    log(f"{kind} single: {out['single']}")
    # -- where a first token's time goes: requests that stop after it, phase timers alone.
    queued = getattr(engine, "queued_seconds", 0.0)
    firsts = [asyncio.run(run_requests(engine, [make_prompt(loaded, 200 + i)], 1))[0] for i in range(reps)]
    queued = (getattr(engine, "queued_seconds", 0.0) - queued) / reps
    log_phases(engine, f"{kind} first token only ({reps} requests of max_tokens 1)")
    log(f"{kind} first token only: TTFT median {1e3 * statistics.median(s['ttft'] for s in firsts):.1f} ms; "
        f"from arrival until the worker took the request: {1e3 * queued:.2f} ms (mean)")
    # -- throughput: the burst `throughput_runs` times, the median run reported.
    bursts = []
    for run in range(max(1, throughput_runs)):
        # Fresh images and text each run: a repeated burst would hit the prefix and encoder
        # caches and skip its prefill.
        burst = prompts if run == 0 else [make_prompt(loaded, 1000 + 100_000 * run + i) for i in range(len(prompts))]
        compiled = compiled_triton_kernels() if device.type == "cuda" else 0
        if hasattr(engine, "step_trace"):
            engine.step_trace = []
        t = time.perf_counter()
        outs = asyncio.run(run_requests(engine, burst, 128))
        wall = time.perf_counter() - t
        log_phases(engine, f"{kind} throughput")
        log_step_trace(engine, f"{kind} burst {run + 1}")
        if device.type == "cuda":
            log(f"{kind} burst {run + 1}: {compiled_triton_kernels() - compiled} Triton kernel variants compiled during it")
        bursts.append({"tok_s": sum(o["tokens"] for o in outs) / wall, "wall_s": wall,
                       "ttft_p50_s": statistics.median(o["ttft"] for o in outs)})
        log(f"{kind} burst: {bursts[-1]}")
    median = sorted(bursts, key=lambda b: b["tok_s"])[len(bursts) // 2]
    n = len(prompts)
    out["throughput"] = {"requests": n, **median, "runs": [b["tok_s"] for b in bursts],
                         "roofline_tok_s": n * 128 / bound_s}
    rows.append((f"{kind}: {n} requests", "output tok/s", f"{median['tok_s']:.0f}",
                 f"{hf['batch_tok_s']:.0f} (b32)", f"{n * 128 / bound_s:.0f} (roofline)"))
    log(f"{kind} throughput: {out['throughput']}")


def compiled_triton_kernels() -> int:
    """Variants of fovea's Triton kernels compiled so far in this process (a rise during a
    timed run means it paid for JIT compilation)."""
    from fovea.engine.kernels import triton_decode, triton_ops, triton_prefill

    total = 0
    for module in (triton_decode, triton_prefill, triton_ops):
        kernels = module._kernels()
        for fn in kernels if isinstance(kernels, tuple) else (kernels,):
            total += sum(len(entry[0]) for entry in getattr(fn, "device_caches", {}).values())
    return total


def log_step_trace(engine, what: str, top: int = 6) -> None:
    """The slowest step launches of the last run, with what they held."""
    trace = getattr(engine, "step_trace", None)
    if not trace:
        return
    slow = sorted(trace, reverse=True)[:top]
    launch = sum(t for t, *_ in trace)
    log(f"{what}: {len(trace)} steps, launches {launch:.2f} s; slowest (ms, decodes, prefill tokens, chunks): "
        + "; ".join(f"{1e3 * t:.1f}, {d}, {n}, {c}" for t, d, n, c in slow))
    trace.clear()


def log_phases(engine, what: str) -> None:
    """The paged engine's step phases since the last call (then reset): where wall time went."""
    phases = getattr(engine, "phase_seconds", None)
    if phases is None:
        return
    steps = max(1, engine.steps - getattr(engine, "_bench_steps", 0))
    engine._bench_steps = engine.steps
    total = sum(phases.values())
    parts = ", ".join(f"{k} {v:.2f} s ({1e3 * v / steps:.2f} ms/step)" for k, v in phases.items())
    log(f"{what}: {steps} steps, {total:.2f} s in steps: {parts}")
    for key in phases:
        phases[key] = 0.0


def profile_engine(kind: str, engine, loaded, out: Path) -> None:
    """Where the time goes: the top kernels and ops of one request and of a 32-request burst."""
    from torch.profiler import ProfilerActivity, profile

    for name, prompts, tokens in (("single", [make_prompt(loaded, 5000)], 32),
                                  ("burst32", [make_prompt(loaded, 6000 + i) for i in range(32)], 32)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            asyncio.run(run_requests(engine, prompts, tokens))
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        (out / f"profile_{kind}_{name}.txt").write_text(table)
        log(f"profile {kind}/{name} written")


async def _tokens_and_logits(engine, prompt):
    tokens, logprobs = [], None
    async for event in engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0), want_first_logprobs=True):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            logprobs = event.first_logprobs
    return tokens, logprobs


if __name__ == "__main__":
    sys.exit(main())
