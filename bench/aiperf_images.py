"""aiperf (NVIDIA's LLM benchmark client) against ``fovea serve``, with synthetic images.

Starts ``fovea serve`` on a model directory (the demo model by default; or ``--url`` for a
server already running), runs ``aiperf profile`` once per endpoint type (chat and responses)
with one synthetic image per request, and prints one markdown row per run from aiperf's own
JSON export (docs/benchmarks.md, "aiperf"). aiperf reads the tokenizer from the model
directory, so nothing is downloaded.

aiperf is not a fovea dependency: install it where it fits (its pins clash with fovea's test
environment on some packages), e.g. ``python -m venv /work/aiperf-venv &&
/work/aiperf-venv/bin/pip install aiperf``, and pass ``--aiperf /work/aiperf-venv/bin/aiperf``
(or put ``aiperf`` on PATH, or set AIPERF).

  python bench/aiperf_images.py --aiperf /work/aiperf-venv/bin/aiperf --concurrency 4 --requests 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "fovea-shapes"
# Token counts from the server's usage (image tokens included); the client's own count of the
# text alone would miss them. aiperf 0.13 reads a Responses stream's usage only from
# response.completed, so its answers are left long enough to end on their own (not
# response.incomplete).
ENDPOINTS = {
    "chat": ["--extra-inputs", "ignore_eos:true"],
    "responses": [],
}
METRICS = (("request_throughput", "avg", "req/s"), ("time_to_first_token", "p50", "TTFT p50 ms"),
           ("time_to_first_token", "p99", "TTFT p99 ms"), ("inter_token_latency", "p50", "ITL p50 ms"),
           ("request_latency", "p50", "latency p50 ms"), ("output_token_throughput", "avg", "out tok/s"),
           ("usage_prompt_tokens", "avg", "prompt tokens"), ("usage_completion_tokens", "avg", "output tokens"))


def find_aiperf(given: str | None) -> str:
    found = given or os.environ.get("AIPERF") or shutil.which("aiperf")
    if not found or not Path(found).exists():
        sys.exit("aiperf not found: pip install aiperf (in a venv of its own if it clashes), then --aiperf PATH")
    return found


def start_server(model: Path, port: int, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "fovea.cli", "--log-level", "warning", "serve", "--model",
                                str(model), "--port", str(port), "--no-canary", *extra], env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"fovea serve exited with code {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    sys.exit("fovea serve was not ready within 300 s")


def run_aiperf(aiperf: str, url: str, model_name: str, tokenizer: Path, endpoint: str, args: argparse.Namespace,
               out: Path) -> dict:
    command = [aiperf, "profile", "--model", model_name, "--url", url, "--endpoint-type", endpoint, "--streaming",
               "--tokenizer", str(tokenizer), "--use-server-token-count",
               "--image-width-mean", str(args.image_size), "--image-height-mean", str(args.image_size),
               "--image-batch-size", "1", "--image-format", args.image_format,
               "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(args.output_tokens), "--concurrency", str(args.concurrency),
               "--request-count", str(args.requests), "--warmup-request-count", str(args.concurrency),
               "--random-seed", "7", "--ui-type", "none", "--no-gpu-telemetry", "--artifact-dir", str(out),
               *ENDPOINTS[endpoint]]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    # aiperf 0.13 in HF offline mode looks even a local tokenizer directory up in the hub's
    # cache and fails ("Repo id must be in the form ..."); online, it loads the directory as is
    # (a local path is never resolved through the hub), so the variables are dropped for it alone.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with log.open("w") as sink:
        code = subprocess.run(command, check=False, stdout=sink, stderr=subprocess.STDOUT, env=env,
                              timeout=args.timeout).returncode
    if code != 0:
        sys.exit(f"aiperf failed on {endpoint} (exit {code}); its log: {log}")
    return json.loads((out / "profile_export_aiperf.json").read_text())


def row(endpoint: str, result: dict) -> str:
    cells = [endpoint, f"{result['request_count']['avg']:.0f}", f"{result.get('request_error_rate', {}).get('avg', 0):.0f}"]
    for name, stat, _ in METRICS:
        value = (result.get(name) or {}).get(stat)
        cells.append("-" if value is None else f"{value:.1f}")
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", help="the aiperf executable (else AIPERF, else aiperf on PATH)")
    parser.add_argument("--model", type=Path, default=DEMO, help="model directory (also aiperf's tokenizer)")
    parser.add_argument("--url", help="a fovea server already running (default: start one on --model)")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--endpoints", default="chat,responses")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--image-format", default="png", choices=["png", "jpeg"])
    parser.add_argument("--input-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, help="where aiperf's artifacts go (default: a temporary folder)")
    parser.add_argument("--serve-arg", action="append", default=[], help="passed on to fovea serve (repeatable)")
    args = parser.parse_args()
    aiperf = find_aiperf(args.aiperf)
    out = args.out or Path(tempfile.mkdtemp(prefix="fovea-aiperf-"))
    server = None if args.url else start_server(args.model, args.port, args.serve_arg)
    url = args.url or f"http://127.0.0.1:{args.port}"
    try:
        model_name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        header = ["endpoint", "requests", "errors %", *(label for _, _, label in METRICS)]
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for endpoint in args.endpoints.split(","):
            print(row(endpoint, run_aiperf(aiperf, url, model_name, args.model, endpoint, args, out / endpoint)),
                  flush=True)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    print(f"\naiperf artifacts: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
