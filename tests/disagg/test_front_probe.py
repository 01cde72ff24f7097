"""What the adversarial probe found under ``--topology e_pd --pd-workers 2``, pinned on a real front.

The front runs as ``fovea serve`` runs it, with its PD workers and an encode worker under it, its
log in a file: a misframed request closes its connection, a client that hangs up mid-body is one
access line and a count (no traceback), and a front killed with SIGKILL takes every process under
it along at once, leaving no shared memory behind. The last test kills the front: it stays last.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from framing_helpers import MISFRAMED, assert_one_framing_refusal, counted, send_part_of_a_body
from process_helpers import mapped_segments, stop_process
from scene_helpers import data_url, free_port, fresh_scene

import fovea
from fovea.demo import scenes

GONE_WITHIN_S = 2.0  # the children die on the end of file of a pipe: at once, give or take a loaded CPU


@dataclass
class Front:
    base: str
    process: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def front(tmp_path_factory) -> Front:
    port, log = free_port(), tmp_path_factory.mktemp("front") / "front.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fovea.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "fovea.cli", "--log-level", "info", "serve", "--topology", "e_pd",
             "--pd-workers", "2", "--encode-workers", "1", "--device", "cpu", "--dtype", "float32", "--no-canary",
             "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    live = Front(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, f"the front exited with code {process.returncode}:\n{live.log_text()}"
            try:
                body = httpx.get(live.base + "/health", timeout=10).json()
                if body["status"] == "ok" and all(w["state"] == "ready" for w in body["pd_workers"]):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the front and its workers were not ready within 240 s"
            time.sleep(0.25)
        yield live
    finally:
        stop_process(process)


@pytest.mark.parametrize("request_bytes", MISFRAMED.values(), ids=MISFRAMED.keys())
def test_the_front_refuses_a_misframed_request_and_closes_before_a_pipelined_one(front, request_bytes):
    assert_one_framing_refusal(front.base, request_bytes)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/images"])
def test_a_client_that_hangs_up_mid_body_is_one_front_access_line_and_counted(front, route):
    def count() -> float:
        return counted(httpx.get(front.base + "/metrics", timeout=30).text, "fovea_front_requests_total", route, 499)

    before, lines_before = count(), front.log_text().count(f"POST {route} 499")
    send_part_of_a_body(front.base, route)
    deadline = time.monotonic() + 10
    while count() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count() == before + 1
    text = front.log_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
    deadline = time.monotonic() + 5  # the access line is written as the response ends
    while text.count(f"POST {route} 499") == lines_before and time.monotonic() < deadline:
        time.sleep(0.05)
        text = front.log_text()
    assert text.count(f"POST {route} 499") == lines_before + 1, text[-3000:]


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the command name may hold spaces and parentheses
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has freed everything; its new parent reaps it


def test_killing_the_front_kills_every_process_under_it_at_once(front):
    """Last in this file: it kills the front."""
    image = scenes.render(fresh_scene(83_000))
    body = {"model": "fovea-shapes", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "Describe it."}]}]}
    for _ in range(2):  # one request for each PD worker: both hold shared memory with the encode worker
        assert httpx.post(front.base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    under = descendants(front.process.pid)
    workers = [pid for pid in under if "fovea.cli" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    assert len(workers) == 2 and len(under) >= 3, under  # two PD workers, an encode worker (and trackers)
    segments = mapped_segments(under)
    assert segments  # the pixels and embeddings the PD workers share with the encode worker
    front.process.kill()
    front.process.wait(10)
    killed = time.monotonic()
    while any(alive(pid) for pid in under) and time.monotonic() - killed < GONE_WITHIN_S:
        time.sleep(0.02)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in under if alive(pid)}
    assert not left, f"still alive {time.monotonic() - killed:.1f} s after the front was killed: {left}"
    deadline = time.monotonic() + 10  # the resource trackers unlink what their processes held as they exit
    while (leaked := segments & set(os.listdir("/dev/shm"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leaked
