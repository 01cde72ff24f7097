"""The shared harness of bench/gpu_qwen2_5_vl.py and bench/gpu_qwen3_vl.py: Qwen-VL at real resolutions.

On a random-weight directory of the family's real shape (its config, processor, vocabulary;
``fovea.testing.random_qwen2_5_vl`` / ``random_qwen3_vl``), in one run:

- offline: the serve section's requests (the same bodies: warm-up, ``--runs`` bursts, seven
  one-image requests) through the engine in this process, no HTTP, with the engine settings
  ``fovea serve --max-model-len`` gets; the prompts are made before the clock starts. Runs
  first and gives its GPU memory back before any server starts; the serve rows then read as a
  share of it (goals: burst tokens/s >= 95% of offline, one-image TTFT <= offline + 2 ms).
- serve: ``fovea serve`` on the directory with the grounding canary, the seconds to a ready
  /health (and the server's own account of them: its "start-up:" log line), then bursts of
  ``--burst`` concurrent streamed requests, each with ``--images`` distinct photo-like JPEGs of
  ``--burst-size`` (1280x720 by default) and 64 words, 128 tokens with ``ignore_eos``, sent by
  a load generator in processes of its own (``load_procs``); tokens/s, TTFT and TPOT p50/p99 and
  the failed-request count beside them. Then one request at a time with one image (TTFT), and
  Poisson arrivals of the burst's requests at ``--loads`` shares of the rate the median burst
  sustained, ``--sustain-seconds`` each (TTFT and TPOT p50/p99, failed of sent), and the memory
  plan from /health with torch's peak beside it. ``--topologies agg,e_pd`` repeats it split
  into encode workers.
- vision: the vision stage the engine chooses (``--vision-stage``), ms per image at 336x336,
  1280x720 and 1920x1080, batch 1 and 8, beside transformers' ``get_image_features`` on the same
  pixels in the same process and the compute floor (its matrix FLOPs at the measured bf16
  rate), and the relative difference of the two stages' rows.
- check: the engine's first-token log-probabilities and greedy tokens against transformers'
  own forward and ``generate`` on one request.

Ceilings (copy bandwidth, bf16 matrix rate) are measured first. The last lines are a table;
everything is also in $OUT/<family>.json. Exit status 1 when a request failed (offline, in a
burst, alone or under a Poisson load), torch's peak passed the plan, the engine disagreed with
transformers or the server did not start (goals missed are figures, not failures).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import load_procs
import serve_load as load
from gpu_llava7b import ceilings, log, time_cuda
from gpu_serve import Server, body_prompt, engine_burst, gib, memory_summary, release_gpu, sustained

from fovea.models.qwen_pixels import vision_pixels

SIZES = ((336, 336), (1280, 720), (1920, 1080))
CUDA = torch.cuda.is_available()  # without a GPU (``--arch tiny``): a smoke run, no floors


def timed(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median seconds per call: CUDA events on a GPU, the wall clock on the CPU."""
    if CUDA:
        return time_cuda(fn, reps=reps, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
MAX_TOKENS = 128
SINGLE_COUNT = 7  # one-image requests timed one at a time


@dataclass(frozen=True)
class FamilyBench:
    """What differs between the two families: their random-directory writer and default shape."""

    name: str  # the JSON's and the log's name
    random_dir: ModuleType  # fovea.testing.random_qwen2_5_vl or random_qwen3_vl
    default_arch: str


# ---- counting ------------------------------------------------------------------------------

def vision_flops(vision_config, grid: tuple[int, int, int]) -> float:
    """Matrix FLOPs of one image through the tower: the patch embedding, every block's linears
    over its patches, attention over its window (Qwen2.5-VL's window blocks) or the whole image,
    and the merger(s) (Qwen3-VL: one per DeepStack level too)."""
    cfg = vision_config
    t, h, w = grid
    patches = t * h * w
    hidden, merge, depth = cfg.hidden_size, cfg.spatial_merge_size, cfg.depth
    gated = hasattr(cfg, "fullatt_block_indexes")  # Qwen2.5-VL: SwiGLU MLP and window attention
    block = 4 * hidden * hidden + (3 if gated else 2) * hidden * cfg.intermediate_size
    if gated:
        full = len(cfg.fullatt_block_indexes)
        window = min((cfg.window_size // cfg.patch_size) ** 2, patches)
        context = full * patches + (depth - full) * window
    else:
        context = depth * patches
    attention = 4 * hidden * patches * context
    merged = hidden * merge * merge
    mergers = 1 + len(getattr(cfg, "deepstack_visual_indexes", None) or [])
    merger = mergers * (merged * merged + merged * cfg.out_hidden_size)
    embed = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2 * hidden
    return 2 * (patches * (embed + depth * block) + merger * patches / (merge * merge)) + attention


# ---- serve --------------------------------------------------------------------------------

def startup_line(server: Server) -> str:
    for line in server.log_path.read_text(errors="replace").splitlines():
        if "start-up: ready after" in line:
            return line.split("start-up: ", 1)[1]
    return ""


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step counters from /metrics: steps, each phase's seconds, the vision GPU time."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "fovea_engine_steps_total" or name.startswith("fovea_engine_step_phase_seconds_total"):
            out[name.split('phase="')[-1].rstrip('"}') if "phase" in name else "steps"] = float(value)
        elif name == "fovea_vision_encoder_latency_ms_sum":
            out["vision_gpu_s"] = float(value) / 1000
    return out


def engine_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: round(after[key] - before.get(key, 0.0), 3) for key in after}


# Request bodies by their key (burst_bodies); seeds kept apart so that no two requests share an image.
_BODIES: dict[tuple, list[dict]] = {}
WARM_SEED, SINGLE_SEED, POISSON_SEED = 10_000, 900_000, 1_000_000  # bursts: 100,000 x (run + 1) on


def burst_bodies(name: str, first: int, count: int, args, words: Callable[[int], str],
                 max_tokens: int = MAX_TOKENS, keep: bool = True) -> list[dict]:
    """``count`` requests of ``args.images`` images of ``--burst-size`` and 64 words, seeds from
    ``first``. ``keep``: made once, so the offline section and the server get the same requests."""
    key = (name, first, count, max_tokens, args.images, args.burst_size)
    if key in _BODIES:
        return _BODIES[key]
    bodies = load_procs.chat_bodies([(name, first + i, words(first + i), max_tokens, args.images, args.burst_size)
                                     for i in range(count)])
    if keep:
        _BODIES[key] = bodies
    return bodies


def single_bodies(name: str, args, words: Callable[[int], str], count: int) -> list[dict]:
    """One image of ``--burst-size`` and 16 tokens each: the one-request TTFT's requests (the first warms)."""
    return [load.chat_body(name, SINGLE_SEED + i, words(i), 16, images=1, size=args.burst_size)
            for i in range(count + 1)]


PHASES = {"prepare": "fovea_request_prepare_seconds", "queue": "fovea_request_queue_seconds",
          "prefill": "fovea_request_prefill_seconds", "engine_ttft": "fovea_time_to_first_token_seconds"}


def request_phases(url: str) -> dict[str, float]:
    """The server's first-token phase histograms' sums and counts (fovea/serve/metrics.py)."""
    wanted = {f"{metric}_{part}" for metric in PHASES.values() for part in ("sum", "count")}
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            out[name] = float(value)
    return out


def phase_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Each phase's mean over the requests between two readings (ms; None where none was observed)."""
    means = {}
    for phase, metric in PHASES.items():
        count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        total = after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)
        means[f"{phase}_ms"] = round(1e3 * total / count, 2) if count > 0 else None
    return means


def single_ttft(url: str, name: str, args, words: Callable[[int], str], count: int = SINGLE_COUNT) -> dict:
    """One request at a time, one image of ``--burst-size``, 16 tokens: TTFT median and spread, and
    where the mean went: the API's preparation, the engine's queue and prefill, and the rest (HTTP,
    the hand-off to the engine and the token's way back) of the client's mean TTFT."""
    bodies = single_bodies(name, args, words, count)
    asyncio.run(load.sequential(url, bodies[:1]))  # the first warms
    before = request_phases(url)
    results = asyncio.run(load.sequential(url, bodies[1:]))
    summary = ttft_summary(results)
    phases = phase_means_ms(before, request_phases(url))
    ok = [1e3 * r.ttft_s for r in results if r.ok]
    if ok and phases["prepare_ms"] is not None and phases["engine_ttft_ms"] is not None:
        phases["client_mean_ms"] = round(sum(ok) / len(ok), 2)
        phases["rest_ms"] = round(phases["client_mean_ms"] - phases["prepare_ms"] - phases["engine_ttft_ms"], 2)
    summary["phases_ms"] = phases
    return summary


def ttft_summary(results: list[load.Result]) -> dict:
    ttfts = sorted(1e3 * r.ttft_s for r in results if r.ok)
    return {"ttft_ms_p50": ttfts[len(ttfts) // 2] if ttfts else None, "ttft_ms": ttfts,
            "failed": sum(not r.ok for r in results), "of": len(results)}


def offline_section(model_dir: Path, args, words: Callable[[int], str]) -> dict:
    """The serve section's requests through the engine in this process, no HTTP: the same warm-up,
    bursts (the same bodies, made into prompts before the clock starts) and one-image requests,
    with the engine settings `fovea serve --max-model-len` gets (``--server-args`` are not
    mirrored). The model and the engine are gone, and the allocator's cap lifted, on return."""
    from fovea.config import ServerSettings, engine_config
    from fovea.engine import PagedEngine
    from fovea.engine.sampling.params import SamplingParams
    from fovea.loading.loader import load_model

    started = time.perf_counter()
    loaded = load_model(model_dir, "cuda" if CUDA else "cpu", "auto")
    engine = PagedEngine(loaded, engine_config(ServerSettings(max_model_len=args.max_model_len)))
    result: dict = {"load_s": time.perf_counter() - started}
    name = model_dir.name  # the server's default model name: the same bodies, shared
    params = lambda tokens: SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = lambda bodies: [body_prompt(loaded, b) for b in bodies]
    engine.start()
    try:
        engine_burst(engine, prompts(burst_bodies(name, WARM_SEED, 4, args, words, max_tokens=8)), params(8))
        runs = []
        for run in range(args.runs):
            batch = prompts(burst_bodies(name, 100_000 * (run + 1), args.burst, args, words))
            sent, wall = engine_burst(engine, batch, params(MAX_TOKENS))
            runs.append(load.summarize(sent, wall))
            log(f"offline burst {run + 1}: {runs[-1].tok_s:.0f} tok/s, {runs[-1].failed} failed, TTFT p50 "
                f"{runs[-1].ttft_p50_ms:.0f} p99 {runs[-1].ttft_p99_ms:.0f} ms, TPOT p50 {runs[-1].tpot_p50_ms:.1f} ms "
                f"{runs[-1].errors}")
        median = sorted(runs, key=lambda s: s.tok_s)[len(runs) // 2]
        result["burst"] = {**median.__dict__, "tok_s": median.tok_s, "runs_tok_s": [s.tok_s for s in runs],
                           "failed_total": sum(s.failed for s in runs)}
        singles = [engine_burst(engine, [p], params(16))[0][0]
                   for p in prompts(single_bodies(name, args, words, SINGLE_COUNT))][1:]
        result["single"] = ttft_summary(singles)
        log(f"offline one request, one {args.burst_size[0]}x{args.burst_size[1]} image: TTFT {result['single']}")
        result["plan_bytes"] = engine.runner.memory_plan.planned_bytes
    finally:
        engine.stop()
    return result


def serve_section(model_dir: Path, args, out: Path, topology: str, words: Callable[[int], str]) -> dict:
    extra = ["--max-model-len", str(args.max_model_len), *args.server_args.split()]
    if topology == "e_pd":
        extra += ["--topology", "e_pd", "--encode-workers", str(args.encode_workers)]
    server = Server(model_dir, out, topology, *extra, canary=True)
    result: dict = {"topology": topology}
    try:
        result["ready_s"] = server.wait_ready(timeout=900)
        health = httpx.get(server.url + "/health", timeout=30).json()
        result["startup"] = health.get("startup")
        result["startup_line"] = startup_line(server)
        result["canary_ok"] = (health.get("canary") or {}).get("ok")
        log(f"{topology}: ready after {result['ready_s']:.1f} s; {result['startup_line']}")
        name = health["model"]
        load_procs.burst(server.url, burst_bodies(name, WARM_SEED, 4, args, words, max_tokens=8), processes=2)
        runs, clients, splits = [], [], []
        for run in range(args.runs):
            bodies = burst_bodies(name, 100_000 * (run + 1), args.burst, args, words)
            before = engine_counters(server.url)
            sent = load_procs.burst(server.url, bodies, processes=args.client_processes)
            split = engine_split(before, engine_counters(server.url))
            summary = load.summarize(sent.results, sent.wall_s)
            runs.append(summary)
            clients.append(sent.client)
            splits.append(split)
            log(f"{topology} burst {run + 1}: {summary.tok_s:.0f} tok/s, {summary.failed} failed, TTFT p50 "
                f"{summary.ttft_p50_ms:.0f} p99 {summary.ttft_p99_ms:.0f} ms, TPOT p50 {summary.tpot_p50_ms:.1f} "
                f"p99 {summary.tpot_p99_ms:.1f} ms {summary.errors}; {load_procs.describe(sent.client)}; "
                f"wall {sent.wall_s:.2f} s, engine: {split}")
        median = sorted(runs, key=lambda s: s.tok_s)[len(runs) // 2]
        result["burst"] = {**median.__dict__, "tok_s": median.tok_s, "runs_tok_s": [s.tok_s for s in runs],
                           "failed_total": sum(s.failed for s in runs), "clients": clients, "engine": splits}
        result["single"] = single_ttft(server.url, name, args, words)
        log(f"{topology} one request, one {args.burst_size[0]}x{args.burst_size[1]} image: TTFT {result['single']}")
        # Open-loop arrivals at shares of the rate the median burst sustained (its requests over its wall time).
        capacity = median.requests / median.wall_s
        result["capacity_req_s"] = capacity
        result["sustained"] = sustained(
            server.url, lambda first, n: burst_bodies(name, first, n, args, words, keep=False), capacity, args,
            seed_base=POISSON_SEED)
        result["memory"] = memory_summary(server)
    except Exception as exc:  # noqa: BLE001 - reported as a problem, the other sections still run
        result["error"] = f"{type(exc).__name__}: {exc}; log tail: {server.tail()}"
        log(f"{topology}: {result['error']}")
    finally:
        server.stop()
    if args.warm_start and "error" not in result:
        # The same start again: Triton's compiled kernels and fovea's tuning cache are on disk now.
        again = Server(model_dir, out, f"{topology}-warm", *extra, canary=True)
        try:
            result["warm_ready_s"] = again.wait_ready(timeout=900)
            result["warm_startup_line"] = startup_line(again)
            log(f"{topology}: warm start ready after {result['warm_ready_s']:.1f} s; {result['warm_startup_line']}")
        except Exception as exc:  # noqa: BLE001
            result["error"] = f"warm start: {type(exc).__name__}: {exc}; log tail: {again.tail()}"
        finally:
            again.stop()
    return result


# ---- vision ----------------------------------------------------------------------------------

def photo(size: tuple[int, int], seed: int):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(load.photo_jpeg(seed, size))).convert("RGB")


def image_inputs(loaded, size: tuple[int, int], count: int, seed: int) -> list:
    """``count`` distinct photo-like images of ``size`` through the model's own processor."""
    images = [photo(size, seed + i) for i in range(count)]
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": "x"}]}]
    prompt = loaded.codec.encode(loaded.codec.render(messages), images)
    return [dataclasses.replace(im, pixels=im.pixels.to(loaded.device)) for im in prompt.images]


def fovea_vision_stage(loaded, which: str) -> tuple[Callable, str]:
    """The vision forward the engine would run (``chosen``), or the adapter's eager one."""
    if which == "eager":
        return loaded.adapter.vision_forward(loaded), "the adapter's modules (eager)"
    from fovea.engine.vision.vision_stage import choose_vision_stage

    stage = choose_vision_stage(loaded, enabled=True)
    return stage.forward, stage.label


def hf_vision(loaded) -> Callable:
    model = loaded.model.model

    def run(images: list) -> object:
        # Resized uint8 images become the processor's patches on the device, as fovea's stage does.
        pixels = vision_pixels(images, lambda: loaded.adapter.patch_recipe(loaded), loaded.device,
                               next(model.visual.parameters()).dtype)
        grid = torch.tensor([im.grid for im in images], device=pixels.device)
        return model.get_image_features(pixel_values=pixels, image_grid_thw=grid)

    return run


def hf_rows(loaded, out) -> torch.Tensor:
    """transformers' output as the adapter's rows (the merged embedding, then DeepStack levels)."""
    rows = loaded.adapter.vision_rows(out)
    return torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows


def vision_section(loaded, args, c: dict) -> tuple[dict, list[tuple]]:
    forward, label = fovea_vision_stage(loaded, args.vision_stage)
    hf = hf_vision(loaded)
    log(f"vision stage: {label}")
    out: dict = {"stage": label, "cases": []}
    rows = []
    for size in SIZES:
        for batch in (1, 8):
            images = image_inputs(loaded, size, batch, seed=7 * batch + size[0])
            flops = sum(vision_flops(loaded.model.config.vision_config, im.grid) for im in images)
            with torch.inference_mode():
                ours = timed(lambda images=images: forward(images), reps=args.vision_reps, warmup=2)
                theirs = timed(lambda images=images: hf(images), reps=max(3, args.vision_reps // 3), warmup=1) \
                    if not args.skip_hf else float("nan")
                if batch == 1:
                    got = torch.cat(forward(images)).float()
                    ref = hf_rows(loaded, hf(images)).float() if not args.skip_hf else got
                    rel = float((got - ref).norm() / ref.norm())
                else:
                    rel = float("nan")
            floor = flops / c["bf16_matmul_flops"]
            case = {"size": f"{size[0]}x{size[1]}", "batch": batch, "tokens_per_image": images[0].num_tokens,
                    "patches_per_image": math.prod(images[0].grid), "fovea_ms_per_image": 1e3 * ours / batch,
                    "hf_ms_per_image": 1e3 * theirs / batch, "floor_ms_per_image": 1e3 * floor / batch,
                    "fovea_share_of_floor": floor / ours, "rows_rel_diff_vs_hf": rel}
            out["cases"].append(case)
            log(f"vision {case}")
            rows.append((f"vision {case['size']}", f"ms/image b{batch} ({case['tokens_per_image']} tok)",
                         f"{case['fovea_ms_per_image']:.2f}", f"{case['hf_ms_per_image']:.2f}",
                         f"{case['floor_ms_per_image']:.2f} ({100 * case['fovea_share_of_floor']:.0f}%)"))
    if CUDA:
        out["encode_worker_plan_720p"] = worker_plan_720p(loaded, forward)
        plan = out["encode_worker_plan_720p"]
        log(f"encode worker plan for one 1280x720 image: {plan}")
        rows.append(("encode worker", "plan for one 1280x720 image", f"{plan['total_gib']:.2f} GiB",
                     "", "goal 2 GiB"))
    return out, rows


def worker_plan_720p(loaded, forward: Callable) -> dict:
    """What an encode worker serving 1280x720 images plans (``disagg/encode_worker``): its vision
    weights, the measured activation peak of one such image through ``forward``, and its margin."""
    from fovea.disagg.encoder_plan import MARGIN_BYTES

    weights = sum(p.numel() * p.element_size() for m in loaded.adapter.vision_modules(loaded.model)
                  for p in m.parameters())
    images = image_inputs(loaded, (1280, 720), 1, seed=11)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        rows = forward(images)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del rows
    gib = 1 << 30
    return {"weights_gib": weights / gib, "activation_peak_gib": peak / gib, "margin_gib": MARGIN_BYTES / gib,
            "total_gib": (weights + peak + MARGIN_BYTES) / gib}


# ---- check against transformers ---------------------------------------------------------------

def check_section(loaded, words: Callable[[int], str]) -> dict:
    from fovea.engine import PagedEngine, PagedEngineConfig
    from fovea.engine.core.request import ErrorEvent, FinishEvent, TokenEvent
    from fovea.engine.reference import reference_generate, reference_logits
    from fovea.engine.sampling.params import SamplingParams
    from fovea.models.base import with_text_tokens

    image = photo((1280, 720), 3)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words(3)}]}]
    prompt = loaded.codec.encode(loaded.codec.render(messages), [image])
    ref_tokens = reference_generate(loaded, prompt, 16)
    ref_lp = torch.log_softmax(reference_logits(loaded, prompt), -1)
    engine = PagedEngine(loaded, PagedEngineConfig(max_num_seqs=8, max_model_len=min(8192, loaded.context_length), cuda_graphs=False,
                                                   kv_cache_memory=(4 << 30) if CUDA else (256 << 20)))
    engine.start()

    async def first() -> tuple[list[int], torch.Tensor]:
        tokens, logprobs = [], None
        async for event in engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0),
                                           want_first_logprobs=True):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                tokens.append(event.token_id)
            elif isinstance(event, FinishEvent):
                logprobs = event.first_logprobs
            elif isinstance(event, ErrorEvent):
                raise event.error
        return tokens, logprobs

    try:
        tokens, logprobs = asyncio.run(first())
    finally:
        engine.stop()
    rel = float((logprobs.to(ref_lp.device) - ref_lp).norm() / ref_lp.norm())
    agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
    out = {"first_logprobs_rel_err": rel, "greedy_prefix_equal": agree, "of": len(ref_tokens),
           "prompt_tokens": len(prompt.input_ids)}
    if agree < min(len(tokens), len(ref_tokens)):
        # Where the two greedy answers part, after the same tokens: transformers' logit of its
        # own pick minus its logit of the engine's. Random weights give near-tied logits, which
        # bf16 rounding may swap; a swap is rounding only when that gap is within the rounding
        # the first step showed (its relative error times the largest logit, twice over).
        with torch.inference_mode():
            logits = reference_logits(loaded, with_text_tokens(prompt, ref_tokens[:agree]))
        gap = float(logits[ref_tokens[agree]] - logits[tokens[agree]])
        bound = 2 * rel * float(logits.abs().max())
        out.update({"diverge_gap": gap, "rounding_bound": bound, "diverge_is_rounding": gap <= bound})
    return out


# ---- main ----------------------------------------------------------------------------------------

def parse_size(text: str) -> tuple[int, int]:
    w, h = text.lower().split("x")
    return int(w), int(h)


def ms(value: float | None) -> str:
    return "none" if value is None else f"{value:.1f}"


def print_table(rows: list[tuple]) -> None:
    """Columns as wide as their widest cell: the first two left-aligned, the figures right-aligned."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def main(family: FamilyBench, doc: str) -> int:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--arch", default=family.default_arch, choices=sorted(family.random_dir.ARCHITECTURES))
    parser.add_argument("--model-dir", type=Path, default=None, help="default: /tmp/fovea-<arch>")
    parser.add_argument("--sections", default="offline,serve,vision,check",
                        help="comma list of offline, serve, vision, check (offline runs first, then serve)")
    parser.add_argument("--topologies", default="agg", help="comma list of agg, e_pd")
    parser.add_argument("--encode-workers", type=int, default=2)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--images", type=int, default=2, help="images per request in the burst")
    parser.add_argument("--burst-size", type=parse_size, default=(1280, 720))
    parser.add_argument("--runs", type=int, default=3, help="bursts per topology (the median is reported)")
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 16384, or the model's context where shorter (--arch tiny: 4096)")
    parser.add_argument("--server-args", default="", help="extra `fovea serve` flags")
    parser.add_argument("--loads", default="0.5,0.8,1.0",
                        help="serve: Poisson loads after the bursts, as shares of the median burst's request rate")
    parser.add_argument("--sustain-seconds", type=float, default=30.0, help="seconds of arrivals per Poisson load")
    parser.add_argument("--warm-start", action="store_true",
                        help="start each server a second time (compiled kernels and tuning cache on disk)")
    parser.add_argument("--vision-stage", choices=("chosen", "eager"), default="chosen")
    parser.add_argument("--vision-reps", type=int, default=10)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    args.loads = [float(x) for x in args.loads.split(",") if x]
    if args.max_model_len is None:
        args.max_model_len = min(16384, family.random_dir.ARCHITECTURES[args.arch].max_positions)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or Path(f"/tmp/fovea-{args.arch}")
    sections = set(args.sections.split(","))
    results: dict = {"family": family.name, "arch": args.arch, "args": {k: str(v) for k, v in vars(args).items()},
                     "gpu": torch.cuda.get_device_name(0) if CUDA else "cpu", "torch": torch.__version__}
    problems: list[str] = []
    nan = float("nan")
    c = results["ceilings"] = ceilings() if CUDA else {"copy_bandwidth_Bps": nan, "bf16_matmul_flops": nan}
    log(f"ceilings: copy {c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    device = "cuda" if CUDA else "cpu"
    if CUDA:
        torch.cuda.empty_cache()
    if not (model_dir / "config.json").is_file():
        t = time.time()
        family.random_dir.write_model_dir(model_dir, args.arch, device=device)
        log(f"wrote {model_dir} in {time.time() - t:.1f} s")
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    words = lambda seed: family.random_dir.prompt_words(args.arch, 64, seed=seed)
    table: list[tuple] = []
    # Written after every section too: a run that meets its time limit keeps what it measured.
    save = lambda: (args.out / f"{family.name}.json").write_text(json.dumps(results, indent=2, default=str))
    offline = None
    if "offline" in sections:  # before the server starts: it needs the GPU memory this section held
        try:
            offline = results["offline"] = offline_section(model_dir, args, words)
        except Exception as exc:  # noqa: BLE001 - reported as a problem, the other sections still run
            problems.append(f"offline: {type(exc).__name__}: {exc}")
            log(problems[-1])
        release_gpu()
        save()
        if offline is not None:
            b = offline["burst"]
            if b["failed_total"] or offline["single"]["failed"]:
                problems.append(f"offline: {b['failed_total'] + offline['single']['failed']} request(s) failed: "
                                f"{b['errors']}")
            table.append(("offline", f"{args.burst} req x {args.images} img tok/s",
                          f"{b['tok_s']:.0f} ({b['failed_total']} failed)", "", ""))
            table.append(("offline", "TTFT p50 / p99 ms", f"{b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f}", "", ""))
            table.append(("offline", "TPOT p50 / p99 ms", f"{b['tpot_p50_ms']:.1f} / {b['tpot_p99_ms']:.1f}", "", ""))
            table.append(("offline", "one request, one image: TTFT ms", ms(offline["single"]["ttft_ms_p50"]), "", ""))
    if "serve" in sections:
        results["serve"] = []
        for topology in args.topologies.split(","):
            r = serve_section(model_dir, args, args.out, topology, words)
            results["serve"].append(r)
            save()
            if "error" in r:
                problems.append(f"{topology}: {r['error'][:300]}")
                continue
            b = r["burst"]
            if b["failed_total"]:
                problems.append(f"{topology}: {b['failed_total']} request(s) failed: {b['errors']}")
            table.append((f"serve {topology}", "start-up to ready (canary on)", f"{r['ready_s']:.1f} s",
                          "", "goal 30 s"))
            if "warm_ready_s" in r:
                table.append((f"serve {topology}", "start-up again (warm caches)", f"{r['warm_ready_s']:.1f} s",
                              "", "goal 30 s"))
            share = f"offline {offline['burst']['tok_s']:.0f}: {b['tok_s'] / offline['burst']['tok_s']:.1%}" \
                if offline else ""
            table.append((f"serve {topology}", f"{args.burst} req x {args.images} img tok/s",
                          f"{b['tok_s']:.0f} ({b['failed_total']} failed)", share,
                          "goal >= 95% of offline" if offline else ""))
            table.append((f"serve {topology}", "TTFT p50 / p99 ms", f"{b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f}",
                          "", ""))
            table.append((f"serve {topology}", "TPOT p50 / p99 ms", f"{b['tpot_p50_ms']:.1f} / {b['tpot_p99_ms']:.1f}",
                          "", ""))
            single = r["single"]
            if single["failed"]:
                problems.append(f"{topology}: {single['failed']} of {single['of']} single requests failed")
            versus, goal = "", "goal 40 ms"
            if offline and offline["single"]["ttft_ms_p50"] is not None and single["ttft_ms_p50"] is not None:
                off = offline["single"]["ttft_ms_p50"]
                versus, goal = f"offline {off:.1f}: {single['ttft_ms_p50'] - off:+.1f} ms", "<= offline + 2 ms, 40 ms"
            table.append((f"serve {topology}", "one request, one image: TTFT ms", ms(single["ttft_ms_p50"]), versus,
                          goal))
            phases = single.get("phases_ms") or {}
            if phases.get("rest_ms") is not None and phases.get("queue_ms") is not None:
                table.append((f"serve {topology}", "  its mean: prepare + queue + prefill + rest ms",
                              f"{phases['prepare_ms']:.1f} + {phases['queue_ms']:.1f} + {phases['prefill_ms']:.1f} + "
                              f"{phases['rest_ms']:.1f}", f"client mean {phases['client_mean_ms']:.1f}", ""))
            for load_name, p in r["sustained"].items():
                if p["failed"]:
                    problems.append(f"{topology} Poisson {load_name}: {p['failed']} of {p['requests']} request(s) "
                                    f"failed: {p['errors']}")
                table.append((f"serve {topology}", f"Poisson {load_name}: {p['rate_req_s']:.2f} req/s",
                              f"TTFT {p['ttft_p50_ms']:.0f} / {p['ttft_p99_ms']:.0f} ms",
                              f"TPOT {p['tpot_p50_ms']:.1f} / {p['tpot_p99_ms']:.1f} ms",
                              f"{p['failed']} failed of {p['requests']}"))
            m = r["memory"]
            if m["peak_within_plan"] is False:
                problems.append(f"{topology}: torch's peak reserved memory {gib(m['torch_peak_reserved_bytes'])} "
                                f"passed the plan's cap {gib(m['torch_cap_bytes'])}")
            held = f"{gib(m['planned_bytes'])} / {gib(m['torch_peak_reserved_bytes'])}"
            table.append((f"serve {topology}", "memory: planned / torch peak", held,
                          f"cap {gib(m['torch_cap_bytes'])}", f"within plan: {m['peak_within_plan']}"))
    if sections & {"vision", "check"}:
        from fovea.loading.loader import load_model

        loaded = load_model(model_dir, device, "bfloat16" if CUDA else "float32")
        log(f"loaded in {loaded.load_seconds:.1f} s")
        if "vision" in sections:
            results["vision"], rows = vision_section(loaded, args, c)
            table += rows
            save()
        if "check" in sections:
            check = results["check"] = check_section(loaded, words)
            log(f"check: {check}")
            if not check["first_logprobs_rel_err"] < 1e-2:
                problems.append(f"first-token log-probs differ from transformers' by {check['first_logprobs_rel_err']:.2e}")
            if not check.get("diverge_is_rounding", True):
                problems.append(f"the greedy answers part at token {check['greedy_prefix_equal']} by a logit gap of "
                                f"{check['diverge_gap']:.3f}, beyond rounding ({check['rounding_bound']:.3f})")
            table.append(("check", "logprob rel err / greedy equal", f"{check['first_logprobs_rel_err']:.1e}",
                          f"{check['greedy_prefix_equal']}/{check['of']}", "< 1e-2"))
    results["problems"] = problems
    save()
    print(f"\n{family.name} ({args.arch}) on {results['gpu']}")
    print_table([("section", "metric", "fovea", "transformers / offline", "floor / goal"), *table])
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0

