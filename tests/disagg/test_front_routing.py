"""The front's routing between PD workers (fovea.front.routing): the keys a request's images
give, the bounded table of who holds them, and the rule that weighs affinity against load.
Pure: no process, no model."""

from __future__ import annotations

import json

import pytest

from fovea.front.pd_fleet import PdFleet, PdWorker
from fovea.front.routing import AffinityTable, affinity_keys, choose, image_key, slack, take_health

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
OTHER = PNG[:-6] + "AAAAAA"
IMAGE_ID = "img-" + "ab" * 16


def body(payload) -> bytes:
    return json.dumps(payload).encode()


def chat(*urls: str, video: str | None = None) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    if video is not None:
        parts.append({"type": "video_url", "video_url": {"url": video}})
    return body({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]})


# ---- keys ---------------------------------------------------------------------------------
def test_chat_images_are_keyed_by_their_reference_in_order_without_repeats():
    keys = affinity_keys(chat(PNG, "https://example.com/cat.jpg", PNG, IMAGE_ID, video="file:///v/clip.mp4"))
    assert keys == tuple(image_key(r) for r in (PNG, "https://example.com/cat.jpg", IMAGE_ID, "file:///v/clip.mp4"))
    assert len(set(keys)) == 4 and all(len(k) == 16 for k in keys)
    # The same bytes give the same key, other bytes another; surrounding whitespace is the worker's to strip.
    assert affinity_keys(chat(PNG)) == affinity_keys(chat(" " + PNG + "\n")) != affinity_keys(chat(OTHER))


def test_responses_input_images_by_url_and_by_uploaded_file_id():
    payload = {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG},
                                     {"type": "input_text", "text": "and"},
                                     {"type": "input_image", "file_id": IMAGE_ID}]},
        {"type": "function_call_output", "call_id": "c", "output": "42"}]}
    assert affinity_keys(body(payload)) == (image_key(PNG), image_key(IMAGE_ID))
    # An uploaded id keys the same in chat and in the Responses API: the same image wherever it is sent.
    assert affinity_keys(chat(IMAGE_ID)) == (image_key(IMAGE_ID),)


def test_completions_images_and_generate_image():
    assert affinity_keys(body({"prompt": "<image> what?", "images": [IMAGE_ID, PNG]})) == \
        (image_key(IMAGE_ID), image_key(PNG))
    assert affinity_keys(body({"prompt": "what?", "image": PNG})) == (image_key(PNG),)


@pytest.mark.parametrize("raw", [
    body({"model": "m", "messages": [{"role": "user", "content": "hello"}]}),  # no image bytes: not parsed
    body({"model": "m", "input": "describe the image"}),  # the word, no image
    body({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]}),
    body({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 7}]}]}),
    body({"messages": "image", "input": {"image_url": PNG}, "images": PNG}),  # wrong shapes
    body(["image_url", PNG]),  # not an object
    b'{"messages": [{"content": [{"type": "image_url", "image_url": {"url": "data:',  # cut short
    b"\xff\xfeimage",  # not even text
    b"",
])
def test_no_keys_for_bodies_without_an_image_or_that_are_not_json(raw):
    assert affinity_keys(raw) == ()


def test_a_body_without_image_bytes_is_not_parsed(monkeypatch):
    from types import SimpleNamespace

    from fovea.front import routing

    def refuse(_):
        raise AssertionError("parsed")

    monkeypatch.setattr(routing, "json", SimpleNamespace(loads=refuse))
    assert affinity_keys(body({"messages": [{"role": "user", "content": "x" * 100_000}]})) == ()
    with pytest.raises(AssertionError, match="parsed"):
        affinity_keys(chat(PNG))  # (the check can tell)


# ---- the table ----------------------------------------------------------------------------
def test_the_table_is_bounded_least_recently_routed_first():
    table = AffinityTable(max_entries=3)
    table.record([b"a", b"b"], 0)
    table.record([b"c"], 1)
    table.record([b"a"], 1)  # a: routed again (to 1), so b is now the oldest
    table.record([b"d"], 0)
    assert len(table) == 3 and set(table.entries) == {b"a", b"c", b"d"}
    assert table.holders([b"a", b"b", b"c", b"d"]) == {1: 2, 0: 1}
    table.record([bytes([i]) for i in range(10)], 2)
    assert len(table) == 3 and table.holders([bytes([i]) for i in range(10)]) == {2: 3}


def test_the_default_bound():
    table = AffinityTable()
    table.record((i.to_bytes(4, "little") for i in range(70_000)), 0)
    assert len(table) == 65_536 and table.holders([(69_999).to_bytes(4, "little"), b"\0\0\0\0"]) == {0: 1}


# ---- the rule -----------------------------------------------------------------------------
def workers(*loads: int, kv: tuple[float | None, ...] = ()) -> list[PdWorker]:
    out = []
    for i, load in enumerate(loads):
        w = PdWorker(i, state="ready", in_flight=load)
        w.kv_free = kv[i] if kv else None
        out.append(w)
    return out


def test_a_holder_within_the_slack_is_chosen():
    ws, table = workers(2, 0), AffinityTable()
    table.record([b"x"], 0)
    assert choose(ws, (b"x",), table) == (ws[0], "hit")  # 2 <= 0 + 2
    ws[1].in_flight = 12  # now 0 is the least loaded anyway
    assert choose(ws, (b"x",), table) == (ws[0], "hit")


def test_an_overloaded_holder_is_passed_over_for_the_least_loaded():
    ws, table = workers(3, 0), AffinityTable()
    table.record([b"x"], 0)
    assert choose(ws, (b"x",), table) == (ws[1], "overloaded")  # 3 > 0 + 2
    ws[0].in_flight, ws[0].waiting = 1, 2  # its engine's queue counts too (as its /health said)
    assert choose(ws, (b"x",), table) == (ws[1], "overloaded")
    # At higher loads the slack is a quarter of the least load: 40 + 10.
    ws[0].in_flight, ws[0].waiting, ws[1].in_flight = 50, 0, 40
    assert slack(40) == 10 and choose(ws, (b"x",), table) == (ws[0], "hit")
    ws[0].in_flight = 51
    assert choose(ws, (b"x",), table) == (ws[1], "overloaded")


def test_a_holder_short_of_kv_cache_is_passed_over_when_another_has_more():
    ws, table = workers(1, 0, kv=(0.02, 0.6)), AffinityTable()
    table.record([b"x"], 0)
    assert choose(ws, (b"x",), table) == (ws[1], "overloaded")
    ws[1].kv_free = 0.01  # the least loaded has even less: the holder keeps it
    assert choose(ws, (b"x",), table) == (ws[0], "hit")
    ws[0].kv_free, ws[1].kv_free = 0.02, None  # unknown: the floor is not applied
    assert choose(ws, (b"x",), table) == (ws[0], "hit")


def test_the_worker_holding_most_of_the_keys_is_the_candidate():
    ws, table = workers(1, 1, 0), AffinityTable()
    table.record([b"a"], 0)
    table.record([b"b", b"c"], 1)
    assert choose(ws, (b"a", b"b", b"c"), table) == (ws[1], "hit")
    # One each: the less loaded holder, then the one sent fewer.
    ws[0].in_flight = 2
    assert choose(ws, (b"a", b"b"), table) == (ws[1], "hit")
    ws[0].in_flight, ws[0].routed, ws[1].routed = 1, 5, 9
    assert choose(ws, (b"a", b"b"), table) == (ws[0], "hit")


def test_misses_and_requests_without_images_go_to_the_least_loaded_ties_to_the_fewest_routed():
    ws, table = workers(1, 0, 0), AffinityTable()
    ws[1].routed, ws[2].routed = 7, 3
    assert choose(ws, (), table) == (ws[2], "none")
    assert choose(ws, (b"new",), table) == (ws[2], "miss")
    table.record([b"x"], 2)
    assert choose(ws[:2], (b"x",), table) == (ws[1], "miss")  # its holder is not among the candidates
    assert choose([], (b"x",), table) == (None, "miss") and choose([], (), table) == (None, "none")


def test_the_fleet_chooses_among_ready_workers_not_yet_tried():
    fleet = PdFleet(3, [], [], "internal", b"key")
    for w in fleet.workers:
        w.state = "ready"
    fleet.workers[2].state = "dead"
    table = AffinityTable()
    table.record([b"x"], 2)
    assert fleet.choose(set(), (b"x",), table) == (fleet.workers[0], "miss")  # its holder is dead
    table.record([b"x"], 1)
    assert fleet.choose(set(), (b"x",), table) == (fleet.workers[1], "hit")
    assert fleet.choose({1}, (b"x",), table) == (fleet.workers[0], "miss")  # retried elsewhere
    assert fleet.choose({0, 1}, (b"x",), table) == (None, "miss")


def test_a_worker_a_connection_failed_to_is_passed_over_until_its_health_answers_again():
    fleet = PdFleet(2, [], [], "internal", b"key")
    down: set[int] = set()
    for index, worker in enumerate(fleet.workers):
        worker.state, worker.child = "ready", PlacedAt(42_000 + index, down)
        worker.answered_at = 1.0
    table = AffinityTable()
    table.record([b"x"], 1)
    assert fleet.choose(set(), (b"x",), table) == (fleet.workers[1], "hit")
    # Its process is not known to be gone (Ray sees a removed node late): ready, but doubted.
    assert fleet.suspect(fleet.workers[1]) is False
    assert fleet.workers[1].state == "ready" and fleet.workers[1].doubted
    assert fleet.workers[1].status()["doubted"] is True and fleet.workers[0].status()["doubted"] is False
    assert fleet.choose(set(), (b"x",), table) == (fleet.workers[0], "miss")
    # Every worker doubted: a try rather than a refusal.
    fleet.suspect(fleet.workers[0])
    assert fleet.choose(set(), (b"x",), table) == (fleet.workers[1], "hit")
    # A /health asked after the failure answered: trusted again.
    fleet.workers[1].answered_at = fleet.workers[1].failed_at + 0.001
    assert not fleet.workers[1].doubted
    assert fleet.choose({1}, (b"x",), table) == (fleet.workers[0], "miss")
    # One whose process is gone is dead at once, not doubted.
    down.add(42_000)
    assert fleet.suspect(fleet.workers[0]) is True and fleet.workers[0].state == "dead"


def test_a_restarted_worker_loses_its_entries():
    table = AffinityTable()
    table.record([b"a", b"b"], 0)
    table.record([b"c"], 1)
    table.forget(0)
    assert table.holders([b"a", b"b", b"c"]) == {1: 1}
    ws = workers(0, 5)
    assert choose(ws, (b"a",), table) == (ws[0], "miss")


def test_the_front_app_chains_the_restart_hook_and_shows_the_load_it_routes_by():
    from starlette.testclient import TestClient

    from fovea.config import ServerSettings
    from fovea.front.app import create_front_app
    from fovea.front.encoders import EncodeFleet

    encoders = EncodeFleet(1, b"key", ())  # never started; no lifespan: no child starts
    fleet = PdFleet(2, [], encoders.sockets, "internal", b"key")
    try:
        app = create_front_app(ServerSettings(topology="e_pd", pd_workers=2), fleet, encoders)
        table = app.state.proxy.affinity
        table.record([b"a", b"b"], 1)
        table.record([b"c"], 0)
        fleet.on_restart(fleet.workers[1])
        assert table.holders([b"a", b"b", b"c"]) == {0: 1}
        fleet.workers[0].in_flight, fleet.workers[0].waiting, fleet.workers[0].kv_free = 3, 2, 0.25
        text = TestClient(app).get("/metrics").text
    finally:
        encoders.stop()
    assert 'fovea_front_pd_worker_restarts_total{pd_worker="1"} 1.0' in text  # the hook it chained to still counts
    assert 'fovea_front_pd_in_flight{pd_worker="0"} 3.0' in text and 'fovea_front_pd_waiting{pd_worker="0"} 2.0' in text
    assert 'fovea_front_pd_kv_free_share{pd_worker="0"} 0.25' in text
    assert 'fovea_front_pd_kv_free_share{pd_worker="1"}' not in text  # not reported: no series
    assert all(f'fovea_front_affinity_total{{outcome="{o}"}} 0.0' in text for o in ("hit", "overloaded", "miss", "none"))


class PlacedAt:
    """A PD worker's child that runs nowhere: placed on a loopback port the test's transport answers,
    and exited once that port is in ``down``."""

    def __init__(self, port: int, down: set[int]) -> None:
        from fovea.front.ray_hosts import Placement

        self.placement, self.pid, self.down = Placement(node="local", host="127.0.0.1", port=port, pid=0, dir=""), \
            None, down

    def placed(self):
        return self.placement

    def exited(self) -> bool:
        return self.placement.port in self.down

    def exit_code(self) -> int | None:
        return -9 if self.exited() else None


def test_the_proxy_routes_by_affinity_records_where_it_sent_and_retries_an_unreachable_worker():
    import httpx
    from starlette.testclient import TestClient

    from fovea.config import ServerSettings
    from fovea.front.app import create_front_app
    from fovea.front.encoders import EncodeFleet

    encoders = EncodeFleet(1, b"key", ())
    fleet = PdFleet(2, [], encoders.sockets, "internal", b"key")
    down: set[int] = set()
    for index, worker in enumerate(fleet.workers):
        worker.state, worker.child = "ready", PlacedAt(41_000 + index, down)

    dropping: set[int] = set()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.port in down:
            raise httpx.ConnectError("refused", request=request)
        if request.url.port in dropping:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(200, json={"port": request.url.port})

    try:
        app = create_front_app(ServerSettings(topology="e_pd", pd_workers=2), fleet, encoders)
        proxy = app.state.proxy
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))  # no lifespan: set here
        client = TestClient(app)

        def send(payload: bytes) -> str:
            reply = client.post("/v1/chat/completions", content=payload, headers={"content-type": "application/json"})
            assert reply.status_code == 200, reply.text
            return reply.headers["x-fovea-pd-worker"]

        fleet.workers[0].routed = 1  # so a miss goes to worker 1
        assert [send(chat(PNG)) for _ in range(3)] == ["1", "1", "1"]  # a miss, then hits
        assert send(chat(OTHER)) == "0"  # another image: the least routed
        assert proxy.affinity.holders(affinity_keys(chat(PNG))) == {1: 1}
        down.add(41_001)  # its holder cannot be reached: sent to the other, which holds it from then on
        assert send(chat(PNG)) == "0" and fleet.workers[1].state == "dead"
        assert proxy.affinity.holders(affinity_keys(chat(PNG))) == {0: 1}
        assert [w.in_flight for w in fleet.workers] == [0, 0]
        # A worker that drops a request while its process still looks alive loses that request
        # (503 pd_worker_lost) and, doubted, is passed over by the image's next request.
        down.discard(41_001)  # worker 1 back (restarted)
        fleet.workers[1].state, fleet.workers[1].answered_at = "ready", 1.0
        dropping.add(41_000)
        lost = client.post("/v1/chat/completions", content=chat(PNG), headers={"content-type": "application/json"})
        assert lost.status_code == 503 and lost.json()["error"]["code"] == "pd_worker_lost"
        assert lost.headers["x-fovea-pd-worker"] == "0" and fleet.workers[0].doubted
        assert send(chat(PNG)) == "1"
        text = client.get("/metrics").text
    finally:
        encoders.stop()
    counts = {o: f'fovea_front_affinity_total{{outcome="{o}"}}' for o in ("hit", "miss", "overloaded", "none")}
    # The retry counted once, as a miss; the lost request as the hit it was, the one after it as a miss.
    assert f'{counts["hit"]} 3.0' in text and f'{counts["miss"]} 4.0' in text
    assert f'{counts["overloaded"]} 0.0' in text and f'{counts["none"]} 0.0' in text


# ---- what a worker's /health says ---------------------------------------------------------
def test_the_health_body_gives_waiting_and_kv_free():
    worker = PdWorker(0)
    take_health(worker, body({"status": "ok", "queue_depth": 4, "kv_free_share": 0.375}))
    assert (worker.waiting, worker.kv_free) == (4, 0.375)
    take_health(worker, body({"status": "ok", "queue_depth": 1, "kv_free_share": None}))
    assert (worker.waiting, worker.kv_free) == (1, None)
    for bad in (b"<html>", body([1]), body({"queue_depth": "x", "kv_free_share": "y"})):
        take_health(worker, bad)
        assert (worker.waiting, worker.kv_free) == (0, None)


def test_a_request_cancelled_while_its_worker_works_leaves_no_load_counted():
    """The client goes away while the front waits on the worker (its task is cancelled): the
    worker's in-flight count, which routes every later request, is back where it was."""
    import asyncio

    import httpx
    from starlette.requests import Request

    from fovea.config import ServerSettings
    from fovea.front.app import create_front_app
    from fovea.front.encoders import EncodeFleet

    encoders = EncodeFleet(1, b"key", ())
    fleet = PdFleet(2, [], encoders.sockets, "internal", b"key")
    for index, worker in enumerate(fleet.workers):
        worker.state, worker.child = "ready", PlacedAt(42_000 + index, set())

    async def scenario() -> None:
        reached = asyncio.Event()

        async def answer(request: httpx.Request) -> httpx.Response:
            reached.set()
            await asyncio.sleep(3600)  # a long generation: the client leaves first
            raise AssertionError("not reached")

        proxy = create_front_app(ServerSettings(topology="e_pd", pd_workers=2), fleet, encoders).state.proxy
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        body = chat(PNG)

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")], "scheme": "http",
                 "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "root_path": ""}
        task = asyncio.create_task(proxy.one(Request(scope, receive)))
        await asyncio.wait_for(reached.wait(), 30)
        assert sorted(w.in_flight for w in fleet.workers) == [0, 1]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [w.in_flight for w in fleet.workers] == [0, 0]
        await proxy.client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        encoders.stop()
