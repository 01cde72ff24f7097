"""``--engine-core process``: the engine in a process of its own, the routes in this one.

The same requests to a server whose engine runs in its own process and to one whose engine
runs in-process must get the same answers: text, log-probabilities, n > 1, prompt
log-probabilities and structured outputs. Refusals that only the core can make (a full
queue) must still come before a stream starts. Pixels go through shared memory and none are
left behind. The engine's metrics must reach /metrics. An engine core that dies must end every
request in flight with an error event and make the server exit non-zero. A core that refuses to
start must stop the server with its one-line reason.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from scene_helpers import free_port, start_server, stop_server
from test_stream_admission import one_stream

from fovea.config import ServerSettings
from fovea.engine.process.wire import PIXEL_DIR, PIXEL_PREFIX
from fovea.media import MediaConfig

ROOT = Path(__file__).resolve().parents[2]
NEEDS_PROC = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds child pids in /proc")


def image_url(color: tuple[int, int, int], size: int = 96) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(text: str, color=(220, 30, 30)) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(color)}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def core_server():
    """A server on the demo model whose engine core runs in a process of its own."""
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False,
                              media=MediaConfig(), engine_core="process", max_queue=None)
    live, server, thread = start_server(settings, None)
    yield live
    stop_server(server, thread)


@pytest.fixture(scope="module")
def thread_server(make_server):
    return make_server()


def pixel_files() -> list[Path]:
    return [p for p in PIXEL_DIR.glob(f"{PIXEL_PREFIX}{os.getpid()}-*")]


def answer(base: str, body: dict) -> dict:
    reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text[:500]
    out = reply.json()
    for key in ("id", "created"):
        out.pop(key)
    return out


BODIES = {
    "greedy with log-probabilities, two choices and prompt log-probabilities": {
        "messages": chat("What color is the circle?"), "max_tokens": 8, "temperature": 0, "n": 2,
        "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1},
    "sampled with a seed, penalties and a stop string": {
        "messages": chat("Describe the image.", (30, 30, 220)), "max_tokens": 16, "temperature": 0.9, "seed": 7,
        "frequency_penalty": 0.5, "stop": ["green"]},
    "structured output (a regex)": {
        "messages": chat("How many shapes are there?"), "max_tokens": 8, "temperature": 0,
        "structured_outputs": {"regex": "(one|two|three)"}},
}


@pytest.mark.parametrize("name", list(BODIES))
def test_the_answers_equal_an_in_process_engines(core_server, thread_server, name):
    ours, theirs = answer(core_server.base_url, BODIES[name]), answer(thread_server.base_url, BODIES[name])
    assert ours == theirs
    if "prompt_logprobs" in BODIES[name]:
        assert ours["prompt_logprobs"][0] is None and len(ours["prompt_logprobs"]) > 10
    if "structured_outputs" in BODIES[name]:
        assert ours["choices"][0]["message"]["content"] in {"one", "two", "three"}


def test_a_stream_carries_the_same_text_and_ends_with_done(core_server, thread_server):
    body = {"messages": chat("Describe the image."), "max_tokens": 12, "temperature": 0, "stream": True}

    def streamed(base: str) -> tuple[str, list[str]]:
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), events

    (ours, events), (theirs, _) = streamed(core_server.base_url), streamed(thread_server.base_url)
    assert ours == theirs and ours and events[-1] == "[DONE]"


def test_pixels_cross_in_shared_memory_and_none_are_left(core_server):
    answer(core_server.base_url, {"messages": chat("What color is the square?", (20, 200, 20)), "max_tokens": 2})
    assert pixel_files() == []  # the core removed each request's file as it took it


def test_the_engine_metrics_come_from_the_core(core_server):
    def samples() -> dict[str, float]:
        text = httpx.get(core_server.base_url + "/metrics", timeout=30).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def grown(after: dict[str, float]) -> list[str]:
        """What has not grown yet (the core sends its counters every 0.25 s)."""
        embed = 'fovea_engine_step_phase_seconds_total{phase="embed"}'
        return [name for name, by in (("fovea_engine_steps_total", 4), ("fovea_encoder_cache_misses_total", 1),
                                      ("fovea_vision_encoder_latency_ms_count", 1), (embed, 1e-9),
                                      ("fovea_request_queue_seconds_count", 1),
                                      ("fovea_request_prefill_seconds_count", 1))
                if after.get(name, 0.0) < before.get(name, 0.0) + by]

    before = samples()
    answer(core_server.base_url, {"messages": chat("Describe the image.", (123, 45, 67)), "max_tokens": 4})
    deadline = time.monotonic() + 10
    while grown(samples()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert grown(samples()) == []


def test_health_reports_the_cores_memory_plan(core_server):
    health = httpx.get(core_server.base_url + "/health", timeout=30).json()
    assert health["status"] == "ok"
    assert {line["name"] for line in health["memory"]["lines"]} >= {"weights", "kv_cache"}
    assert health["startup"] is None or "load weights" in health["startup"]["phases"]
    # The KV cache's free share, from the core's stats (every 0.25 s): none before the first.
    deadline = time.monotonic() + 10
    while health["kv_free_share"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
        health = httpx.get(core_server.base_url + "/health", timeout=30).json()
    assert 0 < health["kv_free_share"] <= 1, health["kv_free_share"]


def test_a_full_queue_in_the_core_is_a_429_before_the_stream():
    settings = ServerSettings(host="127.0.0.1", port=free_port(), device="cpu", dtype="float32", canary=False,
                              media=MediaConfig(), engine_core="process", max_queue=2, max_batch_size=1)
    live, server, thread = start_server(settings, None)
    live.app.state.fovea.engine.refuse_when_full = lambda: None  # no early 429 here: the core decides each
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=live.base_url, timeout=300) as client:
                return await asyncio.gather(*(one_stream(client, "/v1/chat/completions", i) for i in range(16)))

        refused = answered = 0
        for status, headers, lines, raw in asyncio.run(burst()):
            if status == 429:
                refused += 1
                assert headers["retry-after"] and json.loads(raw)["error"]["code"] == "server_overloaded"
            else:
                assert status == 200 and [line for line in lines if line][-1] == "data: [DONE]", raw[-300:]
                assert b"\"error\"" not in raw, raw[-300:]
                answered += 1
        assert refused and answered, (refused, answered)
    finally:
        stop_server(server, thread)


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def serve(*flags: str, log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``fovea serve`` on CPU (engine core in its own process, no canary) with ``flags``; its
    output piped, or written to ``log`` (the access lines ``served_by`` reads). The process and
    its base URL."""
    port = free_port()
    output = open(log, "w") if log is not None else contextlib.nullcontext(subprocess.PIPE)
    with sigint_as_in_a_terminal(), output as out:
        process = subprocess.Popen([sys.executable, "-m", "fovea.cli", "serve", "--engine-core", "process",
                                    "--device", "cpu", "--port", str(port), "--no-canary", *flags], cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return process, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def sigint_as_in_a_terminal() -> Iterator[None]:
    """Children started inside get SIGINT's default disposition, as a server started in a terminal
    has. A test run started in the background by a shell without job control ignores SIGINT, and
    children inherit that: such a server still stops gracefully on SIGINT (uvicorn catches it), but
    the SIGINT that uvicorn re-raises afterwards is then ignored, and it exits 0."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:  # a Python handler, unlike SIG_IGN, is reset to the default by exec
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def wait_ready(process: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()[-2000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become ready")


def core_of(process: subprocess.Popen) -> int:
    (core,) = [pid for pid in children(process.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    return core


def stream_and_then(base: str, max_tokens: int, action) -> list[str]:
    """Start a streamed request, run ``action`` once its first event came, and return its events."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is streaming
        action()
        return [line for line in lines if line.startswith("data: ")]


@NEEDS_PROC
def test_a_dead_core_fails_the_streams_in_flight_and_stops_the_server():
    process, base = serve()
    try:
        wait_ready(process, base)
        core = core_of(process)
        rest = stream_and_then(base, 480, lambda: os.kill(core, signal.SIGKILL))
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "server_error", error
        assert process.wait(timeout=30) == 1  # stopped, non-zero: its supervisor starts it again
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
    assert pixel_files() == []


def test_a_core_that_refuses_to_start_stops_the_server_with_its_reason():
    process, _ = serve("--processor-override", json.dumps({"image_mean": [0, 0, 0]}))
    out, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "breaks the model contract" in out and "image_mean" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


@NEEDS_PROC
def test_sigterm_lets_a_stream_finish_then_stops_the_core():
    """A graceful stop: the open stream runs to its end ([DONE]), then the server and its core
    exit."""
    process, base = serve()
    try:
        wait_ready(process, base)
        core = core_of(process)
        rest = stream_and_then(base, 200, lambda: process.send_signal(signal.SIGTERM))
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length", rest[-2]
        # After its graceful stop uvicorn re-raises the signal it caught: ended by SIGTERM, as asked.
        code = process.wait(timeout=60)
        assert code == -signal.SIGTERM, (code, process.stdout.read()[-3000:])
        assert not Path(f"/proc/{core}").exists() or "zombie" in Path(f"/proc/{core}/status").read_text().lower()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@NEEDS_PROC
def test_ctrl_c_stops_the_server_and_its_core_quietly():
    """SIGINT, as Ctrl-C sends it: a graceful stop, then the process ends by that signal, with no
    KeyboardInterrupt traceback."""
    process, base = serve()
    try:
        wait_ready(process, base)
        core = core_of(process)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
        out = process.stdout.read()
        assert code == -signal.SIGINT, (code, out[-3000:])
        assert "Application shutdown complete" in out and "Traceback" not in out, out[-3000:]
        assert not Path(f"/proc/{core}").exists() or "zombie" in Path(f"/proc/{core}/status").read_text().lower()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def started_pids(log: Path) -> list[int]:
    """The pids of the API processes whose uvicorn has started, in order."""
    return [int(line.rsplit("[", 1)[1].split("]")[0]) for line in log.read_text(errors="replace").splitlines()
            if "Started server process [" in line]


def served_by(log: Path, what: str) -> tuple[int, int]:
    """Access-log lines ``what`` (e.g. "POST /v1/chat/completions 200") of the first API process
    and of the further ones (whose lines carry their name, api-1...)."""
    lines = [line for line in log.read_text().splitlines() if f"fovea.access: {what}" in line]
    further = sum(" api-" in line for line in lines)
    return len(lines) - further, further


def terminate(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def chat_total(metrics_text: str) -> float:
    prefix = 'fovea_requests_total{route="/v1/chat/completions",status="200"} '
    return sum(float(line.removeprefix(prefix)) for line in metrics_text.splitlines() if line.startswith(prefix))


def first_token_count(metrics_text: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics_text.splitlines()
               if line.startswith("fovea_time_to_first_token_seconds_count"))


@NEEDS_PROC
def test_two_api_processes_feed_one_core_and_one_dying_loses_nothing_else(tmp_path):
    """Ready only once both API processes serve; /metrics, whichever process answers it, counts
    the requests of both (and of one that died since); a dead one is replaced."""
    log = tmp_path / "server.log"
    process, base = serve("--api-server-count", "2", log=log)
    try:
        wait_ready(process, base)
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["api_servers"] == {"serving": 2, "of": 2} and health["status"] == "ok", health
        assert log.read_text().count("Application startup complete") == 2, log.read_text()[-3000:]
        first = process.pid  # the further process, started beside the core's load, may be ready before it
        (other,) = set(started_pids(log)[:2]) - {first}
        assert first in started_pids(log)[:2] and other in children(process.pid)

        def ask_many(count: int) -> list[str]:
            async def ask(i: int) -> str:
                async with httpx.AsyncClient(base_url=base, timeout=120) as client:  # a connection each
                    reply = await client.post("/v1/chat/completions", json={
                        "messages": chat("What color is the circle?"), "max_tokens": 4, "temperature": 0})
                    assert reply.status_code == 200, reply.text[:300]
                    return reply.json()["choices"][0]["message"]["content"]

            async def all_of() -> list[str]:
                return await asyncio.gather(*(ask(i) for i in range(count)))

            return asyncio.run(all_of())

        def scrapes_from_both() -> list[str]:
            """/metrics, a connection each, until both processes have answered it at least once."""
            texts = []
            while min(served_by(log, "GET /metrics 200")) == 0 and len(texts) < 60:
                texts.append(httpx.get(base + "/metrics", timeout=30).text)
            assert min(served_by(log, "GET /metrics 200")) > 0, "one API process answered every scrape"
            return texts

        answers, sent = [], 0
        while min(served_by(log, "POST /v1/chat/completions 200")) == 0 and sent < 240:
            answers += ask_many(24)  # the kernel hands connections to whichever process accepts first
            sent += 24
        assert min(served_by(log, "POST /v1/chat/completions 200")) > 0, "one API process took every request"
        assert len(set(answers)) == 1 and answers[0]  # one model, one greedy answer, whoever took it
        for text in scrapes_from_both():
            assert chat_total(text) == sent and first_token_count(text) == sent, text[-2000:]

        os.kill(other, signal.SIGKILL)  # a further API process dies: the core and the first go on
        assert ask_many(8) == answers[:8]
        statuses = []
        deadline = time.monotonic() + 60
        while len(started_pids(log)) < 3 and time.monotonic() < deadline:
            statuses.append(httpx.get(base + "/health", timeout=10).json())
            time.sleep(0.1)
        assert len(started_pids(log)) == 3, log.read_text()[-3000:]  # and another takes its place
        assert "API process 1" in log.read_text() and "exited with status -9" in log.read_text()
        # While it is replaced, the server says so (and still answers: degraded, not starting).
        assert any(h["status"] == "degraded" and h["api_servers"] == {"serving": 1, "of": 2} for h in statuses), \
            statuses[-3:]
        deadline = time.monotonic() + 60
        while httpx.get(base + "/health", timeout=10).json()["api_servers"]["serving"] < 2:
            assert time.monotonic() < deadline, "the replacement never served"
            time.sleep(0.2)
        text = httpx.get(base + "/metrics", timeout=30).text
        assert chat_total(text) == sent + 8, text[-2000:]  # the dead process's requests still count

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == -signal.SIGTERM, log.read_text()[-3000:]
        assert not [pid for pid in (first, other, *started_pids(log)) if Path(f"/proc/{pid}").exists()
                    and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
        assert not list(Path(tempfile.gettempdir()).glob(f"fovea-metrics-{process.pid}-*"))  # its files are gone
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@NEEDS_PROC
def test_every_api_process_checks_the_api_key(tmp_path):
    """--api-key with --api-server-count 2: whichever process takes a connection refuses a request
    without the key (401, invalid_api_key) and answers one with it."""
    log = tmp_path / "server.log"
    process, base = serve("--api-server-count", "2", "--api-key", "sesame", log=log)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "temperature": 0}
    try:
        wait_ready(process, base)  # /health is open: load balancers probe it without credentials
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                ({"Authorization": "Bearer sesame"}, 200)):
            what = f"POST /v1/chat/completions {status}"
            tries = 0
            while min(served_by(log, what)) == 0 and tries < 120:
                reply = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=60)
                assert reply.status_code == status, reply.text[:300]
                if status == 401:
                    assert reply.json()["error"]["code"] == "invalid_api_key"
                tries += 1
            assert min(served_by(log, what)) > 0, f"one API process took every {what}"
    finally:
        terminate(process)


def test_more_api_processes_need_the_engine_core_in_its_own_process():
    out = subprocess.run([sys.executable, "-m", "fovea.cli", "serve", "--engine-core", "thread",
                          "--api-server-count", "2", "--port", str(free_port())], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 2
    assert out.stderr.strip() == "fovea: error: --api-server-count feeds one engine core from several API " \
        "processes: it needs --engine-core process", out.stderr


def test_an_api_process_preprocesses_with_the_cores_override(tmp_path):
    """The API process resizes (Qwen-VL: and only resizes) what the core encodes: it applies the
    core's --processor-override and refuses to start unless its recipe is the core's contract's."""
    from fovea.errors import ModelLoadError
    from fovea.loading.contract import check_contract
    from fovea.loading.loader import load_model
    from fovea.serve.app import same_recipe_as_core
    from fovea.testing.random_qwen2_5_vl import write_model_dir

    path = write_model_dir(tmp_path / "qwen", arch="tiny", seed=3)
    override = {"resample": 2}  # bilinear: not a normalisation field, no --force needed
    contract = check_contract(load_model(path, "cpu", "float32"), override=override)
    settings = ServerSettings(model=str(path), device="cpu", dtype="float32", processor_override=override)
    api = load_model(path, "cpu", "float32", weights=False)
    same_recipe_as_core(settings, api, contract)
    assert api.codec.image_processor.resample == 2
    without = load_model(path, "cpu", "float32", weights=False)
    with pytest.raises(ModelLoadError, match="engine core's contract"):
        same_recipe_as_core(dataclasses.replace(settings, processor_override={}), without, contract)


@NEEDS_PROC
def test_e_pd_with_two_api_processes_answers_images_as_agg(tmp_path, thread_server):
    """--topology e_pd --api-server-count 2: both API processes hand images to the one core, whose
    encode worker makes their embeddings; the greedy answers equal an in-process agg engine's."""
    log = tmp_path / "server.log"
    process, base = serve("--topology", "e_pd", "--api-server-count", "2", log=log)
    colors = [(220, 30, 30), (30, 200, 40), (30, 30, 220)]
    bodies = [{"messages": chat("What color is the circle?", color), "max_tokens": 4, "temperature": 0}
              for color in colors]
    try:
        wait_ready(process, base)
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["topology"] == "e_pd" and health["api_servers"] == {"serving": 2, "of": 2}, health
        expected = [answer(thread_server.base_url, body)["choices"][0]["message"]["content"] for body in bodies]
        sent = 0
        while min(served_by(log, "POST /v1/chat/completions 200")) == 0 and sent < 240:
            got = [answer(base, body)["choices"][0]["message"]["content"] for body in bodies]
            assert got == expected
            sent += len(bodies)
        assert min(served_by(log, "POST /v1/chat/completions 200")) > 0, "one API process took every request"
        # each distinct image was encoded by the worker (the core's stats reach /health every 0.25 s)
        deadline = time.monotonic() + 30
        while (handoff := httpx.get(base + "/health", timeout=10).json()["handoff"])["images"] < len(colors):
            assert time.monotonic() < deadline, handoff
            time.sleep(0.1)
    finally:
        terminate(process)
