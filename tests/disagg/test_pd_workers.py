"""``fovea serve --topology e_pd --pd-workers 2 --encode-workers 2`` on the demo model.

The front runs as `fovea serve` does, in a process of its own, with real PD-worker and
encode-worker processes under it. Requests go over HTTP with drawn scenes; the reference
answers come from the aggregated engine on the same pixels. Faults are real signals.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from process_helpers import mapped_segments, stop_process
from scene_helpers import data_url, free_port, fresh_scene, run_all

import fovea
from fovea import __version__
from fovea.cli import main
from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.sampling.params import SamplingParams
from fovea.front.metrics import merge
from fovea.front.uploads import UploadRecord, sync
from fovea.loading.prompt import encode_prompt, render_chat

QUESTION = "Describe the image."
KEY = "front-key"
AUTH = {"authorization": f"Bearer {KEY}"}
WORKER = "x-fovea-pd-worker"
PD_TIMEOUT_S = 10  # the front's --pd-timeout: generous for a 2-core CI machine under load


@dataclass
class Front:
    base: str
    process: subprocess.Popen


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def health(front: Front) -> dict:
    return httpx.get(front.base + "/health", timeout=30).json()


def wait_for(what: str, check, timeout: float = 150.0):
    """Poll ``check`` until it returns something truthy, or fail naming ``what`` and its last value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
        except httpx.HTTPError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.25)
    raise AssertionError(f"{what} within {timeout:.0f} s; last: {last!r}")


@pytest.fixture(scope="module")
def front():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fovea.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "fovea.cli", "--log-level", "warning", "serve", "--topology", "e_pd",
         "--pd-workers", "2", "--encode-workers", "2", "--device", "cpu", "--dtype", "float32", "--no-canary",
         "--port", str(port), "--encode-timeout", "10", "--pd-timeout", str(PD_TIMEOUT_S), "--max-queue", "1024",
         "--api-key", KEY], env=env)
    live = Front(f"http://127.0.0.1:{port}", process)

    def up():
        assert process.poll() is None, f"the front exited with code {process.returncode}"
        body = health(live)
        return body["status"] == "ok" and all(w["state"] == "ready" for w in body["pd_workers"])

    try:
        wait_for("the front and its workers were not ready", up, timeout=240)
        yield live
    finally:
        stop_process(process)


def chat(image, *, max_tokens: int = 40, **extra) -> dict:
    url = image if isinstance(image, str) else data_url(image)
    return {"model": "fovea-shapes", "max_tokens": max_tokens, "temperature": 0, **extra, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": QUESTION}]}]}


def agg_texts(model, images, max_tokens: int = 40, ignore_eos: bool = False) -> list[str]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompts = [encode_prompt(model, render_chat(model, messages), [image]) for image in images]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    results = run_all(PagedEngine(model, PagedEngineConfig(num_blocks=512)), [(p, params) for p in prompts])
    return [finish.text for _, finish in results]


async def post_all(base: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=300,
                                 limits=httpx.Limits(max_connections=128)) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def content(reply: httpx.Response) -> str:
    return reply.json()["choices"][0]["message"]["content"]


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def metrics(front: Front) -> str:
    return httpx.get(front.base + "/metrics", headers=AUTH, timeout=30).text


# ---- the front serving ------------------------------------------------------------------------
def test_64_concurrent_requests_are_answered_as_agg_answers_them_by_both_pd_workers(front, demo_model):
    before = metrics(front)
    images = [scenes.render(fresh_scene(80_000 + i)) for i in range(64)]
    replies = asyncio.run(post_all(front.base, [chat(image) for image in images]))
    assert [r.status_code for r in replies] == [200] * 64, [r.text for r in replies if r.status_code != 200][:3]
    assert [content(r) for r in replies] == agg_texts(demo_model, images)
    served = [r.headers[WORKER] for r in replies]
    assert served.count("0") > 0 and served.count("1") > 0, served  # both PD workers took a share
    body = health(front)
    # Each PD worker encoded through the shared encode workers (its own pool's view of them).
    for worker in body["pd_workers"]:
        assert sum(e["batches"] for e in worker["health"]["encode_workers"]) > 0
        assert [e["pid"] for e in worker["health"]["encode_workers"]] == [e["pid"] for e in body["encode_workers"]]
    after = metrics(front)
    # The workers' own series add up across them: each request and each image counted once.
    route = {"route": "/v1/chat/completions", "status": "200"}
    assert metric(after, "fovea_requests_total", **route) - metric(before, "fovea_requests_total", **route) == 64
    assert (metric(after, "fovea_embedding_handoff_seconds_count")
            - metric(before, "fovea_embedding_handoff_seconds_count")) >= 64
    for index in ("0", "1"):
        routed = {"pd_worker": index, **route}
        assert (metric(after, "fovea_front_routed_total", **routed)
                - metric(before, "fovea_front_routed_total", **routed)) == served.count(index)


def test_an_image_uploaded_through_the_front_serves_requests_on_either_worker(front, demo_model):
    image = scenes.render(fresh_scene(81_000))
    upload = httpx.post(front.base + "/v1/images", json={"image": data_url(image)}, headers=AUTH, timeout=30)
    assert upload.status_code == 200, upload.text
    image_id = upload.json()["id"]
    replies = asyncio.run(post_all(front.base, [chat(image_id) for _ in range(8)]))
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies if r.status_code != 200][:2]
    assert {r.headers[WORKER] for r in replies} == {"0", "1"}
    assert {content(r) for r in replies} == set(agg_texts(demo_model, [image]))

    deleted = httpx.delete(f"{front.base}/v1/images/{image_id}", headers=AUTH, timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    gone = httpx.post(front.base + "/v1/chat/completions", json=chat(image_id), headers=AUTH, timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "image_not_found", gone.text
    # Deleted on both. A chat request with the id follows it to one worker (affinity); a GET of it
    # carries no image, so it goes to the least-loaded worker, then the one sent fewest: each, in turn.
    looked: list[httpx.Response] = []

    def both_looked() -> bool:
        looked.append(httpx.get(f"{front.base}/v1/images/{image_id}", headers=AUTH, timeout=30))
        return {r.headers[WORKER] for r in looked} == {"0", "1"}

    wait_for("a GET of the image did not reach both workers", both_looked, timeout=60)
    assert all(r.status_code == 404 and r.json()["error"]["code"] == "image_not_found" for r in looked)


def test_the_front_loads_no_model(front):
    maps = Path(f"/proc/{front.process.pid}/maps").read_text()
    assert "libtorch" not in maps  # not even torch: it proxies, the PD workers hold the model
    worker = health(front)["pd_workers"][0]["pid"]
    assert "libtorch" in Path(f"/proc/{worker}/maps").read_text()  # (the check can tell)


def test_the_api_key_guards_the_front_and_the_workers_ports(front):
    assert httpx.get(front.base + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(front.base + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"] == "fovea-shapes"
    # OpenAI's "retrieve model", passed through to a worker, behind the same key.
    assert httpx.get(front.base + "/v1/models/fovea-shapes", timeout=30).status_code == 401
    one = httpx.get(front.base + "/v1/models/fovea-shapes", headers=AUTH, timeout=30)
    assert one.status_code == 200 and one.json()["id"] == "fovea-shapes" and one.json()["object"] == "model"
    other = httpx.get(front.base + "/v1/models/gpt-4o", headers=AUTH, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    body = httpx.get(front.base + "/health", timeout=30).json()  # open, as the single server's is
    for worker in body["pd_workers"]:
        direct = f"http://127.0.0.1:{worker['port']}/v1/models"
        # A worker's loopback port takes only the key the front made, not the clients' own.
        assert httpx.get(direct, timeout=30).status_code == 401
        assert httpx.get(direct, headers=AUTH, timeout=30).status_code == 401


def test_stored_responses_are_found_on_the_worker_that_holds_them(front):
    url = data_url(scenes.render(fresh_scene(81_500)))
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                   {"type": "input_text", "text": QUESTION}]}],
            "store": True, "temperature": 0}

    async def create(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=front.base, headers=AUTH, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/responses", json=body) for _ in range(n)))

    made = asyncio.run(create(8))
    assert [r.status_code for r in made] == [200] * 8, made[0].text
    assert {r.headers[WORKER] for r in made} == {"0", "1"}  # both workers hold some
    with httpx.Client(base_url=front.base, headers=AUTH, timeout=120) as http:
        for reply in made:
            rid, holder = reply.json()["id"], reply.headers[WORKER]
            got = http.get(f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.json() == reply.json() and got.headers[WORKER] == holder
            follow = http.post("/v1/responses", json={"input": "How many shapes are there?",
                                                      "previous_response_id": rid, "store": True})
            assert follow.status_code == 200 and follow.headers[WORKER] == holder, follow.text
            assert follow.json()["usage"]["input_tokens"] > reply.json()["usage"]["input_tokens"]
        rid = made[0].json()["id"]
        assert http.delete(f"/v1/responses/{rid}").json()["deleted"] is True
        for _ in range(2):
            gone = http.get(f"/v1/responses/{rid}")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
        missing = http.post("/v1/responses", json={"input": "hi", "previous_response_id": rid})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
        streamed = http.post("/v1/responses", json={**body, "stream": True, "store": False})
        kinds = [line[7:] for line in streamed.text.splitlines() if line.startswith("event: ")]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_the_same_image_stays_on_one_worker_and_distinct_images_use_both(front):
    before = metrics(front)
    url = data_url(scenes.render(fresh_scene(81_700)))
    with httpx.Client(base_url=front.base, headers=AUTH, timeout=120) as http:
        served = []
        for _ in range(6):  # one after another: the worker that has it cached is never busier than 2 above
            reply = http.post("/v1/chat/completions", json=chat(url, max_tokens=8))
            assert reply.status_code == 200, reply.text
            served.append(reply.headers[WORKER])
    assert len(set(served)) == 1, served
    distinct = [scenes.render(fresh_scene(81_800 + i)) for i in range(8)]
    replies = asyncio.run(post_all(front.base, [chat(image, max_tokens=8) for image in distinct]))
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies if r.status_code != 200][:2]
    assert {r.headers[WORKER] for r in replies} == {"0", "1"}, [r.headers[WORKER] for r in replies]
    after = metrics(front)

    def outcome(name: str) -> float:
        return (metric(after, "fovea_front_affinity_total", outcome=name)
                - metric(before, "fovea_front_affinity_total", outcome=name))

    # The first of the six and the eight distinct ones: no worker held them; the other five: hits.
    assert (outcome("hit"), outcome("miss"), outcome("overloaded")) == (5, 9, 0)
    # What the front routes by; the engine core reports its queue in periodic snapshots, so the
    # last finished request may still be counted for a moment after its reply.
    def drained():
        body = health(front)
        return body if all(w["health"]["queue_depth"] == 0 for w in body["pd_workers"]) else None

    body = wait_for("a PD worker still reports waiting requests", drained, timeout=30)
    for worker in body["pd_workers"]:
        index, share = str(worker["index"]), worker["health"]["kv_free_share"]
        assert 0 < share <= 1
        assert metric(after, "fovea_front_pd_in_flight", pd_worker=index) == 0
        assert 0 < metric(after, "fovea_front_pd_kv_free_share", pd_worker=index) <= 1


# ---- faults ---------------------------------------------------------------------------------
def _events(lines: list[str]) -> list:
    return [line.removeprefix("data: ") if line == "data: [DONE]" else json.loads(line.removeprefix("data: "))
            for line in lines if line.startswith("data: ")]


def test_a_killed_pd_worker_fails_only_its_requests_and_rejoins(front, demo_model):
    image = scenes.render(fresh_scene(82_000))
    uploaded = httpx.post(front.base + "/v1/images", json={"image": data_url(image)}, headers=AUTH, timeout=30)
    image_id = uploaded.json()["id"]
    long = {"max_tokens": 200, "ignore_eos": True}
    images = [scenes.render(fresh_scene(82_100 + i)) for i in range(12)]
    expected = agg_texts(demo_model, images, **long)
    before = health(front)["pd_workers"]

    async def run():
        async with httpx.AsyncClient(base_url=front.base, headers=AUTH, timeout=300) as client:
            first_chunk = asyncio.Event()
            victim: list[str] = []

            async def stream(index: int):
                async with client.stream("POST", "/v1/chat/completions",
                                         json=chat(images[index], stream=True, **long)) as reply:
                    worker, lines = reply.headers[WORKER], []
                    async for line in reply.aiter_lines():
                        lines.append(line)
                        if index == 0 and not first_chunk.is_set():
                            victim.append(worker)
                            first_chunk.set()
                    return worker, _events(lines)

            plain = [asyncio.ensure_future(client.post("/v1/chat/completions", json=chat(im, **long)))
                     for im in images[2:]]
            streams = [asyncio.ensure_future(stream(i)) for i in range(2)]
            await asyncio.wait_for(first_chunk.wait(), 120)
            pid = next(w["pid"] for w in before if str(w["index"]) == victim[0])
            os.kill(pid, signal.SIGKILL)
            return victim[0], await asyncio.gather(*streams), await asyncio.gather(*plain)

    victim, streams, plain = asyncio.run(run())
    other = "1" if victim == "0" else "0"
    # The stream on the killed worker: an error event, then [DONE], and no finish_reason anywhere.
    worker, events = streams[0]
    assert worker == victim and events[-1] == "[DONE]", events[-3:]
    assert events[-2]["error"]["code"] == "pd_worker_lost", events[-2]
    assert not any(e["choices"][0].get("finish_reason") for e in events[:-2] if e.get("choices"))
    # The other stream (its worker lives) ran to its end.
    worker, events = streams[1]
    if worker == other:
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-2:]
    else:  # it landed on the killed worker too
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "pd_worker_lost", events[-2:]
    # Every plain request: answered as agg answers it, or refused as lost by the killed worker.
    for reply, want in zip(plain, expected[2:], strict=True):
        if reply.status_code == 200:
            assert content(reply) == want
        else:
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "pd_worker_lost", reply.text
            assert reply.headers[WORKER] == victim
    assert any(r.status_code == 200 and r.headers[WORKER] == other for r in plain)
    assert any(r.status_code == 503 for r in plain)  # the killed worker held some of them

    def rejoined():
        body = health(front)
        worker = body["pd_workers"][int(victim)]
        return body if worker["state"] == "ready" and worker["restarts"] >= 1 and body["status"] == "ok" else None

    body = wait_for("the killed PD worker did not rejoin", rejoined)
    assert body["pd_workers"][int(victim)]["pid"] != next(w["pid"] for w in before if str(w["index"]) == victim)
    # It serves again, and it was given the image uploaded before it died.
    fresh = [scenes.render(fresh_scene(82_200 + i)) for i in range(6)]
    # Two bursts: the uploaded image's requests alone, so that its worker by affinity (three at
    # most above the other's load) passes the fourth to the other worker, whichever it is.
    again = asyncio.run(post_all(front.base, [chat(im) for im in fresh]))
    again += asyncio.run(post_all(front.base, [chat(image_id) for _ in range(4)]))
    assert [r.status_code for r in again] == [200] * 10, [r.text for r in again if r.status_code != 200][:2]
    assert [content(r) for r in again] == agg_texts(demo_model, fresh) + agg_texts(demo_model, [image]) * 4
    assert victim in {r.headers[WORKER] for r in again[:6]} and victim in {r.headers[WORKER] for r in again[6:]}
    text = metrics(front)
    assert metric(text, "fovea_front_pd_worker_restarts_total", pd_worker=victim) >= 1
    assert metric(text, "fovea_front_pd_worker_lost_total", pd_worker=victim) >= 2  # a stream and a plain one


def test_a_hung_shared_encode_worker_is_killed_by_its_client_and_restarted_by_the_front(front, demo_model):
    before = health(front)["encode_workers"][0]
    os.kill(before["pid"], signal.SIGSTOP)  # alive, never answers: only the PD side's timeout finds it
    images = [scenes.render(fresh_scene(83_000 + i)) for i in range(24)]
    expected = agg_texts(demo_model, images)

    def replaced():
        # Keep sending until a PD worker's pool has sent it a batch, timed out (10 s) and killed it.
        start = replaced.sent
        replaced.sent += 4
        replies = asyncio.run(post_all(front.base, [chat(im) for im in images[start:start + 4]]))
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies if r.status_code != 200]
        assert [content(r) for r in replies] == expected[start:start + 4]
        worker = health(front)["encode_workers"][0]
        return worker["restarts"] >= 1 and worker["pid"] != before["pid"]

    replaced.sent = 0
    try:
        wait_for("the hung encode worker was not replaced", replaced, timeout=90)
    finally:
        if httpx.get(front.base + "/health", timeout=30).json()["encode_workers"][0]["pid"] == before["pid"]:
            os.kill(before["pid"], signal.SIGKILL)

    def reconnected():  # both PD workers' pools are back on the new one
        body = health(front)
        return all(e["state"] == "ready" for w in body["pd_workers"] for e in w["health"]["encode_workers"]) \
            and body["encode_workers"][0]["state"] == "ready"

    wait_for("the PD workers did not reconnect to the new encode worker", reconnected)


def test_a_hung_pd_worker_is_killed_after_the_pd_timeout_and_replaced(front, demo_model):
    before = health(front)["pd_workers"]
    victim = before[0]
    os.kill(victim["pid"], signal.SIGSTOP)  # alive, but answers nothing
    images = [scenes.render(fresh_scene(84_000 + i)) for i in range(6)]
    started = time.monotonic()
    replies = asyncio.run(post_all(front.base, [chat(im) for im in images]))
    # Those it held waited for the --pd-timeout, not for ever, then failed as lost.
    assert time.monotonic() - started < PD_TIMEOUT_S + 60
    for reply, want in zip(replies, agg_texts(demo_model, images), strict=True):
        if reply.status_code == 200:
            assert content(reply) == want
        else:
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "pd_worker_lost", reply.text

    def replaced():
        worker = health(front)["pd_workers"][0]
        return worker if worker["state"] == "ready" and worker["restarts"] > victim["restarts"] else None

    worker = wait_for("the hung PD worker was not replaced", replaced)
    assert worker["pid"] != victim["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(victim["pid"], 0)  # the stopped process is gone, not left behind
    again = asyncio.run(post_all(front.base, [chat(im) for im in images[:4]]))
    assert [r.status_code for r in again] == [200] * 4


def test_sigterm_stops_every_process_and_leaves_nothing_behind(front):
    body = health(front)
    pids = [w["pid"] for w in body["pd_workers"]] + [e["pid"] for e in body["encode_workers"]]
    sockets = [e["socket"] for e in body["encode_workers"]]
    assert all(os.path.exists(s) for s in sockets)
    # Only what these processes hold: /dev/shm is machine-wide, and other servers may be running.
    segments = mapped_segments({front.process.pid, *pids})
    front.process.send_signal(signal.SIGTERM)
    assert front.process.wait(60) == 0
    wait_for("a child of the front outlived it", lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 30)
    assert not any(os.path.exists(s) for s in sockets) and not os.path.exists(os.path.dirname(sockets[0]))
    assert segments & _shm() == set()


# ---- refusals and pieces --------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--ray-pd-resources", '{"GPU": 1}', "--pd-workers", "2"],
     "--ray-pd-resources sizes the Ray actors of --ray-address with --pd-workers"),
    (["--ray-address", "local", "--pd-workers", "2", "--ray-encode-resources", '{"GPU": 1}'],
     "--ray-encode-resources sizes the Ray actors of --ray-address with --pd-workers in --topology e_pd"),
    (["--ray-address", "local", "--pd-workers", "2", "--ray-pd-resources", '{"GPU": 0}'],
     "--ray-pd-resources must be a JSON object of resource names and positive amounts"),
    (["--topology", "e_pd", "--pd-timeout", "5"], "--pd-timeout watches the PD workers of --pd-workers"),
    (["--topology", "e_pd", "--pd-workers", "2", "--pd-timeout", "0"], "--pd-timeout must be a positive"),
])
def test_pd_worker_flags_that_do_not_fit_are_refused_in_one_line(flags, message, capsys):
    # Each refusal comes from the settings' checks, before anything starts (no Ray, no port).
    assert main(["serve", "--device", "cpu", "--no-canary", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_pd_workers_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--topology", "e_pd", "--pd-workers", "0"])
    assert "argument --pd-workers: must be at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--pd-workers must be at least 1"):
        ServerSettings(topology="e_pd", pd_workers=0)


def test_without_a_ready_pd_worker_requests_get_503_pd_unavailable_and_health_is_degraded():
    from starlette.testclient import TestClient

    from fovea.front.app import create_front_app
    from fovea.front.encoders import EncodeFleet
    from fovea.front.pd_fleet import PdFleet

    encoders = EncodeFleet(1, b"key", ())  # never started: nothing is ready
    fleet = PdFleet(2, [], encoders.sockets, "internal", b"key")
    for worker in fleet.workers:
        worker.state = "dead"
    try:
        client = TestClient(create_front_app(ServerSettings(topology="e_pd", pd_workers=2), fleet, encoders))
        reply = client.post("/v1/chat/completions", json={"messages": []})  # no lifespan: no children start
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "pd_unavailable", reply.text
        assert client.post("/v1/images", content=b"x").json()["error"]["code"] == "pd_unavailable"
        body = client.get("/health").json()
        assert body["status"] == "degraded" and len(body["reasons"]) == 2, body
        assert [w["error"] for w in body["pd_workers"]] == ["not running (dead)"] * 2
        # The small endpoints: answered by the front itself, or routed to a worker like chat.
        assert client.get("/version").json() == {"version": __version__}
        head = client.head("/metrics")
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
        for path in ("/tokenize", "/detokenize"):
            assert client.post(path, json={"prompt": "hi"}).json()["error"]["code"] == "pd_unavailable"
    finally:
        encoders.stop()
    assert not os.path.exists(encoders.directory)


def test_the_workers_metrics_are_summed_and_their_gauges_kept_apart():
    one = ('# TYPE fovea_requests_total counter\nfovea_requests_total{route="/a",status="200"} 2.0\n'
           '# TYPE fovea_h histogram\nfovea_h_bucket{le="1.0"} 1.0\nfovea_h_bucket{le="+Inf"} 2.0\n'
           'fovea_h_count 2.0\nfovea_h_sum 3.5\n# TYPE fovea_q gauge\nfovea_q 3.0\n'
           '# TYPE fovea_h_created gauge\nfovea_h_created 1.7e9\n')
    two = one.replace("} 2.0\n# TYPE fovea_h", "} 5.0\n# TYPE fovea_h").replace("fovea_q 3.0", "fovea_q 4.0")
    text = merge({0: one, 1: two}).decode()
    assert metric(text, "fovea_requests_total", route="/a", status="200") == 7
    assert metric(text, "fovea_h_count") == 4 and metric(text, "fovea_h_sum") == 7
    assert metric(text, "fovea_h_bucket", le="+Inf") == 4 and metric(text, "fovea_h_bucket", le="1.0") == 2
    assert metric(text, "fovea_q", pd_worker="0") == 3 and metric(text, "fovea_q", pd_worker="1") == 4
    assert "_created" not in text


def test_a_joining_worker_gets_the_uploads_recorded_while_it_joins():
    now = [0.0]
    record = UploadRecord(max_bytes=100, ttl_s=60, clock=lambda: now[0])
    record.add("img-a", b"a" * 40, "application/json")
    record.add("img-b", b"b" * 40, "application/json")
    got: list[str] = []

    async def upload(item):
        got.append(item.body[:1].decode())
        if item.body[:1] == b"a":  # while it joins: one more upload, one delete
            record.add("img-c", b"c" * 10, "application/json")
            record.remove("img-b")

    async def delete(image_id: str):
        got.append("-" + image_id)

    asyncio.run(sync(record, upload, delete))
    assert got == ["a", "b", "c", "-img-b"]
    record.add("img-d", b"d" * 60, "image/png")  # over 100 bytes: the oldest goes
    assert list(record.live()) == ["img-c", "img-d"]
    now[0] = 61.0
    assert record.live() == {}
