"""The headline benchmark: `fovea serve` on a LLaVA-1.5-7B-shaped directory, through HTTP, under load.

    python3 bench/gpu_serve.py --out $OUT [--phases offline,serve,neighbour] [--sustain-seconds 60]

It writes a random-weight llava-1.5-7b directory to disk (fovea.testing.random_llava: a real
CLIP processor, a 32,064-token tokenizer, safetensors shards) and, in one run:
- offline: the same model and requests through the engine in this process (no HTTP): single
  request TTFT and TPOT, and the burst's output tokens/s (the ceiling HTTP is read against);
- serve: starts `fovea serve` on the directory (start-up time to a ready /health), then
  single streamed requests (TTFT, TPOT), the burst (256 concurrent requests, each a distinct
  photo-like 336 px JPEG and 64 text tokens, 128 output tokens with ignore_eos), and Poisson
  arrivals at 50%, 80% and 100% of the burst's measured request rate for --sustain-seconds
  each (TTFT and TPOT p50/p99); then the server's memory: its plan, torch's peak reserved
  bytes against the plan's cap, and the device memory of the process. The bursts and the
  Poisson loads are sent by --client-processes processes of their own (bench/load_procs.py),
  and the table says how busy they were, so that the client is seen not to set the pace;
- neighbour: while that server runs, a second `fovea serve` (the demo model) starts on the
  same GPU and answers;
- hog: another process holds most of the GPU; `fovea serve` on the 7B directory must refuse
  at once with need against free, not die while loading;
- pair: two `fovea serve` on the 7B directory at --gpu-memory-utilization 0.45 each, both
  answering a burst at the same time.
Every request is checked (finish_reason "length", 128 tokens, [DONE]); failures are counted
beside every figure, and the exit status is 1 when a request failed, torch's peak passed the
plan, a refusal was not clean or the neighbour answered wrong (goals missed are figures, not
failures). Ceilings (copy bandwidth, bf16 matrix rate) are measured at the start
and the burst is read against the roofline of its FLOPs and bytes. The last lines are a table;
everything is also in $OUT/gpu_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import load_procs
import serve_load as load

from fovea.testing.random_llava import prompt_words, write_model_dir

TEXT_TOKENS, MAX_TOKENS = 64, 128


def log(msg: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One `fovea serve` subprocess, its log under --out, stopped on exit."""

    def metric(self, name: str) -> float:
        """A sample of /metrics (0 when absent)."""
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def engine_ttft(self) -> tuple[float, float]:
        """(sum, count) of the engine's own TTFT histogram: from the engine receiving a request, after
        HTTP and preprocessing, to its first token."""
        return (self.metric("fovea_time_to_first_token_seconds_sum"),
                self.metric("fovea_time_to_first_token_seconds_count"))

    def __init__(self, model: Path | None, out: Path, name: str, *extra: str, device: str = "auto",
                 canary: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = out / f"server-{name}.log"
        cmd = [sys.executable, "-m", "fovea.cli", "serve", "--port", str(self.port), "--device", device,
               *([] if canary else ["--no-canary"]), *extra]
        if model is not None:
            cmd += ["--model", str(model)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
               "PYTHONUNBUFFERED": "1"}
        self.started = time.perf_counter()
        self.handle = open(self.log_path, "w")  # noqa: SIM115 - the server writes it until stop() closes it
        self.proc = subprocess.Popen(cmd, stdout=self.handle, stderr=subprocess.STDOUT, env=env)
        self.ready_s = math.nan

    def wait_ready(self, timeout: float = 600) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - self.started
                    return self.ready_s
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s: {self.tail()}")

    def tail(self, lines: int = 12) -> str:
        self.handle.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.handle.close()


def bodies(model_name: str, first_seed: int, n: int) -> list[dict]:
    return [load.chat_body(model_name, seed, prompt_words(TEXT_TOKENS, seed), MAX_TOKENS)
            for seed in range(first_seed, first_seed + n)]


def process_gpu_bytes(pid: int) -> int | None:
    """The device memory nvidia-smi shows for ``pid`` (None where it cannot tell)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1]) * 2**20
    return None


# ---- phases -----------------------------------------------------------------------------------

async def engine_request(engine, prompt, params) -> load.Result:
    """One request through an engine in this process, timed as the HTTP client times it: from
    submitting to the first token, and to the finish; ok when it ran to ``params.max_tokens``."""
    from fovea.engine.core.request import FinishEvent, TokenEvent

    start, first = time.perf_counter(), None
    async for event in engine.generate(prompt, params):
        if isinstance(event, TokenEvent) and first is None:
            first = time.perf_counter()
        elif isinstance(event, FinishEvent):
            n = event.completion_tokens
            if first is None:
                return load.Result(False, error="finished without a token")
            return load.Result(n == params.max_tokens, first - start, time.perf_counter() - start, n)
    return load.Result(False, error="no finish")


def engine_burst(engine, prompts: list, params) -> tuple[list[load.Result], float]:
    """``prompts`` submitted to a started engine at once: their results and the seconds to the last."""
    async def many() -> tuple[list[load.Result], float]:
        started = time.perf_counter()
        out = await asyncio.gather(*(engine_request(engine, p, params) for p in prompts))
        return list(out), time.perf_counter() - started

    return asyncio.run(many())


def body_prompt(loaded, body: dict):
    """The prompt the server makes of a chat ``body`` (one user message of data-URL images and
    text): its images decoded as the server decodes them, the chat template, the processor. Made
    before any clock starts, so an offline figure leaves out what HTTP requests spend on it."""
    from fovea.loading.prompt import encode_prompt, render_chat
    from fovea.media import MediaConfig, decode_image_bytes

    parts = body["messages"][0]["content"]
    reduce_to = loaded.codec.target_short_side()
    images = [decode_image_bytes(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]), MediaConfig(), reduce_to)
              for p in parts if p["type"] == "image_url"]
    content = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
    return encode_prompt(loaded, render_chat(loaded, [{"role": "user", "content": content}]), images)


def offline(model_dir: Path, args, results: dict) -> None:
    """The engine alone, in this process, on the same requests (images through the same processor)."""
    from fovea.engine import PagedEngine, PagedEngineConfig
    from fovea.engine.sampling.params import SamplingParams
    from fovea.loading.loader import load_model

    loaded = load_model(model_dir, args.device, "auto")
    engine = PagedEngine(loaded, PagedEngineConfig())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def prompts(first_seed: int, n: int) -> list:
        return [body_prompt(loaded, body) for body in bodies("offline", first_seed, n)]

    engine.start()
    try:
        singles = [engine_burst(engine, prompts(10_000 + i, 1), params)[0][0] for i in range(args.singles + 1)][1:]
        single = load.summarize(singles, 1.0)
        runs = []
        for run in range(args.runs):
            results_, wall = engine_burst(engine, prompts(20_000 + 1000 * run, args.burst), params)
            runs.append(load.summarize(results_, wall))
            log(f"offline burst {run + 1}: {runs[-1].tok_s:.0f} tok/s, failed {runs[-1].failed}")
        plan = engine.runner.memory_plan
        results["offline"] = {"ttft_ms": single.ttft_p50_ms, "tpot_ms": single.tpot_p50_ms,
                              "burst_tok_s": [r.tok_s for r in runs], "failed": sum(r.failed for r in runs),
                              "plan_bytes": plan.planned_bytes}
        log(f"offline: single TTFT {single.ttft_p50_ms:.1f} ms TPOT {single.tpot_p50_ms:.2f} ms; "
            f"burst {[round(r.tok_s) for r in runs]} tok/s")
        results["roofline_tok_s"] = roofline(loaded, args, len(prompts(1, 1)[0].input_ids))
    finally:
        engine.stop()


def release_gpu() -> None:
    """Give back what the offline phase held (its engine capped this process's allocator too)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
        free, total = torch.cuda.mem_get_info()
        log(f"after the offline phase: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


def roofline(loaded, args, prompt_tokens: int) -> float:
    """Output tokens/s of the burst if every FLOP ran at the matrix rate and every byte at copy bandwidth."""
    ceilings = args.ceilings
    if not ceilings:
        return math.nan
    from gpu_llava7b import lm_params, prefill_flops, vision_flops_per_image

    n, cfg = args.burst, loaded.model.config.text_config
    lm = lm_params(loaded)
    prefill = n * (prefill_flops(loaded, prompt_tokens) + vision_flops_per_image(loaded))
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.hidden_size * 2
    decode_bytes = MAX_TOKENS * 2 * lm + n * MAX_TOKENS * (prompt_tokens + MAX_TOKENS // 2) * kv_per_token
    decode_flops = n * MAX_TOKENS * 2 * lm
    bound = prefill / ceilings["bf16_matmul_flops"] + max(decode_flops / ceilings["bf16_matmul_flops"],
                                                          decode_bytes / ceilings["copy_bandwidth_Bps"])
    return n * MAX_TOKENS / bound


def serve(model_dir: Path, args, results: dict, out: Path) -> Server:
    server = Server(model_dir, out, "7b", *args.server_args.split(), device=args.device)
    ready = server.wait_ready()
    log(f"fovea serve ready in {ready:.1f} s")
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    r: dict = {"startup_s": ready}
    results["serve"] = r
    singles = asyncio.run(load.sequential(server.url, bodies(name, 30_000, args.singles + 1)))[1:]
    single = load.summarize(singles, 1.0)
    r["single"] = vars(single)
    log(f"HTTP single: TTFT {single.ttft_p50_ms:.1f} ms, TPOT {single.tpot_p50_ms:.2f} ms, failed {single.failed}")
    runs, clients = [], []
    for run in range(args.runs):
        batch = bodies(name, 40_000 + 1000 * run, args.burst)
        before = server.engine_ttft()
        sent = load_procs.burst(server.url, batch, processes=args.client_processes)
        after = server.engine_ttft()
        runs.append(load.summarize(sent.results, sent.wall_s))
        clients.append(sent.client)
        engine_ttft = 1e3 * (after[0] - before[0]) / max(1.0, after[1] - before[1])
        log(f"HTTP burst {run + 1}: {runs[-1].tok_s:.0f} tok/s in {sent.wall_s:.1f} s, TTFT p50 "
            f"{runs[-1].ttft_p50_ms:.0f} ms (engine's own mean {engine_ttft:.0f} ms), TPOT p50 "
            f"{runs[-1].tpot_p50_ms:.1f} ms, failed {runs[-1].failed} {runs[-1].errors}; "
            f"{load_procs.describe(sent.client)}")
    r["burst"] = [{**vars(b), "client": c} for b, c in zip(runs, clients, strict=True)]
    best = sorted(runs, key=lambda b: b.tok_s)[len(runs) // 2]
    capacity = best.requests / best.wall_s  # requests/s the burst sustained
    r["capacity_req_s"] = capacity
    r["sustained"] = sustained(server.url, lambda first, n: bodies(name, first, n), capacity, args)
    r["memory"] = memory_summary(server)
    return server


def sustained(url: str, make_bodies: Callable[[int, int], list[dict]], capacity_req_s: float, args,
              seed_base: int = 100_000) -> dict[str, dict]:
    """Open-loop Poisson arrivals at each share of ``capacity_req_s`` in ``args.loads``, for
    ``args.sustain_seconds`` each, from ``args.client_processes`` processes: per load (keyed "50%")
    the summary, the rate and the client's CPU. ``make_bodies(first_seed, n)`` makes n distinct
    requests; exactly as many as arrive are made."""
    out: dict[str, dict] = {}
    for share in args.loads:
        rate, seed = share * capacity_req_s, int(share * 100)
        n = len(load_procs.arrivals(rate, args.sustain_seconds, seed))
        sent = load_procs.poisson(url, make_bodies(seed_base + int(share * 1e4) * 10, n), rate, args.sustain_seconds,
                                  processes=args.client_processes, seed=seed)
        s = load.summarize(sent.results, sent.wall_s)
        out[f"{share:.0%}"] = {**vars(s), "rate_req_s": rate, "client": sent.client}
        log(f"Poisson {share:.0%} ({rate:.2f} req/s, {s.requests} requests): TTFT p50 {s.ttft_p50_ms:.0f} p99 "
            f"{s.ttft_p99_ms:.0f} ms, TPOT p50 {s.tpot_p50_ms:.1f} p99 {s.tpot_p99_ms:.1f} ms, failed {s.failed} "
            f"{s.errors}; {load_procs.describe(sent.client)}")
    return out


def memory_summary(server: Server) -> dict:
    """The server's memory plan (/health) beside what it has held: torch's peak reserved bytes
    against the plan's cap (``peak_within_plan`` None where there is no cap: on the CPU)."""
    memory = httpx.get(server.url + "/health", timeout=30).json().get("memory") or {}
    now = memory.get("now") or {}
    peak, cap = now.get("torch_peak_reserved_bytes"), memory.get("torch_cap_bytes")
    out = {"planned_bytes": memory.get("planned_bytes"), "torch_cap_bytes": cap, "torch_peak_reserved_bytes": peak,
           "process_gpu_bytes": process_gpu_bytes(server.proc.pid), "oom_recoveries": memory.get("oom_recoveries"),
           "kv_cache": memory.get("kv_cache"), "lines": memory.get("lines"),
           "peak_within_plan": (peak is not None and peak <= cap) if cap else None}
    log(f"memory: planned {gib(out['planned_bytes'])}, torch cap {gib(cap)}, torch peak reserved {gib(peak)}, "
        f"process on the GPU {gib(out['process_gpu_bytes'])}, out-of-memory recoveries {out['oom_recoveries']}")
    return out


def neighbour(args, results: dict, out: Path) -> None:
    """A second server (the demo model) on the GPU the 7B server is using."""
    from fovea.demo import scenes

    second = Server(None, out, "demo-neighbour", device=args.device)
    try:
        ready = second.wait_ready(300)
        import random

        scene = scenes.SceneSampler().sample(random.Random(77))
        buffer = __import__("io").BytesIO()
        scenes.render(scene).save(buffer, format="PNG")
        url = "data:image/png;base64," + __import__("base64").b64encode(buffer.getvalue()).decode()
        reply = httpx.post(second.url + "/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]}]})
        answer = reply.json()["choices"][0]["message"]["content"] if reply.status_code == 200 else reply.text[:200]
        ok = answer == scenes.describe_answer(scene)
        memory = httpx.get(second.url + "/health").json().get("memory") or {}
        results["neighbour"] = {"ready_s": ready, "answer_ok": ok, "planned_bytes": memory.get("planned_bytes")}
        log(f"neighbour demo server ready in {ready:.1f} s, answer {'right' if ok else 'WRONG: ' + answer}, "
            f"planned {gib(memory.get('planned_bytes'))}")
    except RuntimeError as exc:
        results["neighbour"] = {"error": str(exc)[-400:]}
        log(f"neighbour FAILED: {exc}")
    finally:
        second.stop()


def hog(model_dir: Path, args, results: dict, out: Path) -> None:
    """Another process holds most of the GPU: the 7B server must refuse at once, naming need and free."""
    free, _ = torch.cuda.mem_get_info()
    held = torch.empty(max(0, free - 12 * 2**30), dtype=torch.uint8, device="cuda")  # leave 12 GiB: < the weights
    try:
        started = time.perf_counter()
        server = Server(model_dir, out, "7b-hog", device=args.device)
        code = server.proc.wait(timeout=300)
        seconds = time.perf_counter() - started
        text = server.log_path.read_text(errors="replace")
        server.stop()
        refused = code == 2 and "does not fit" in text and "Traceback" not in text
        line = next((l for l in text.splitlines() if "fovea: error:" in l), text.splitlines()[-1] if text else "")
        results["hog"] = {"exit": code, "seconds": seconds, "refused_cleanly": refused, "message": line[:600]}
        log(f"hog: exit {code} after {seconds:.1f} s, {'refused cleanly' if refused else 'NOT refused cleanly'}: {line[:300]}")
    finally:
        del held
        torch.cuda.empty_cache()


def pair(model_dir: Path, args, results: dict, out: Path) -> None:
    """Two 7B servers at --gpu-memory-utilization 0.45 each, a burst to both at once."""
    servers = [Server(model_dir, out, f"7b-half-{i}", "--gpu-memory-utilization", "0.45", device=args.device)
               for i in range(2)]
    try:
        ready = [s.wait_ready() for s in servers]
        name = httpx.get(servers[0].url + "/v1/models").json()["data"][0]["id"]
        n = args.pair_burst

        with ThreadPoolExecutor(len(servers)) as pool:  # each burst from processes of its own, both at once
            outs = list(pool.map(lambda i: load_procs.burst(servers[i].url, bodies(name, 200_000 + 10_000 * i, n),
                                                            processes=args.client_processes),
                                 range(len(servers))))
        sums = [load.summarize(sent.results, sent.wall_s) for sent in outs]
        results["pair"] = {"ready_s": ready, "bursts": [vars(s) for s in sums],
                           "process_gpu_bytes": [process_gpu_bytes(s.proc.pid) for s in servers]}
        log(f"pair: ready {[round(x, 1) for x in ready]} s; bursts of {n}: "
            + "; ".join(f"{s.tok_s:.0f} tok/s, failed {s.failed} {s.errors}" for s in sums))
    except RuntimeError as exc:
        results["pair"] = {"error": str(exc)[-400:]}
        log(f"pair FAILED: {exc}")
    finally:
        for s in servers:
            s.stop()


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def table(results: dict) -> str:
    off, srv = results.get("offline", {}), results.get("serve", {})
    roof = results.get("roofline_tok_s", math.nan)
    rows = [("what", "offline engine", "through fovea serve", "floor / goal")]
    if srv:
        rows.append(("start-up to ready /health", "-", f"{srv['startup_s']:.1f} s", ""))
        single = srv["single"]
        rows.append(("single: TTFT ms (p50)", f"{off.get('ttft_ms', math.nan):.1f}", f"{single['ttft_p50_ms']:.1f}",
                     "HTTP <= offline + 3 ms"))
        rows.append(("single: TPOT ms (p50)", f"{off.get('tpot_ms', math.nan):.2f}", f"{single['tpot_p50_ms']:.2f}", ""))
        bursts = srv["burst"]
        tok = sorted(b["tokens"] / b["wall_s"] for b in bursts)
        off_tok = sorted(off.get("burst_tok_s", [math.nan]))
        med, off_med = tok[len(tok) // 2], off_tok[len(off_tok) // 2]
        failed = sum(b["failed"] for b in bursts)
        rows.append((f"burst {bursts[0]['requests']}: output tok/s", f"{off_med:.0f} (failed {off.get('failed', 0)})",
                     f"{med:.0f} = {med / off_med:.0%} of offline, {med / roof:.0%} of roofline (failed {failed})",
                     f"roofline {roof:.0f}; goals 90% / 80%"))
        busiest = max(b["client"]["busiest_worker_core_share"] for b in bursts)
        rows.append(("burst: the load generator's CPU", "-",
                     (f"{bursts[0]['client']['processes']} processes, "
                      f"{max(b['client']['cores_busy'] for b in bursts):.2f} cores busy, busiest worker "
                      f"{busiest:.0%} of a core"), "busiest well under 100%"))
        for share, s in srv["sustained"].items():
            rows.append((f"Poisson {share} ({s['rate_req_s']:.1f} req/s)", "-",
                         (f"TTFT {s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms, TPOT {s['tpot_p50_ms']:.1f}/"
                          f"{s['tpot_p99_ms']:.1f} ms (p50/p99), failed {s['failed']} of {s['requests']}"), "0 failed"))
        m = srv["memory"]
        rows.append(("memory", f"plan {gib(off.get('plan_bytes'))}",
                     (f"plan {gib(m['planned_bytes'])}, torch peak {gib(m['torch_peak_reserved_bytes'])} <= cap "
                      f"{gib(m['torch_cap_bytes'])}: {m['peak_within_plan']}; process {gib(m['process_gpu_bytes'])}"),
                     "peak within plan"))
    for key in ("neighbour", "hog", "pair"):
        if key in results:
            rows.append((key, "", json.dumps({k: v for k, v in results[key].items() if k != "bursts"})[:160], ""))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


def problems(results: dict) -> list[str]:
    """What this run shows to be broken (not goals missed): failed requests, a peak past the plan,
    a refusal that did not happen cleanly, a wrong answer. Any of them makes the exit status 1."""
    found = []
    off, srv = results.get("offline"), results.get("serve")
    if off and off.get("failed"):
        found.append(f"offline: {off['failed']} failed request(s)")
    if srv:
        failed = srv["single"]["failed"] + sum(b["failed"] for b in srv["burst"])
        failed += sum(s["failed"] for s in srv["sustained"].values())
        if failed:
            found.append(f"serve: {failed} failed request(s)")
        if srv["memory"]["peak_within_plan"] is False:
            found.append("serve: torch's peak reserved memory passed the plan's cap")
    for key, ok in (("neighbour", "answer_ok"), ("hog", "refused_cleanly")):
        if key in results and not results[key].get(ok):
            found.append(f"{key}: {results[key]}")
    if "pair" in results and ("error" in results["pair"] or any(b["failed"] for b in results["pair"]["bursts"])):
        found.append(f"pair: {results['pair'].get('error') or 'failed requests'}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/fovea-serve-bench")))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/fovea-llava-1.5-7b"))
    parser.add_argument("--arch", default="llava-1.5-7b", help="fovea.testing.random_llava architecture (tiny: CPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--phases", default="offline,serve,neighbour",
                        help="comma list of offline, serve, neighbour, hog, pair")
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3, help="bursts timed (the median is reported)")
    parser.add_argument("--singles", type=int, default=7)
    parser.add_argument("--sustain-seconds", type=float, default=60.0)
    parser.add_argument("--loads", default="0.5,0.8,1.0", help="shares of the measured burst request rate")
    parser.add_argument("--pair-burst", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=4,
                        help="load-generator processes (bench/load_procs.py); their CPU use is reported")
    parser.add_argument("--server-args", default="", help="extra `fovea serve` flags for the serve phase")
    args = parser.parse_args()
    args.loads = [float(x) for x in args.loads.split(",") if x]
    phases = args.phases.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__}
    cuda = torch.cuda.is_available() and args.device != "cpu"
    args.ceilings = None
    if cuda:
        from gpu_llava7b import ceilings

        results["gpu"] = torch.cuda.get_device_name(0)
        args.ceilings = results["ceilings"] = ceilings()
        torch.cuda.empty_cache()
        log(f"ceilings: copy {args.ceilings['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 "
            f"{args.ceilings['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    if not (args.model_dir / "model.safetensors.index.json").is_file():
        started = time.perf_counter()
        write_model_dir(args.model_dir, args.arch, "cuda" if cuda else "cpu")
        log(f"wrote {args.arch} to {args.model_dir} in {time.perf_counter() - started:.1f} s")
    server = None
    save = lambda: (args.out / "gpu_serve.json").write_text(json.dumps(results, indent=2, default=str))
    try:
        if "offline" in phases:
            offline(args.model_dir, args, results)
            release_gpu()
            save()
        if "hog" in phases and cuda:
            hog(args.model_dir, args, results, args.out)
            save()
        if "serve" in phases:
            server = serve(args.model_dir, args, results, args.out)
            save()
            if "neighbour" in phases:
                neighbour(args, results, args.out)
        if "pair" in phases:
            if server is not None:
                server.stop()
                server = None
            pair(args.model_dir, args, results, args.out)
    finally:
        if server is not None:
            server.stop()
        (args.out / "gpu_serve.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))
    found = problems(results)
    for problem in found:
        print(f"PROBLEM: {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
