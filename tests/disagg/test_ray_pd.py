"""``fovea serve --ray-address ADDR --pd-workers M``: PD workers and encode workers as Ray actors on
a local multi-node cluster (``ray.cluster_utils.Cluster``), every node and process on loopback.

Node A has room for one PD worker and the encode worker, node B for one PD worker: the PD
worker on A reaches the encode worker through shared memory, the one on B over TCP, and both
must answer as agg does. Then node B is removed (its raylet killed): only its requests fail,
and its replica comes back on node C, which joins afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from process_helpers import stop_process
from scene_helpers import free_port, fresh_scene
from test_pd_workers import agg_texts, chat, content, metric, wait_for

import fovea
from fovea.demo import scenes
from fovea.disagg.ray_workers import connect

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

KEY = "ray-pd-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
LOOPBACK = "127.0.0.1"
NODE = {"node_ip_address": LOOPBACK, "object_store_memory": 128 * 2**20, "include_dashboard": False}


@dataclass
class RayFront:
    base: str
    process: subprocess.Popen
    cluster: Cluster
    nodes: dict


def health(front: RayFront) -> dict:
    return httpx.get(front.base + "/health", headers=AUTH, timeout=30).json()


def ready_workers(front: RayFront) -> list[dict]:
    return [w for w in health(front)["pd_workers"] if w["state"] == "ready"]


def start_front(cluster: Cluster, nodes: dict, log: Path, *flags: str) -> RayFront:
    """A front on ``cluster`` with two PD workers placed on nodes with ``fovea_pd``, ready."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fovea.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "fovea.cli", "--log-level", "info", "serve", *flags,
             "--pd-workers", "2", "--ray-address", cluster.address,
             "--ray-pd-resources", '{"CPU": 1, "fovea_pd": 1}', "--device", "cpu", "--dtype", "float32",
             "--no-canary", "--host", LOOPBACK, "--port", str(port), "--pd-timeout", "60",
             "--max-queue", "1024", "--api-key", KEY], env=env, stdout=out, stderr=subprocess.STDOUT)
    front = RayFront(f"http://{LOOPBACK}:{port}", process, cluster, nodes)
    front.log = log  # type: ignore[attr-defined]

    def up():
        assert process.poll() is None, f"the front exited with code {process.returncode}: {log.read_text()[-3000:]}"
        return len(ready_workers(front)) == 2

    try:
        wait_for("the Ray front and its workers were not ready", up, timeout=300)
    except BaseException:
        stop_process(process)
        raise
    return front


@pytest.fixture(scope="module")
def ray_front(tmp_path_factory):
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 1})
    nodes = {"A": cluster.add_node(**NODE, num_cpus=2, resources={"fovea_pd": 1, "fovea_encode": 1}),
             "B": cluster.add_node(**NODE, num_cpus=2, resources={"fovea_pd": 1})}
    cluster.wait_for_nodes()
    try:
        front = start_front(cluster, nodes, tmp_path_factory.mktemp("ray-front") / "front.log",
                            "--topology", "e_pd", "--encode-workers", "1", "--ray-encode-resources",
                            '{"CPU": 1, "fovea_encode": 1}', "--encode-timeout", "20")
        try:
            yield front
        finally:
            stop_process(front.process)
    finally:
        cluster.shutdown()


def node_of(front: RayFront, name: str) -> str:
    return front.nodes[name].node_id


async def post_all(base: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=300,
                                 limits=httpx.Limits(max_connections=128)) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def test_64_concurrent_requests_answer_as_agg_on_both_nodes_and_the_hand_off_is_logged_per_pair(ray_front,
                                                                                                  demo_model):
    workers = ready_workers(ray_front)
    assert {w["node"] for w in workers} == {node_of(ray_front, "A"), node_of(ray_front, "B")}
    images = [scenes.render(fresh_scene(91_000 + i)) for i in range(64)]
    expected = agg_texts(demo_model, images)
    replies = asyncio.run(post_all(ray_front.base, [chat(image) for image in images]))
    assert [r.status_code for r in replies] == [200] * 64, [r.text for r in replies if r.status_code != 200][:2]
    assert [content(r) for r in replies] == expected
    assert {r.headers["x-fovea-pd-worker"] for r in replies} == {"0", "1"}
    # The PD worker beside the encode worker uses shared memory, the other TCP; both verified
    # the same header and checksum (a mismatch would have failed its requests).
    log = ray_front.log.read_text(errors="replace")  # type: ignore[attr-defined]
    assert "encode worker 0 -> this PD worker" in log
    assert "shared memory, Unix socket" in log and "TCP to 127.0.0.1:" in log
    body = httpx.get(ray_front.base + "/metrics", headers=AUTH, timeout=30).text
    assert metric(body, "fovea_modality_mismatch_errors_total") == 0


def routing_view_idle(front: RayFront) -> str | None:
    """/metrics once the load the front routes by is nil at every PD worker. Its view of a worker's
    queue is that worker's last /health, read every second: for up to a second after a burst it may
    still see a queue, and rightly pass a holder over as overloaded."""
    body = httpx.get(front.base + "/metrics", headers=AUTH, timeout=30).text
    loads = [metric(body, name, pd_worker=index) for name in ("fovea_front_pd_in_flight", "fovea_front_pd_waiting")
             for index in ("0", "1")]
    return body if not any(loads) else None


def test_a_repeated_image_goes_to_the_replica_that_encoded_it(ray_front, demo_model):
    images = [scenes.render(fresh_scene(94_000 + i)) for i in range(2)]
    expected = agg_texts(demo_model, images)
    # (after the 64-request burst above: the affinity rule is asserted for workers the front sees idle)
    body = wait_for("the front to see its PD workers idle", lambda: routing_view_idle(ray_front), timeout=30)
    hits = metric(body, "fovea_front_affinity_total", outcome="hit")
    for image, answer in zip(images, expected, strict=True):
        replies = [httpx.post(ray_front.base + "/v1/chat/completions", json=chat(image), headers=AUTH, timeout=120)
                   for _ in range(4)]
        assert [content(r) for r in replies] == [answer] * 4
        served = [r.headers["x-fovea-pd-worker"] for r in replies]
        if len(set(served)) != 1:  # all four where the first went; else show what the front saw
            body = httpx.get(ray_front.base + "/metrics", headers=AUTH, timeout=30).text
            seen = {line for line in body.splitlines() if line.startswith(("fovea_front_pd_", "fovea_front_affinity"))}
            workers = [{k: w.get(k) for k in ("index", "state", "doubted")} for w in health(ray_front)["pd_workers"]]
            raise AssertionError(f"served by {served}; the front's view now: {sorted(seen)}; workers {workers}")
    body = httpx.get(ray_front.base + "/metrics", headers=AUTH, timeout=30).text
    assert metric(body, "fovea_front_affinity_total", outcome="hit") - hits == 6  # the three repeats of each


def test_the_api_key_is_enforced_at_the_front(ray_front):
    image = scenes.render(fresh_scene(92_000))
    assert httpx.post(ray_front.base + "/v1/chat/completions", json=chat(image), timeout=60).status_code == 401
    wrong = {"authorization": "Bearer not-the-key"}
    assert httpx.post(ray_front.base + "/v1/chat/completions", json=chat(image), headers=wrong,
                      timeout=60).status_code == 401
    assert httpx.post(ray_front.base + "/v1/chat/completions", json=chat(image), headers=AUTH,
                      timeout=60).status_code == 200


def test_a_removed_node_loses_only_its_requests_and_its_replica_returns_on_a_node_that_joins(ray_front, demo_model):
    by_node = {w["node"]: w["index"] for w in ready_workers(ray_front)}
    doomed = by_node[node_of(ray_front, "B")]
    images = [scenes.render(fresh_scene(93_000 + i)) for i in range(16)]
    expected = agg_texts(demo_model, images, max_tokens=40)

    async def during_removal() -> list[httpx.Response | Exception]:
        async with httpx.AsyncClient(base_url=ray_front.base, headers=AUTH, timeout=300) as client:
            sent = [asyncio.create_task(client.post("/v1/chat/completions", json=chat(image))) for image in images]
            await asyncio.sleep(0.5)
            await asyncio.to_thread(ray_front.cluster.remove_node, ray_front.nodes["B"], False)
            return await asyncio.gather(*sent, return_exceptions=True)

    replies = asyncio.run(during_removal())
    assert not [r for r in replies if isinstance(r, Exception)]
    for reply, answer in zip(replies, expected, strict=True):
        if reply.status_code == 200:
            assert content(reply) == answer
        else:  # only the removed node's replica may lose requests, and it says so
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "pd_worker_lost", reply.text
            assert reply.headers["x-fovea-pd-worker"] == str(doomed)
    # Within a few seconds the front stops sending to it (a lost request or a refused /health
    # makes it doubted; Ray reports the actor dead later), and the other replica answers meanwhile.
    wait_for("the front still routes to the removed node's replica",
             lambda: not any(w["index"] == doomed and w["state"] == "ready" and not w["doubted"]
                             for w in health(ray_front)["pd_workers"]), timeout=30)
    meanwhile = httpx.post(ray_front.base + "/v1/chat/completions", json=chat(images[0]), headers=AUTH, timeout=120)
    assert meanwhile.status_code == 200, (meanwhile.status_code, meanwhile.text, health(ray_front))
    assert content(meanwhile) == expected[0] and meanwhile.headers["x-fovea-pd-worker"] != str(doomed)
    # No node has room for it until node C joins; then Ray places it there and the front starts it.
    ray_front.nodes["C"] = ray_front.cluster.add_node(**NODE, num_cpus=2, resources={"fovea_pd": 1})
    back = wait_for("the lost replica did not return on the new node",
                    lambda: next((w for w in ready_workers(ray_front) if w["index"] == doomed
                                  and w["node"] == node_of(ray_front, "C")), None), timeout=240)
    assert back["restarts"] >= 1
    again = asyncio.run(post_all(ray_front.base, [chat(image) for image in images]))
    assert [content(r) for r in again] == expected
    assert str(doomed) in {r.headers["x-fovea-pd-worker"] for r in again}


def alive_hosts() -> list[dict]:
    """The ProcessHost actors that the cluster's control store (GCS) holds alive; read from the GCS,
    not the state API, because these nodes run no dashboard."""
    from ray._private import state

    return [a for a in state.actors().values() if a["ActorClassName"] == "ProcessHost" and a["State"] == "ALIVE"]


def test_sigterm_leaves_no_actor_and_no_process_behind(ray_front):
    pids = [w["pid"] for w in health(ray_front)["pd_workers"] if w["pid"]]
    connect(ray_front.cluster.address)  # on loopback, as the front joined it
    try:
        assert alive_hosts()
        ray_front.process.send_signal(signal.SIGTERM)
        assert ray_front.process.wait(90) == 0
        wait_for("actors were left alive", lambda: not alive_hosts(), timeout=60)
    finally:
        ray.shutdown()
    for pid in pids:
        wait_for(f"PD worker process {pid} was left running", lambda pid=pid: not Path(f"/proc/{pid}").exists(),
                 timeout=30)


def test_agg_replicas_on_ray_answer_as_agg_on_two_nodes(ray_front, demo_model, tmp_path):
    # Runs after the SIGTERM test above stopped the e_pd front: nodes A and C (B was removed) have
    # room for a PD worker each.
    replicas = start_front(ray_front.cluster, ray_front.nodes, tmp_path / "agg-front.log", "--topology", "agg")
    try:
        workers = ready_workers(replicas)
        assert len({w["node"] for w in workers}) == 2  # one replica on each node with room
        images = [scenes.render(fresh_scene(95_000 + i)) for i in range(16)]
        replies = asyncio.run(post_all(replicas.base, [chat(image) for image in images]))
        assert [content(r) for r in replies] == agg_texts(demo_model, images)
        assert {r.headers["x-fovea-pd-worker"] for r in replies} == {"0", "1"}
        assert "-> this PD worker" not in replicas.log.read_text(errors="replace")  # type: ignore[attr-defined]
        replicas.process.send_signal(signal.SIGTERM)
        assert replicas.process.wait(90) == 0
    finally:
        stop_process(replicas.process)
