"""E/PD on one GPU: `fovea serve --topology e_pd` against `agg`, the encode worker's memory, the hand-off.

    python3 bench/gpu_e_pd.py --out $OUT [--burst 256 --runs 3 --singles 5 --vision-batch 32]

On a random-weight LLaVA-1.5-7B directory (fovea.testing.random_llava), in one run:
- handoff: an encoder pool in this process with one encode worker on the GPU; batches of 1, 8
  and 32 distinct 336 px images, each timed several times. The hand-off per image is the round
  trip less the worker's vision forward: pixels out through shared memory, embeddings sealed
  (checksum on the GPU), back, landed on this process's GPU and verified. The floor beside it
  is the same bytes copied host-to-device and device-to-host through pinned memory.
- refuse: another process holds all but 1 GiB of the GPU (about half of it goes to the worker's CUDA context); an encode worker must refuse at once
  with its need against what is free.
- agg: `fovea serve` (everything in one process): single streamed requests (TTFT) and bursts of
  --burst concurrent requests (distinct 336 px JPEGs, 64 text tokens, 128 output tokens).
- e_pd: `fovea serve --topology e_pd --encode-workers 1`, the same requests. Its encode worker
  is killed once the prefill/decode worker holds most of the GPU, so the one that serves was
  started (and planned) on a GPU another process mostly fills. Its peak memory is read from
  torch (its own report) and from nvidia-smi (the process, CUDA context included).
- pd_workers: `fovea serve --topology e_pd --encode-workers 1 --pd-workers 2`, the front and two
  PD workers on the one GPU (each with --pd-kv-memory of KV cache, so both fit), the same
  requests; its /health must list both PD workers ready and both must have served requests.
Every request is checked (finish_reason "length", 128 tokens, [DONE]). Exit status 1 when a
request failed, the refusal was not clean, or a phase could not run; goals missed (throughput
within 10% of agg, hand-off under 1 ms per image, the worker's peak at most 1.2 GB) are
figures in the table, not failures. Everything is also in $OUT/gpu_e_pd.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import serve_load as load
from gpu_serve import Server, bodies, gib, process_gpu_bytes

from fovea.testing.random_llava import write_model_dir


def log(msg: str) -> None:
    print(f"[e_pd-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def handoff(model_dir: Path, args, results: dict) -> None:
    from PIL import Image

    from fovea.disagg.encoder_pool import EncoderPool
    from fovea.loading.contract import check_contract
    from fovea.loading.loader import load_model
    from fovea.loading.prompt import encode_prompt, render_chat

    loaded = load_model(str(model_dir), args.device, "auto")  # the PD side: its processor, contract, device
    contract = check_contract(loaded)
    pool = EncoderPool(loaded.path, workers=1, device=str(loaded.device), dtype=contract.dtype,
                       model_id=contract.model_fingerprint, recipe_fingerprint=contract.recipe_fingerprint,
                       hidden=contract.lm_hidden, batch_images=args.vision_batch, pd_device=str(loaded.device))
    observed: list[float] = []
    pool.on_handoff = lambda per_image, n: observed.append(per_image)
    pool.start()
    log(f"encode worker: {pool.status()[0]['plan']}")
    r: dict = {"plan": pool.status()[0]["plan"], "batches": {}}
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    try:
        for size in (1, 8, args.vision_batch):
            images = []
            for seed in range(size):
                jpeg = load.photo_jpeg(90_000 + 100 * size + seed)
                image = Image.open(__import__("io").BytesIO(jpeg)).convert("RGB")
                images.extend(encode_prompt(loaded, render_chat(loaded, messages), [image]).images)
            pool.encode(images)  # warm: segments sized and pinned, kernels chosen
            observed.clear()
            before = pool.handoff_totals.copy()
            walls = []
            for _ in range(args.handoff_reps):
                started = time.perf_counter()
                rows = pool.encode(images)
                walls.append(time.perf_counter() - started)
            assert len(rows) == size and rows[0].device.type == loaded.device.type
            per_image = statistics.median(observed)
            after = pool.handoff_totals.copy()
            n = after["images"] - before["images"]
            parts = {k: 1e3 * (after[k] - before.get(k, 0.0)) / n for k in after if k not in ("batches", "images", "seconds")}
            worker_ms = sum(v for k, v in parts.items() if k.startswith("worker"))
            r["batches"][size] = {"handoff_ms_per_image": 1e3 * per_image, "round_trip_ms": 1e3 * statistics.median(walls),
                                  "worker_side_ms_per_image": worker_ms, "parts_ms_per_image": parts,
                                  "reps": args.handoff_reps, "embedding_bytes": rows[0].numel() * rows[0].element_size()}
            log(f"hand-off, batch {size}: {1e3 * per_image:.3f} ms per image (round trip "
                f"{1e3 * statistics.median(walls):.1f} ms); parts per image: "
                + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        status = pool.status()[0]
        r["worker_peak_reserved_bytes"] = status["peak_reserved_bytes"]
        r["worker_process_gpu_bytes"] = process_gpu_bytes(status["pid"]) if status["pid"] else None
    finally:
        pool.stop()
    if loaded.device.type == "cuda":
        r["floor_ms_per_image"] = 1e3 * pinned_round_trip(r["batches"][1]["embedding_bytes"],
                                                          3 * 336 * 336 * 2)
        log(f"floor (pinned copies of the same bytes): {r['floor_ms_per_image']:.3f} ms per image")
    results["handoff"] = r
    del loaded
    torch.cuda.empty_cache()


def pinned_round_trip(rows_bytes: int, pixel_bytes: int) -> float:
    """Seconds to move one image's pixels host-to-device and its rows device-to-host-to-device,
    through pinned buffers: what a hand-off cannot beat without peer access."""
    host_rows = torch.empty(rows_bytes, dtype=torch.uint8, pin_memory=True)
    host_pixels = torch.empty(pixel_bytes, dtype=torch.uint8, pin_memory=True)
    dev_rows = torch.empty(rows_bytes, dtype=torch.uint8, device="cuda")
    dev_pixels = torch.empty(pixel_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dev_pixels.copy_(host_pixels, non_blocking=True)
        host_rows.copy_(dev_rows, non_blocking=True)
        dev_rows.copy_(host_rows, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[5:])


def refuse(model_dir: Path, args, results: dict) -> None:
    """An encode worker on a GPU with 1 GiB free (half of it its own CUDA context) must refuse with need against free."""
    from fovea.disagg.encoder_pool import EncoderPool
    from fovea.errors import FoveaError

    free, _ = torch.cuda.mem_get_info()
    held = torch.empty(max(0, free - 2**30), dtype=torch.uint8, device="cuda")  # its CUDA context takes ~0.5 of it
    started = time.perf_counter()
    try:
        EncoderPool(str(model_dir), workers=1, device="cuda", dtype="bfloat16", model_id="-", recipe_fingerprint="-",
                    hidden=4096, start_timeout_s=300, pd_device="cuda").start().stop()
        message, refused = "the encode worker started", False
    except FoveaError as exc:
        message = str(exc)
        refused = "does not fit" in message and "needs" in message and "free" in message
    finally:
        del held
        torch.cuda.empty_cache()
    results["refuse"] = {"refused_cleanly": refused, "seconds": time.perf_counter() - started, "message": message[:600]}
    log(f"refuse: {'refused cleanly' if refused else 'NOT refused cleanly'} in "
        f"{results['refuse']['seconds']:.1f} s: {message[:300]}")


def measure_server(server: Server, args) -> dict:
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    singles = load.summarize(asyncio.run(load.sequential(server.url, bodies(name, 30_000, args.singles + 1)))[1:], 1.0)
    runs = []
    for run in range(args.runs):
        res, wall = asyncio.run(load.burst(server.url, bodies(name, 40_000 + 1000 * run, args.burst)))
        runs.append(load.summarize(res, wall))
        log(f"  burst {run + 1}: {runs[-1].tok_s:.0f} tok/s in {wall:.1f} s, TTFT p50 {runs[-1].ttft_p50_ms:.0f} "
            f"p99 {runs[-1].ttft_p99_ms:.0f} ms, failed {runs[-1].failed} {runs[-1].errors[:2]}")
    best = sorted(runs, key=lambda b: b.tok_s)[len(runs) // 2]
    return {"startup_s": server.ready_s, "single": vars(singles), "burst": [vars(b) for b in runs],
            "median_burst": vars(best), "failed": singles.failed + sum(b.failed for b in runs)}


def health(server: Server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


def serve_agg(model_dir: Path, args, results: dict) -> None:
    server = Server(model_dir, args.out, "agg", "--vision-batch-size", str(args.vision_batch), device=args.device)
    try:
        log(f"agg ready in {server.wait_ready():.1f} s")
        results["agg"] = measure_server(server, args)
    finally:
        server.stop()


def serve_e_pd(model_dir: Path, args, results: dict) -> None:
    server = Server(model_dir, args.out, "e_pd", "--topology", "e_pd", "--encode-workers", "1",
                    "--vision-batch-size", str(args.vision_batch), device=args.device)
    try:
        log(f"e_pd ready in {server.wait_ready():.1f} s")
        first = health(server)["encode_workers"][0]
        # The PD worker now holds most of the GPU: the encode worker that serves starts beside it.
        os.kill(first["pid"], signal.SIGKILL)
        deadline, worker = time.monotonic() + 300, first
        while time.monotonic() < deadline:
            worker = health(server)["encode_workers"][0]
            if worker["restarts"] >= 1 and worker["state"] == "ready":
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the killed encode worker did not come back: {worker}")
        log(f"encode worker restarted beside the PD worker: {worker['plan']}")
        r = measure_server(server, args)
        after = health(server)["encode_workers"][0]
        sums = {line.split()[0]: float(line.split()[1]) for line in httpx.get(server.url + "/metrics").text.splitlines()
                if line.startswith("fovea_embedding_handoff_seconds_")}
        count = sums.get("fovea_embedding_handoff_seconds_count", 0.0)
        r["encode_worker"] = {"restarted_beside_pd": worker, "after": after,
                              "process_gpu_bytes": process_gpu_bytes(after["pid"]),
                              "pd_process_gpu_bytes": process_gpu_bytes(server.proc.pid)}
        r["handoff_mean_ms_per_image"] = 1e3 * sums.get("fovea_embedding_handoff_seconds_sum", 0.0) / max(count, 1)
        r["handoff_images"] = count
        r["handoff_summary"] = health(server).get("handoff")
        log(f"hand-off while serving: {r['handoff_summary']}")
        results["e_pd"] = r
    finally:
        server.stop()


def serve_pd_workers(model_dir: Path, args, results: dict) -> None:
    server = Server(model_dir, args.out, "pd_workers", "--topology", "e_pd", "--encode-workers", "1",
                    "--pd-workers", "2", "--kv-cache-memory", args.pd_kv_memory,
                    "--vision-batch-size", str(args.vision_batch), device=args.device)
    try:
        log(f"pd_workers ready in {server.wait_ready():.1f} s")
        r = measure_server(server, args)
        workers = health(server).get("pd_workers", [])
        served: dict[str, float] = {}  # PD worker -> requests the front routed to it
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line.startswith("fovea_front_routed_total{"):
                worker = line.split('pd_worker="')[1].split('"')[0]
                served[worker] = served.get(worker, 0.0) + float(line.split()[-1])
        r["pd_workers"] = workers
        r["requests_by_worker"] = served
        log(f"pd_workers: {[(w.get('index'), w.get('state')) for w in workers]}, requests {served}")
        results["pd_workers"] = r
    finally:
        server.stop()


def table(results: dict) -> str:
    rows = ["", "| what | agg | e_pd | goal |", "|---|---|---|---|"]
    agg, epd = results.get("agg"), results.get("e_pd")
    if agg and epd:
        a, e = agg["median_burst"], epd["median_burst"]
        a_tok, e_tok = a["tokens"] / a["wall_s"], e["tokens"] / e["wall_s"]
        rows.append(f"| burst {a['requests']} requests, median of {len(agg['burst'])} | {a_tok:.0f} tok/s | "
                    f"{e_tok:.0f} tok/s ({e_tok / a_tok:.0%} of agg) | within 10% of agg |")
        rows.append(f"| burst TTFT p50 / p99 | {a['ttft_p50_ms']:.0f} / {a['ttft_p99_ms']:.0f} ms | "
                    f"{e['ttft_p50_ms']:.0f} / {e['ttft_p99_ms']:.0f} ms | - |")
        rows.append(f"| single TTFT p50 | {agg['single']['ttft_p50_ms']:.1f} ms | {epd['single']['ttft_p50_ms']:.1f} ms | - |")
        rows.append(f"| failed requests | {agg['failed']} | {epd['failed']} | 0 |")
        w = epd["encode_worker"]
        rows.append(f"| encode worker peak (torch reserved / process incl. CUDA context) | - | "
                    f"{gib(w['after']['peak_reserved_bytes'])} / {gib(w['process_gpu_bytes'])} | at most 1.2 GB |")
        parts = (epd.get("handoff_summary") or {}).get("parts_ms_per_image", {})
        rows.append(f"| hand-off in serving (mean per image, {epd['handoff_images']:.0f} images) | - | "
                    f"{epd['handoff_mean_ms_per_image']:.3f} ms ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + ") | under 1 ms |")
    pdw = results.get("pd_workers")
    if pdw and agg:
        b = pdw["median_burst"]
        a_tok = agg["median_burst"]["tokens"] / agg["median_burst"]["wall_s"]
        rows.append(f"| --pd-workers 2 (one GPU): burst tok/s, TTFT p50/p99, failed | {a_tok:.0f} tok/s | "
                    f"{b['tokens'] / b['wall_s']:.0f} tok/s, {b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f} ms, "
                    f"{pdw['failed']} failed | 0 failed |")
    h = results.get("handoff")
    if h:
        for size, b in h["batches"].items():
            rows.append(f"| hand-off, batch {size} (median of {b['reps']}) | - | {b['handoff_ms_per_image']:.3f} ms "
                        f"per image (worker {b['worker_side_ms_per_image']:.3f}) | under 1 ms (floor "
                        f"{h.get('floor_ms_per_image', float('nan')):.3f} ms) |")
    if "refuse" in results:
        rows.append(f"| encode worker on a full GPU | - | {'refused cleanly' if results['refuse']['refused_cleanly'] else 'NOT refused'}"
                    f" in {results['refuse']['seconds']:.1f} s | refuse with need vs free |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/fovea-e-pd-bench")))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/fovea-llava-1.5-7b"))
    parser.add_argument("--arch", default="llava-1.5-7b", help="fovea.testing.random_llava architecture (tiny: CPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--phases", default="handoff,refuse,agg,e_pd")
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--singles", type=int, default=5)
    parser.add_argument("--vision-batch", type=int, default=32)
    parser.add_argument("--handoff-reps", type=int, default=7)
    parser.add_argument("--pd-kv-memory", default="24GiB", help="pd_workers: each PD worker's KV cache")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if cuda else None}
    if not (args.model_dir / "model.safetensors.index.json").is_file():
        started = time.perf_counter()
        write_model_dir(args.model_dir, args.arch, "cuda" if cuda else "cpu")
        log(f"wrote {args.arch} to {args.model_dir} in {time.perf_counter() - started:.1f} s")
    problems = []
    for phase, run in (("handoff", handoff), ("refuse", refuse), ("agg", serve_agg), ("e_pd", serve_e_pd),
                       ("pd_workers", serve_pd_workers)):
        if phase not in phases or (phase == "refuse" and not cuda):
            continue
        try:
            run(args.model_dir, args, results)
        except Exception as exc:  # noqa: BLE001 - a phase that cannot run is a problem, the others still run
            problems.append(f"{phase} could not run: {type(exc).__name__}: {exc}")
            log(problems[-1])
        (args.out / "gpu_e_pd.json").write_text(json.dumps(results, indent=2, default=str))
    if "pd_workers" in results:
        workers = results["pd_workers"]["pd_workers"]
        if len(workers) != 2 or any(w.get("state") != "ready" for w in workers):
            problems.append(f"pd_workers: not both PD workers ready: {workers}")
        if sorted(k for k, v in results["pd_workers"]["requests_by_worker"].items() if v > 0) != ["0", "1"]:
            problems.append(f"pd_workers: not both PD workers served: {results['pd_workers']['requests_by_worker']}")
    for name in ("agg", "e_pd", "pd_workers"):
        if name in results and results[name]["failed"]:
            problems.append(f"{name}: {results[name]['failed']} requests failed")
    if "refuse" in results and not results["refuse"]["refused_cleanly"]:
        problems.append("the encode worker on a full GPU was not refused cleanly")
    print(table(results))
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
