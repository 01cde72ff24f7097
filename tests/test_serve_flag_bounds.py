"""Every numeric flag of ``fovea serve``, at its boundary and past it, in a real ``fovea serve`` process.

Each case either becomes ready (``/health`` answers ``ok``; then it is stopped with SIGTERM
and must exit cleanly) or exits 2 with one refusal that names the flag: argparse's usage and
its ``fovea serve: error: argument --flag: ...`` line, or fovea's own ``fovea: error: ...``
line. Log records (``--log-format json``: one object a line) may precede a refusal made
after the model loaded; no other line may. Never a traceback, never a hang: each case has a
deadline. The cases run a few at a time, and the refusals that need no model cost a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from scene_helpers import free_port

import fovea
from fovea.cli import build_parser
from fovea.cli_types import json_object
from fovea.config import ServerSettings, usable_cores
from fovea.engine.memory.planner import host_available_bytes
from fovea.guard.canary_fit import PROBE_SIZES, canary_prompt, probe_bytes
from fovea.guard.probe_images import DEFAULT_CASES

READY_S = 300  # a start-up on a loaded 2-core machine, e_pd's worker processes included
REFUSED_S = 180
AT_ONCE = 3
CORES = usable_cores()


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    flag: str | None = None  # None: becomes ready; else the flag its one-line refusal names
    says: str = ""  # and a phrase of that line


@dataclass
class Outcome:
    ready: bool
    code: int | None  # None: it hung past its deadline
    stderr: str
    seconds: float
    left_behind: list[str]  # processes of its session still alive after it exited


def demo_numbers(demo_model) -> dict[str, int]:
    """What the demo model's limits are made of: the canary's need, a KV block's bytes, its context."""
    from fovea.serve.app import create_app

    engine = create_app(ServerSettings(device="cpu", dtype="float32", canary=False), loaded=demo_model).state.fovea.engine
    need = max(len(canary_prompt(demo_model.codec, c, PROBE_SIZES[0]).input_ids) for c in DEFAULT_CASES) + 1
    block = engine.config.block_size
    return {"need": need, "per_block": engine.runner.kv_plan.bytes_per_block, "block": block,
            "context": demo_model.context_length, "canary_blocks": -(-need // block)}


def cases(n: dict[str, int], busy_port: int) -> list[Case]:
    need, per_block, blocks = n["need"], n["per_block"], n["canary_blocks"]
    e_pd = ("--topology", "e_pd")
    huge = str(10**9)
    return [
        # ---- the boundaries, served --------------------------------------------------------
        Case("smallest", ("--max-model-len", str(need), "--max-batch-size", "1", "--max-batched-tokens", "1",
                          "--max-queue", "1", "--limit-images-per-prompt", "0", "--vision-batch-size", "1",
                          "--decode-memory", "1", "--max-body-bytes", "1024", "--canary-interval", "0",
                          "--max-image-pixels", str(PROBE_SIZES[-1] ** 2),
                          "--max-image-bytes", str(probe_bytes(PROBE_SIZES[-1])), "--max-video-bytes", "1",
                          "--max-video-frames", "1", "--max-video-seconds", "0.001", "--max-video-frame-pixels", "1",
                          "--preprocess-workers", "0", "--api-server-count", "1")),
        Case("smallest-kv-cache", ("--kv-cache-memory", str(blocks * per_block), "--max-model-len", str(n["context"]),
                                   "--preprocess-workers", "1", "--canary-interval", "1e9")),
        Case("no-canary-extremes", ("--no-canary", "--max-model-len", "1", "--kv-cache-memory", str(per_block),
                                    "--max-batch-size", huge, "--max-batched-tokens", huge, "--max-queue", huge,
                                    "--limit-images-per-prompt", huge, "--vision-batch-size", huge,
                                    "--decode-memory", "1TiB", "--max-body-bytes", "1TiB", "--max-image-pixels", huge,
                                    "--max-image-bytes", "1TiB", "--max-video-bytes", "1TiB",
                                    "--max-video-frames", huge, "--max-video-seconds", "1e9",
                                    "--max-video-frame-pixels", huge, "--preprocess-workers", "auto")),
        Case("e-pd-smallest", (*e_pd, "--encode-workers", "1", "--encode-timeout", "30", "--vision-batch-size", "1")),
        Case("pd-smallest", (*e_pd, "--pd-workers", "1", "--encode-workers", "1", "--pd-timeout", "1",
                             "--max-model-len", str(need))),
        # ---- past them: argparse --------------------------------------------------------------
        *[Case(f"{flag}={value}", (flag, value), flag, says) for flag, value, says in [
            ("--port", "0", "must be at least 1"), ("--port", "65536", "must be a TCP port"),
            ("--max-model-len", "0", "must be at least 1"), ("--kv-cache-memory", "0", "must be at least 1 byte"),
            ("--gpu-memory-utilization", "0", "must be above 0"), ("--gpu-memory-utilization", "1.5", "at most 1"),
            ("--gpu-memory-utilization", "nan", "must be above 0"), ("--max-batch-size", "0", "must be at least 1"),
            ("--max-batch-size", "-1", "must be at least 1"), ("--max-batched-tokens", "0", "must be at least 1"),
            ("--limit-images-per-prompt", "-1", "must be 0 or more"), ("--encode-workers", "0", "at least 1"),
            ("--api-server-count", "0", "at least 1"),
            ("--pd-workers", "0", "must be at least 1"), ("--decode-memory", "0", "must be at least 1 byte"),
            ("--decode-memory", "lots", "is not a size"), ("--canary-interval", "-1", "must be 0 or more"),
            ("--canary-interval", "nan", "must be 0 or more"), ("--max-queue", "0", "must be at least 1"),
            ("--max-body-bytes", "0", "must be at least 1 byte"), ("--vision-batch-size", "0", "at least 1"),
            ("--preprocess-workers", "-1", "must be 0 or more"), ("--pd-timeout", "soon", "invalid float"),
            ("--encode-timeout", "soon", "invalid float"), ("--max-image-bytes", "0", "must be at least 1 byte"),
            ("--max-image-pixels", "0", "must be at least 1"), ("--max-video-bytes", "0", "at least 1 byte"),
            ("--max-video-frames", "0", "must be at least 1"), ("--max-video-seconds", "0", "positive number"),
            ("--max-video-seconds", "inf", "positive number"), ("--max-video-frame-pixels", "0", "at least 1"),
        ]],
        # ---- past them: fovea's own line, before the model loads --------------------------------
        Case("port-in-use", ("--port", str(busy_port)), "--port", f"--port {busy_port} on 127.0.0.1 cannot be"),
        Case("body-below-1024", ("--max-body-bytes", "1023"), "--max-body-bytes", "must be at least 1024"),
        Case("encode-workers-without-e-pd", ("--encode-workers", "1"), "--encode-workers", "need --topology e_pd"),
        Case("encode-workers-over-cores", (*e_pd, "--encode-workers", str(CORES + 1)), "--encode-workers",
             f"more than this machine's {CORES} CPU cores"),
        Case("pd-workers-over-cores", (*e_pd, "--pd-workers", str(CORES + 1)), "--pd-workers",
             f"more than this machine's {CORES} CPU cores"),
        Case("preprocess-workers-over-cores", ("--preprocess-workers", str(CORES + 1)), "--preprocess-workers",
             f"more than this machine's {CORES} CPU cores"),
        Case("api-server-count-over-cores", ("--api-server-count", str(CORES + 1)), "--api-server-count",
             f"more than this machine's {CORES} CPU cores"),
        Case("api-server-count-without-core", ("--api-server-count", "2", "--engine-core", "thread"),
             "--api-server-count", "it needs --engine-core process"),
        Case("pd-timeout-without-pd", ("--pd-timeout", "5"), "--pd-timeout", "it needs --pd-workers"),
        Case("pd-timeout-0", (*e_pd, "--pd-workers", "1", "--pd-timeout", "0"), "--pd-timeout", "must be a positive"),
        Case("pd-timeout-nan", (*e_pd, "--pd-workers", "1", "--pd-timeout", "nan"), "--pd-timeout",
             "must be a positive"),
        Case("encode-timeout-without-e-pd", ("--encode-timeout", "5"), "--encode-timeout", "need --topology e_pd"),
        Case("encode-timeout-0", (*e_pd, "--encode-timeout", "0"), "--encode-timeout", "must be a positive"),
        Case("encode-timeout-nan", (*e_pd, "--encode-timeout", "nan"), "--encode-timeout", "must be a positive"),
        Case("gpu-share-on-cpu", ("--gpu-memory-utilization", "0.5"), "--gpu-memory-utilization",
             "applies to a GPU, and this engine runs on cpu"),
        Case("max-model-len-below-canary", ("--max-model-len", str(need - 1)), "--max-model-len",
             f"use --max-model-len {need} or more"),
        Case("pd-max-model-len-below-canary", (*e_pd, "--pd-workers", "1", "--max-model-len", str(need - 1)),
             "--max-model-len", f"use --max-model-len {need} or more"),
        Case("image-pixels-below-canary", ("--max-image-pixels", str(PROBE_SIZES[-1] ** 2 - 1)), "--max-image-pixels",
             f"use --max-image-pixels {PROBE_SIZES[-1] ** 2} or more"),
        Case("image-bytes-below-canary", ("--max-image-bytes", "100"), "--max-image-bytes",
             "refuses even the grounding canary's smallest probe image"),
        # ---- past them: fovea's own line, after the model loads ---------------------------------
        Case("max-model-len-past-context", ("--max-model-len", str(n["context"] + 1)), "--max-model-len",
             "is longer than the model's context"),
        Case("kv-cache-no-block", ("--kv-cache-memory", str(per_block - 1)), "--kv-cache-memory", "holds no KV block"),
        Case("kv-cache-below-canary", ("--kv-cache-memory", str((blocks - 1) * per_block)), "--kv-cache-memory",
             f"use --kv-cache-memory {-(-blocks * per_block // 1024)}KiB or more"),
        Case("kv-cache-past-host", ("--kv-cache-memory", str(2 * (host_available_bytes() or 2**50))),
             "--kv-cache-memory", "is more than this host has available"),
        Case("encode-timeout-too-short", (*e_pd, "--encode-timeout", "0.001"), "--encode-timeout",
             "the grounding canary could not run at start-up"),
    ]


def run_case(case: Case, scratch: Path) -> Outcome:
    port = [] if "--port" in case.argv else ["--port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fovea.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "fovea.cli", "--log-format", "json", "serve", "--device", "cpu",
            "--dtype", "float32", *port, *case.argv]
    started = time.monotonic()
    deadline = started + (READY_S if case.flag is None else REFUSED_S)
    # stderr to a file, not a pipe (a child left behind would hold a pipe open); a session of its
    # own, so that every process it started can be found afterwards.
    with open(scratch / f"{case.id}.stderr", "w+") as err:
        process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        ready = False
        while process.poll() is None and time.monotonic() < deadline:
            if case.flag is None and health_ok(int(port[1]) if port else 0):
                ready = True
                process.send_signal(signal.SIGTERM)
                break
            time.sleep(0.5)
        seconds = time.monotonic() - started
        try:
            code: int | None = process.wait(60 if ready else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        left = session(process.pid, wait_s=5)
        for pid in [process.pid, *(int(line.split()[0]) for line in left)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        err.seek(0)
        return Outcome(ready, code, err.read(), seconds, left)


def session(sid: int, wait_s: float) -> list[str]:
    """'pid command' of the live processes in session ``sid`` (waiting up to ``wait_s`` for none)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != sid:
                with contextlib.suppress(OSError):
                    if os.getsid(int(entry.name)) == sid and "Z" not in stat_state(entry):
                        command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        found.append(f"{entry.name} {command[:160]}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def stat_state(entry: Path) -> str:
    return (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]


def health_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return json.loads(reply.read()).get("status") == "ok"
    except (OSError, ValueError):
        return False


def is_log_record(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict) and "level" in json.loads(line)
    except ValueError:
        return False


@pytest.fixture(scope="module")
def numbers(demo_model) -> dict[str, int]:
    return demo_numbers(demo_model)


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def all_cases(numbers, busy_port) -> dict[str, Case]:
    return {case.id: case for case in cases(numbers, busy_port)}


@pytest.fixture(scope="module")
def outcomes(request, all_cases, tmp_path_factory):
    """Every selected case started at once, a few at a time: {id: Future[Outcome]}."""
    wanted = {item.callspec.params["case_id"] for item in request.session.items
              if item.module is request.module and "case_id" in getattr(getattr(item, "callspec", None), "params", {})}
    with ThreadPoolExecutor(AT_ONCE) as pool:
        # The servers first: they take longest.
        order = sorted((c for c in all_cases.values() if c.id in wanted), key=lambda c: c.flag is not None)
        scratch = tmp_path_factory.mktemp("serve-bounds")
        futures: dict[str, Future[Outcome]] = {c.id: pool.submit(run_case, c, scratch) for c in order}
        yield futures
        for future in futures.values():
            future.cancel()


def case_ids() -> list[str]:
    fake = {"need": 2, "per_block": 1024, "block": 16, "context": 4, "canary_blocks": 1}
    return [c.id for c in cases(fake, 1)]


@pytest.mark.parametrize("case_id", case_ids())
def test_a_flag_at_or_past_its_boundary_serves_or_is_refused_in_one_line(case_id, all_cases, outcomes):
    case, outcome = all_cases[case_id], outcomes[case_id].result()
    lines = outcome.stderr.strip().splitlines()
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    assert outcome.code is not None, f"{case.id} hung:\n{outcome.stderr[-3000:]}"
    assert outcome.left_behind == [], f"{case.id} left processes behind: {outcome.left_behind}"
    if case.flag is None:
        errors = [line for line in lines if is_log_record(line) and json.loads(line)["level"] in ("error", "critical")]
        assert outcome.ready, f"{case.id} exited {outcome.code} before it was ready:\n{outcome.stderr[-3000:]}"
        assert outcome.code in (0, -signal.SIGTERM) and errors == [], outcome.stderr[-3000:]
        return
    assert not outcome.ready and outcome.code == 2, f"{case.id}: code {outcome.code}\n{outcome.stderr[-3000:]}"
    other = [line for line in lines if not is_log_record(line)]
    refusal = other[-1] if other else ""
    if refusal.startswith("fovea serve: error: argument"):  # argparse: its usage block, then the line
        assert other[0].startswith("usage: fovea serve") and all(line.startswith(" ") for line in other[1:-1])
        assert refusal.startswith(f"fovea serve: error: argument {case.flag}: "), refusal
    else:
        assert refusal.startswith("fovea: error: ") and len(other) == 1, outcome.stderr[-3000:]
    assert case.flag in refusal and case.says in refusal, refusal


def test_every_numeric_flag_of_serve_has_cases_at_and_past_its_boundary():
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    numeric = {a.option_strings[0] for a in serve._actions
               if a.type is not None and a.type not in (str, Path, json.loads, json_object) and a.help != "==SUPPRESS=="}
    fake = {"need": 2, "per_block": 1024, "block": 16, "context": 4, "canary_blocks": 1}
    served = {arg for c in cases(fake, 1) if c.flag is None for arg in c.argv if arg.startswith("--")}
    refused = {c.flag for c in cases(fake, 1) if c.flag is not None}
    # On a host without a GPU, --gpu-memory-utilization can only be refused (it is a GPU's share).
    assert numeric - served == {"--gpu-memory-utilization", "--port"}  # --port: every served case has a free one
    assert numeric - refused == set()


@pytest.mark.parametrize("case_id", ["smallest-kv-cache", "no-canary-extremes"])
def test_a_served_start_says_where_its_seconds_went(case_id, outcomes):
    """The one `start-up:` line, logged when /health first answers ready: the seconds since the
    process started and its phases, the canary's among them when it ran."""
    outcome = outcomes[case_id].result()
    assert outcome.ready, outcome.stderr[-2000:]
    lines = [json.loads(line)["message"] for line in outcome.stderr.splitlines()
             if is_log_record(line) and json.loads(line)["message"].startswith("start-up: ready after ")]
    assert len(lines) == 1, outcome.stderr[-2000:]
    line = lines[0]
    total = float(line.removeprefix("start-up: ready after ").split(" s", 1)[0])
    assert 0 < total <= outcome.seconds  # counted from the process's start, before the test saw it ready
    for phase in ("checks before load", "imports", "load weights", "contract", "engine", ">memory profile"):
        assert f"{phase} " in line, line
    canary = case_id != "no-canary-extremes"
    assert (", canary fit " in line) == canary and bool(re.search(r", canary \d", line)) == canary, line
