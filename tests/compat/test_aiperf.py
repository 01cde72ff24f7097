"""aiperf, NVIDIA's benchmark client, drives a live fovea server with synthetic images through
bench/aiperf_images.py, on chat and on the Responses API, with no request failing.

aiperf is not a test dependency (its install is over a gigabyte); the test runs where it is
installed: ``AIPERF=/path/to/aiperf`` or ``aiperf`` on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AIPERF = os.environ.get("AIPERF") or shutil.which("aiperf")

pytestmark = pytest.mark.skipif(not AIPERF or not Path(AIPERF).exists(),
                                reason="aiperf is not installed (set AIPERF=/path/to/aiperf)")


def test_aiperf_with_images_on_chat_and_responses(live_server, tmp_path):
    if live_server.setup.id != "defaults":
        # A 30-second load run: the set-ups change the server, not the client's path, which the
        # openai-client tests cover under each; bench/aiperf_images.py sends no API key.
        pytest.skip("aiperf runs against the default server only (30 s a run; the client tests cover each set-up)")
    before = _requests(live_server.base_url)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "aiperf_images.py"), "--aiperf", AIPERF,
                          "--url", live_server.base_url, "--requests", "8", "--concurrency", "2",
                          "--output-tokens", "16", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for endpoint in ("chat", "responses"):
        result = json.loads((tmp_path / endpoint / "profile_export_aiperf.json").read_text())
        assert result["request_count"]["avg"] == 8 and result["request_error_rate"]["avg"] == 0
        records = [json.loads(line) for line in (tmp_path / endpoint / "profile_export.jsonl").open()]
        assert all(r.get("error") is None for r in records)
        # The image reached the model: each prompt counts its 64 image tokens beside the text.
        prompts = [r["metrics"]["usage_prompt_tokens"]["value"] for r in records
                   if "usage_prompt_tokens" in r["metrics"]]
        assert prompts and min(prompts) > 64
    after = _requests(live_server.base_url)
    # Warm-up (2) and profiled (8) requests of each endpoint all reached the server and were answered.
    assert after["/v1/chat/completions"] - before["/v1/chat/completions"] == 10
    assert after["/v1/responses"] - before["/v1/responses"] == 10


def _requests(base: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    counts = {"/v1/chat/completions": 0.0, "/v1/responses": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fovea_requests_total" and sample.labels.get("status") == "200" \
                    and sample.labels.get("route") in counts:
                counts[sample.labels["route"]] += sample.value
    return counts
