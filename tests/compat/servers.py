"""``fovea serve`` processes for the client suite, one per server set-up that operators run.

A test written against the defaults hides a defect that only a configured server shows (a
missing ``max_tokens`` refused under ``--max-model-len``: issue 23), so the suite runs against
each ``Setup`` below. Each server is the real CLI in a process of its own, on a free port; its
log goes to a file that ``tail`` shows when a test fails, never onto the terminal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from scene_helpers import TEST_DEVICE, free_port

import fovea

KEY = "compat-key"
START_TIMEOUT_S = 300  # a 2-core CI machine starting a front and two PD workers under load
# `fovea serve`, whose process first asks for SIGTERM when pytest dies, however it dies (a
# `timeout` that kills pytest runs no teardown): PR_SET_PDEATHSIG, then fovea's CLI.
LAUNCH = ("import ctypes, signal, sys\n"
          "if sys.platform == 'linux': ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
          "from fovea.cli import main\n"
          "sys.exit(main(sys.argv[1:]))")


@dataclass(frozen=True)
class Setup:
    """A server set-up: flags for every model, plus flags that depend on the model's size."""

    id: str
    flags: tuple[str, ...] = ()
    demo_flags: tuple[str, ...] = ()  # the demo model: a 512-token context, 8 KiB of KV cache per token
    byte_flags: tuple[str, ...] = ()  # the byte-level Qwen2.5-VL: a 4096-token context, 512 bytes per token
    api_key: str | None = None
    limits: tuple[int, int] = (512, 4096)  # the tokens per sequence (demo, byte) these flags leave

    def limit(self, model: str) -> int:
        return self.limits[0] if model == "demo" else self.limits[1]

    def args(self, model: str) -> list[str]:
        return [*self.flags, *(self.demo_flags if model == "demo" else self.byte_flags),
                *(["--api-key", self.api_key] if self.api_key else [])]


SETUPS = [
    Setup("defaults"),
    # Below each model's context, above the tests' prompts: a request without max_tokens used to be
    # given the whole context as its answer's room, and refused.
    Setup("max-model-len", demo_flags=("--max-model-len", "256"), byte_flags=("--max-model-len", "1536"),
          limits=(256, 1536)),
    # A KV cache that holds fewer tokens than the model's context (demo: 384 of 512; byte: 2048 of 4096),
    # so the per-sequence limit comes from the cache, not from --max-model-len.
    Setup("small-kv-cache", demo_flags=("--kv-cache-memory", "3MiB"), byte_flags=("--kv-cache-memory", "1MiB"),
          limits=(384, 2048)),
    Setup("api-key", api_key=KEY),
    Setup("e_pd", flags=("--topology", "e_pd")),
    Setup("pd-workers-2", flags=("--topology", "e_pd", "--pd-workers", "2")),
]


@dataclass
class Served:
    """A running ``fovea serve``: where it answers, the key it wants, and its log."""

    base_url: str
    setup: Setup
    process: subprocess.Popen
    log: Path
    api_key: str = field(init=False)
    ready: bool = False

    def __post_init__(self) -> None:
        self.api_key = self.setup.api_key or "unused"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0,
                             **{"timeout": 120, **kw})

    def aclient(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0,
                                  **{"timeout": 120, **kw})

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


Key = tuple[str, str]  # (set-up id, "demo" | "byte")


class Fleet:
    """Starts each (set-up, model) server once, and the next ones in the tests' order ahead of
    time: a start (imports, model load, canary; 10 to 40 s on 2 cores, most of it one core's
    work) overlaps the tests that run before the server is needed."""

    def __init__(self, order: list[Key], model_dirs: dict[str, Path | None], logs: Path, ahead: int = 1) -> None:
        self.order, self.model_dirs, self.logs, self.ahead = order, model_dirs, logs, ahead
        self.setups = {s.id: s for s in SETUPS}
        self.launched: dict[Key, Served] = {}
        self.retired: set[Key] = set()

    def get(self, setup: Setup, model: str) -> Served:
        key = (setup.id, model)
        position = self.order.index(key) if key in self.order else len(self.order)
        for following in [key, *self.order[position + 1:position + 1 + self.ahead]]:
            self._launch(following)
        served = self.launched[key]
        try:
            _wait_ready(served)
        except BaseException:
            stop([served])
            raise
        return served

    def retire(self, setup: Setup | None = None) -> None:
        """Stop ``setup``'s servers (pytest has run every test that uses them), or all of them."""
        keys = [k for k in self.launched if (setup is None or k[0] == setup.id) and k not in self.retired]
        self.retired.update(keys)
        stop([self.launched[k] for k in keys])

    def _launch(self, key: Key) -> None:
        if key not in self.launched and key not in self.retired:
            setup, model = self.setups[key[0]], key[1]
            self.launched[key] = spawn(setup, model, self.model_dirs[model], self.logs, canary=model == "demo")


def spawn(setup: Setup, model: str, model_dir: Path | None, logs: Path, canary: bool) -> Served:
    """Start ``fovea serve`` with ``setup``'s flags, without waiting for it."""
    port = free_port()
    log = logs / f"{setup.id}-{model}.log"
    source = str(Path(fovea.__file__).parents[1])  # this checkout's fovea, in the child too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-c", LAUNCH, "--log-level", "info", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--device", TEST_DEVICE, "--dtype", "float32",
               *(["--model", str(model_dir)] if model_dir is not None else []),
               *(["--canary-interval", "0"] if canary else ["--no-canary"]), *setup.args(model)]
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Served(f"http://127.0.0.1:{port}", setup, process, log)


def _wait_ready(served: Served) -> None:
    """Return once /health is ok (and every PD worker ready); raise with the log's end if not."""
    if served.ready:
        return
    deadline, last = time.monotonic() + START_TIMEOUT_S, "no answer"
    while time.monotonic() < deadline:
        if served.process.poll() is not None:
            raise RuntimeError(f"fovea serve ({served.setup.id}) exited with {served.process.returncode}:\n"
                               + served.tail())
        try:
            body = httpx.get(served.base_url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError) as exc:
            last = repr(exc)
        else:
            workers = body.get("pd_workers") or []
            if body.get("status") == "ok" and all(w.get("state") == "ready" for w in workers):
                served.ready = True
                return
            last = f"status {body.get('status')}, reasons {body.get('reasons')}"
        time.sleep(0.2)
    raise RuntimeError(f"fovea serve ({served.setup.id}) was not ready in {START_TIMEOUT_S} s ({last}):\n"
                       + served.tail())


def stop(servers: list[Served]) -> None:
    """SIGTERM to all (each drains, its workers follow it), then wait; SIGKILL one that hangs."""
    running = [s for s in servers if s.process.poll() is None]
    for served in running:
        served.process.send_signal(signal.SIGTERM)
    for served in running:
        try:
            served.process.wait(60)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait(10)
