"""fovea.timing: a request's own encoder latency, time to first token and decode speed."""

from __future__ import annotations

import json

import httpx
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes
from fovea.engine.vision.vision_timings import VisionTimings


def chat(base: str, url: str | None, stream: bool = False, **fovea) -> httpx.Response:
    content = ([{"type": "image_url", "image_url": {"url": url}}] if url else []) + [
        {"type": "text", "text": "Describe the image."}]
    return httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": content}], "stream": stream, "fovea": fovea})


def last_fovea_chunk(reply: httpx.Response) -> dict:
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    with_ext = [c for c in chunks if "fovea" in c]
    assert len(with_ext) == 1 and with_ext[0]["choices"][0]["finish_reason"] is not None
    return with_ext[0]["fovea"]


def test_encoder_time_is_reported_then_the_cache_hit(live_server):
    url = data_url(scenes.render(fresh_scene(401)))
    first = chat(live_server.base_url, url, timing=True).json()["fovea"]["timing"]
    assert first["images_encoded"] == 1 and first["images_cached"] == 0 and first["encoder_ms"] > 0
    assert 0 < first["first_token_ms"] <= first["total_ms"]
    # The first token's two phases in the engine: the wait for a step, then vision and prefill.
    assert first["queue_ms"] >= 0 and first["prefill_ms"] > 0
    assert abs(first["queue_ms"] + first["prefill_ms"] - first["first_token_ms"]) <= 0.002  # three rounded ms
    assert first["completion_tokens"] > 1 and first["decode_tokens_per_s"] > 0
    again = last_fovea_chunk(chat(live_server.base_url, url, stream=True, timing=True))["timing"]
    assert again["images_encoded"] == 0 and again["images_cached"] == 1 and again["encoder_ms"] == 0


def metric_samples(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_first_tokens_phases_reach_the_metrics(live_server):
    """Each finished request adds one prepare (API), queue and prefill (engine) observation, and
    the engine's two phases add up to its time to first token."""
    before = metric_samples(live_server.base_url)
    chat(live_server.base_url, data_url(scenes.render(fresh_scene(403))))
    after = metric_samples(live_server.base_url)
    grew = {name: after[f"fovea_{name}_count"] - before.get(f"fovea_{name}_count", 0.0)
            for name in ("request_prepare_seconds", "request_queue_seconds", "request_prefill_seconds",
                         "time_to_first_token_seconds")}
    assert grew == {"request_prepare_seconds": 1, "request_queue_seconds": 1, "request_prefill_seconds": 1,
                    "time_to_first_token_seconds": 1}
    added = {name: after[f"fovea_{name}_sum"] - before.get(f"fovea_{name}_sum", 0.0)
             for name in ("request_prepare_seconds", "request_queue_seconds", "request_prefill_seconds",
                          "time_to_first_token_seconds")}
    assert added["request_prepare_seconds"] > 0 and added["request_prefill_seconds"] > 0
    assert abs(added["request_queue_seconds"] + added["request_prefill_seconds"]
               - added["time_to_first_token_seconds"]) < 1e-6


def test_timing_without_an_image_and_only_when_asked(live_server):
    text_only = chat(live_server.base_url, None, timing=True).json()["fovea"]["timing"]
    assert text_only["encoder_ms"] == 0 and text_only["images_encoded"] == 0
    plain = chat(live_server.base_url, data_url(scenes.render(fresh_scene(402)))).json()
    assert "fovea" not in plain
    refused = chat(live_server.base_url, None, timing="yes please")
    assert refused.status_code == 400


class FakeEvent:
    def __init__(self, done: bool, ms: float = 0.0) -> None:
        self.done, self.ms = done, ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms


class Prompt:  # any object that can be weakly referenced
    pass


def test_gpu_calls_report_once_their_events_have_passed():
    timings, prompt = VisionTimings(), Prompt()
    assert timings.begin(prompt) and not timings.begin(prompt)  # later prefill chunks are not new
    begin, end = FakeEvent(True, 1.0), FakeEvent(False, 3.5)
    timings.note(prompt, call=(begin, end), encoded=1)
    timings.note(prompt, call=(begin, end), encoded=1)  # two images of one call: the call counts once
    assert timings.report(prompt)["encoder_ms"] is None
    end.done = True
    assert timings.report(prompt) == {"encoder_ms": 2.5, "images_encoded": 2, "images_cached": 0}


def test_unknown_and_forgotten_prompts():
    timings, ahead, other = VisionTimings(keep=1), Prompt(), Prompt()
    timings.note(ahead, unknown=1)
    assert timings.report(ahead)["encoder_ms"] is None
    timings.note(other, cached=1)
    assert timings.report(ahead) is None  # beyond `keep`
    assert timings.report(other) == {"encoder_ms": 0.0, "images_encoded": 0, "images_cached": 1}
