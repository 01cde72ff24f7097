"""Quantized language models on one GPU, offline engine and `fovea serve`: decode ms/token at batch 1
and a burst, for bf16 / FP8 (per channel, dynamic per token) / FP8 blocks / W4A16 / AWQ.

Each shape's directory holds every file but the weights (``write_model_dir(weights=False)``) and
the format's ``quantization_config`` as released checkpoints write it; the weights are made on the
GPU (``--load-format dummy``), so the 72B shape needs no 145 GB of files.

- offline (``--mode offline``, the default): the engine in this process, text-only prompts (the
  language model's decode is what quantization changes): ms/token at batch 1 and TTFT, and a
  burst of ``--burst`` text requests. Floors, read against the copy bandwidth measured at the
  start of the run: one decode step reads every weight once, so ms/token >= weight bytes /
  bandwidth.
- serve (``--mode serve``, or ``--serve``): per shape and format, ``fovea serve --load-format
  dummy`` (the grounding canary on, as the server defaults; ``--max-model-len`` passed through)
  measured through HTTP: the seconds to a ready /health and the server's own "start-up: ready
  after" line; decode ms/token at batch 1 over ``--singles`` sequential streamed text requests of
  ``--tokens`` tokens with ``ignore_eos`` (end of stream minus first token, over the tokens after
  the first; median) and their TTFT; a burst of ``--burst`` streamed requests, each one
  ``--burst-size`` photo-like JPEG (1280x720) and 64 words, 128 tokens, from load-generator
  processes of their own (tokens/s, failed, TTFT and TPOT p50/p99); one request at a time with
  one such image (TTFT p50 of ``--image-singles``); and the memory plan from /health with torch's
  peak beside it. ``--mode both`` runs offline then serve for each.

Exit status 1 when a request failed, a server did not start or its peak passed its plan.

    python3 bench/gpu_quantized.py --out $OUT --shapes 7b --formats bf16,fp8,w4a16
    python3 bench/gpu_quantized.py --out $OUT --shapes 72b --formats fp8,w4a16 --burst 256
    python3 bench/gpu_quantized.py --out $OUT --serve --shapes 72b --formats fp8 --max-model-len 32768
    python3 bench/gpu_quantized.py --out /tmp/q --serve --shapes tiny --burst 8 --singles 2 --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import load_procs
import serve_load as load
from gpu_serve import Server, gib, memory_summary, release_gpu
from qwen_harness import WARM_SEED, burst_bodies, parse_size, print_table, single_ttft, startup_line

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
SHAPES = {"7b": "qwen2.5-vl-7b", "72b": "qwen2.5-vl-72b", "tiny": "tiny"}  # tiny: a CPU smoke run
DECODE_SEED = 50_000  # the text-only decode requests' seeds (the bursts' are qwen_harness's)


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


def quantization_config(fmt: str, shape: str) -> dict | None:
    """The format's ``quantization_config``; the tiny shape's with the tests' group and block sizes
    (its layers are 64-128 wide: the releases' 128 would leave one group or block per row)."""
    config = copy.deepcopy(FORMATS[fmt])
    if config is None or shape != "tiny":
        return config
    from fovea.testing.quantized import TINY_BLOCK, TINY_GROUP_SIZE

    for group in config.get("config_groups", {}).values():
        if group["weights"].get("group_size"):
            group["weights"]["group_size"] = TINY_GROUP_SIZE
    if "weight_block_size" in config:
        config["weight_block_size"] = list(TINY_BLOCK)
    if "group_size" in config:
        config["group_size"] = TINY_GROUP_SIZE
    return config


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
        config["quantization_config"] = quantization_config(fmt, shape)
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
    loaded = load_model(model_dir, args.device, "bfloat16" if args.device == "cuda" else "float32", load_format="dummy")
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
        if args.profile:
            profile_decode(lambda: asyncio.run(one(SamplingParams(max_tokens=args.profile, temperature=0,
                                                                   ignore_eos=True))), args.profile, tpot)
    finally:
        engine.stop()
    floor = step_bytes / bandwidth * 1000
    result = {"dir": str(model_dir), "label": loaded.quantization.label if loaded.quantization else "bf16",
              "load_s": load_s, "engine_s": engine_s, "step_bytes": step_bytes, "tpot_ms": tpot, "ttft_ms": ttft,
              "floor_ms": floor, "burst_tok_s": [b[0] for b in bursts], "burst_failed": sum(b[1] for b in bursts),
              "plan_gib": engine.runner.memory_plan.planned_bytes / 2**30,
              "kv_blocks": engine.block_manager.num_blocks}
    engine = loaded = None  # released before the next format loads (or its server starts)
    release_gpu()
    return result


def profile_decode(request: Callable[[], object], tokens: int, tpot_ms: float) -> None:
    """One request of ``tokens`` tokens under torch's profiler: its kernels a token (decode_profile)."""
    import decode_profile
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        request()
    torch.cuda.synchronize()
    decode_profile.print_table(decode_profile.kernel_table(prof, tokens), tpot_ms)


def words(shape: str) -> Callable[[int], str]:
    """64 one-token words of the shape's vocabulary, by seed."""
    from fovea.testing.random_qwen2_5_vl import prompt_words

    return lambda seed: prompt_words(SHAPES[shape], 64, seed=seed)


def serve_measure(model_dir: Path, shape: str, fmt: str, args) -> dict:
    """`fovea serve --load-format dummy` on ``model_dir``, through HTTP (the module's docstring
    lists what); an ``error`` entry where the server did not start or a step raised."""
    name = f"quant-{shape}"  # every format of a shape answers to one name: the same bodies serve them all
    extra = ["--load-format", "dummy", "--served-model-name", name, *args.server_args.split()]
    if args.max_model_len:
        extra += ["--max-model-len", str(args.max_model_len)]
    server = Server(model_dir, args.out, f"{shape}-{fmt}", *extra, device=args.device, canary=True)
    said = words(shape)
    r: dict = {"shape": shape, "format": fmt, "dir": str(model_dir), "max_model_len": args.max_model_len}
    try:
        r["ready_s"] = server.wait_ready(timeout=args.ready_timeout)
        r["startup_line"] = startup_line(server)
        log(f"{shape} {fmt}: ready after {r['ready_s']:.1f} s; {r['startup_line']}")
        texts = [load.chat_body(name, DECODE_SEED + i, said(DECODE_SEED + i), args.tokens, images=0)
                 for i in range(args.singles + 1)]
        decode = load.summarize(asyncio.run(load.sequential(server.url, texts))[1:], 1.0)  # the first warms
        r["decode"] = vars(decode)
        log(f"{shape} {fmt} decode, batch 1: {decode.tpot_p50_ms:.2f} ms/token, TTFT {decode.ttft_p50_ms:.1f} ms, "
            f"{decode.failed} of {decode.requests} failed {decode.errors}")
        if args.burst:
            load_procs.burst(server.url, burst_bodies(name, WARM_SEED, 4, args, said, max_tokens=8), processes=2)
            runs = []
            for run in range(args.runs):
                sent = load_procs.burst(server.url, burst_bodies(name, 100_000 * (run + 1), args.burst, args, said),
                                        processes=args.client_processes)
                runs.append({**vars(load.summarize(sent.results, sent.wall_s)), "client": sent.client})
                b = runs[-1]
                log(f"{shape} {fmt} burst {run + 1}: {b['tokens'] / b['wall_s']:.0f} tok/s, {b['failed']} failed, "
                    f"TTFT p50 {b['ttft_p50_ms']:.0f} p99 {b['ttft_p99_ms']:.0f} ms, TPOT p50 {b['tpot_p50_ms']:.1f} "
                    f"p99 {b['tpot_p99_ms']:.1f} ms {b['errors']}; {load_procs.describe(sent.client)}")
            r["bursts"] = runs
        r["image_single"] = single_ttft(server.url, name, args, said, count=args.image_singles)
        log(f"{shape} {fmt} one request, one {args.burst_size[0]}x{args.burst_size[1]} image: {r['image_single']}")
        r["memory"] = memory_summary(server)
    except Exception as exc:  # noqa: BLE001 - one server's failure is reported; the others still run
        r["error"] = f"{type(exc).__name__}: {exc}; log tail: {server.tail()}"
        log(f"{shape} {fmt}: {r['error']}")
    finally:
        server.stop()
    return r


def serve_problems(r: dict) -> list[str]:
    """What one server's run shows broken: no start, failed requests, a peak past its plan."""
    where = f"serve {r['shape']} {r['format']}"
    if "error" in r:
        return [f"{where}: {r['error'][:600]}"]
    found = []
    failed = r["decode"]["failed"] + sum(b["failed"] for b in r.get("bursts", [])) + r["image_single"]["failed"]
    if failed:
        errors = {e for part in [r["decode"], *r.get("bursts", [])] for e in part["errors"]}
        found.append(f"{where}: {failed} request(s) failed: {sorted(errors)[:5]}")
    if r["memory"]["peak_within_plan"] is False:
        found.append(f"{where}: torch's peak reserved {gib(r['memory']['torch_peak_reserved_bytes'])} passed the "
                     f"plan's cap {gib(r['memory']['torch_cap_bytes'])}")
    return found


def serve_table(served: list[dict], offline: dict[tuple[str, str], dict]) -> None:
    """One row per server; the floor (and offline's ms/token) where the offline engine ran too."""
    rows = [("shape", "format", "ready s", "ms/token b1", "offline", "floor", "TTFT ms", "burst tok/s",
             "burst TTFT p50/p99 ms", "TPOT p50/p99 ms", "1-image TTFT ms", "plan / peak GiB", "in plan")]
    for r in served:
        if "error" in r:
            rows.append((r["shape"], r["format"], "did not start" if "ready_s" not in r else "error",
                         *[""] * (len(rows[0]) - 3)))
            continue
        d, off = r["decode"], offline.get((r["shape"], r["format"]), {})
        bursts = sorted(r.get("bursts", []), key=lambda b: b["tokens"] / b["wall_s"])
        b = bursts[len(bursts) // 2] if bursts else None
        m = r["memory"]
        single = r["image_single"]["ttft_ms_p50"]
        rows.append((r["shape"], r["format"], f"{r['ready_s']:.1f}", f"{d['tpot_p50_ms']:.2f}",
                     f"{off['tpot_ms']:.2f}" if off else "-", f"{off['floor_ms']:.2f}" if off else "-",
                     f"{d['ttft_p50_ms']:.1f}",
                     f"{b['tokens'] / b['wall_s']:.0f} ({sum(x['failed'] for x in bursts)} failed)" if b else "-",
                     f"{b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f}" if b else "-",
                     f"{b['tpot_p50_ms']:.1f} / {b['tpot_p99_ms']:.1f}" if b else "-",
                     "none" if single is None else f"{single:.1f}",
                     f"{gib(m['planned_bytes']).removesuffix(' GiB')} / {gib(m['torch_peak_reserved_bytes'])}",
                     str(m["peak_within_plan"])))
    print_table(rows)
    for r in served:
        if r.get("startup_line"):
            print(f"{r['shape']} {r['format']} start-up: {r['startup_line']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--root", type=Path, default=Path("/tmp/fovea-quant"))
    parser.add_argument("--shapes", default="7b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--formats", default="bf16,fp8,w4a16", help=f"comma list of {', '.join(FORMATS)}")
    parser.add_argument("--mode", choices=("offline", "serve", "both"), default="offline")
    parser.add_argument("--serve", dest="mode", action="store_const", const="serve", help="--mode serve")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--tokens", type=int, default=128, help="tokens per single request")
    parser.add_argument("--singles", type=int, default=3, help="single text requests timed for ms/token")
    parser.add_argument("--burst", type=int, default=256, help="requests in a burst (0: none)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's (128000)")
    parser.add_argument("--no-gemv", action="store_true",
                        help="offline: no matrix-vector kernels among the quantized kernels' choices (the baseline)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                        help="offline: one more request of TOKENS tokens under torch's profiler, its kernels a token")
    parser.add_argument("--no-fp8-producers", action="store_true",
                        help="offline: FP8 inputs quantised by the quantiser's own launches (the baseline of "
                             "their producers quantising them)")
    serve = parser.add_argument_group("serve")
    serve.add_argument("--images", type=int, default=1, help="images per burst request")
    serve.add_argument("--burst-size", type=parse_size, default=(1280, 720), help="their size, WxH")
    serve.add_argument("--image-singles", type=int, default=7, help="one-image requests timed one at a time")
    serve.add_argument("--client-processes", type=int, default=4)
    serve.add_argument("--ready-timeout", type=float, default=900)
    serve.add_argument("--server-args", default="", help="extra `fovea serve` flags")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for flag, given, known in (("--shapes", args.shapes, SHAPES), ("--formats", args.formats, FORMATS)):
        if unknown := set(given.split(",")) - set(known):
            parser.error(f"{flag}: {', '.join(sorted(unknown))} not among {', '.join(known)}")
    if args.no_gemv:
        if args.mode != "offline":
            parser.error("--no-gemv changes this process's kernels: offline only")
        from fovea.engine.kernels import quant_gemv

        quant_gemv.GEMV_MAX_ROWS = 0  # candidates_for reads it on each choice
    if args.no_fp8_producers:
        if args.mode != "offline":
            parser.error("--no-fp8-producers changes this process's forward: offline only")
        from fovea.engine.model import llama

        llama.fp8_input_group = lambda weight, device: None  # PagedLlama reads it as it is built
    bandwidth = math.nan
    if args.device == "cuda":
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()  # its 4 GiB back: a server started next plans with what is free
        log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results, served, problems = [], [], []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            model_dir = shape_dir(args.root, shape, fmt)
            if args.mode in ("offline", "both"):
                try:
                    r = measure(model_dir, args, bandwidth)
                except Exception as exc:  # noqa: BLE001 - one format's failure is reported; the others still run
                    problems.append(f"{shape} {fmt}: {type(exc).__name__}: {exc}")
                    log(problems[-1])
                    release_gpu()
                else:
                    r.update(shape=shape, format=fmt)
                    results.append(r)
                    log(json.dumps(r))
                    (args.out / "quantized.json").write_text(json.dumps(results, indent=2))
                    if r["burst_failed"]:
                        problems.append(f"{shape} {fmt}: {r['burst_failed']} burst request(s) failed")
            if args.mode in ("serve", "both"):
                served.append(serve_measure(model_dir, shape, fmt, args))
                problems += serve_problems(served[-1])
                (args.out / "quantized_serve.json").write_text(json.dumps(served, indent=2, default=str))
    if results:
        print(f"\n{'shape':<6}{'format':<11}{'ms/token b1':>12}{'floor':>8}{'of floor':>9}{'TTFT ms':>9}"
              f"{'burst tok/s':>13}{'load s':>8}{'engine s':>9}{'KV blocks':>10}")
        for r in results:
            burst = "/".join(f"{t:.0f}" for t in r["burst_tok_s"]) or "-"
            print(f"{r['shape']:<6}{r['format']:<11}{r['tpot_ms']:>12.2f}{r['floor_ms']:>8.2f}"
                  f"{r['floor_ms'] / r['tpot_ms']:>9.0%}{r['ttft_ms']:>9.1f}{burst:>13}{r['load_s']:>8.1f}"
                  f"{r['engine_s']:>9.1f}{r['kv_blocks']:>10}")
    if served:
        print(f"\nthrough `fovea serve --load-format dummy` on {args.device}; bursts of {args.burst} x "
              f"{args.images} image(s) {args.burst_size[0]}x{args.burst_size[1]}, {args.tokens}-token singles")
        serve_table(served, {(r["shape"], r["format"]): r for r in results})
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
