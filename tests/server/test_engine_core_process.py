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
import io
import json
import os
import signal
import subprocess
import sys
import time
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
                                      ("fovea_vision_encoder_latency_ms_count", 1), (embed, 1e-9))
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


def serve(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fovea.cli", "serve", "--engine-core", "process", "--device",
                                "cpu", "--port", str(port), "--no-canary", *flags], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return process, f"http://127.0.0.1:{port}"


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


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the core's pid in /proc")
def test_a_dead_core_fails_the_streams_in_flight_and_stops_the_server():
    process, base = serve()
    try:
        wait_ready(process, base)
        (core,) = [pid for pid in children(process.pid)
                   if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is streaming
            os.kill(core, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
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
