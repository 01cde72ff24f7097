"""The playground's grounding line (serve/playground/grounding.js) without a browser: the page's
own function, run in node, and the server shipping it to the page.

tests/deploy/test_playground_browser.py shows the same lines in Chromium.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

from fovea.serve.playground_route import PLAYGROUND_DIR

NEUTRAL = "the same answer would come without the picture (a blank image gives the same first words)"
DEPENDENT = {"image_dependent": True, "max_kl": 2.5, "threshold": 0.05}
SAME = {"image_dependent": False, "max_kl": 0.0001, "threshold": 0.05}


def grounding_line(grounding: dict | None, canary_failed: bool) -> dict:
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH (the browser test covers the page)")
    script = (f"const {{ groundingLine }} = require({json.dumps(str(PLAYGROUND_DIR / 'grounding.js'))});"
              f"process.stdout.write(JSON.stringify(groundingLine({json.dumps(grounding)}, {json.dumps(canary_failed)})));")
    return json.loads(subprocess.run([node, "-e", script], capture_output=True, text=True, check=True, timeout=60).stdout)


def test_an_answer_a_blank_image_also_gives_is_neutral_not_a_failure():
    assert grounding_line(SAME, canary_failed=False) == {"text": NEUTRAL, "className": "neutral"}


def test_red_is_kept_for_a_model_the_canary_finds_ignoring_images():
    line = grounding_line(SAME, canary_failed=True)
    assert line["className"] == "bad" and line["text"].startswith("NO: the answer did not depend on the image")
    assert "canary" in line["text"]


def test_image_dependent_and_unscored_answers():
    assert grounding_line(DEPENDENT, canary_failed=True) == {"text": "yes", "className": "ok"}
    unscored = {"image_dependent": None, "note": "the request carries no image"}
    assert grounding_line(unscored, canary_failed=False) == {"text": "the request carries no image", "className": ""}


def test_the_page_loads_the_grounding_line_before_its_app(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=30) as client:
        page = client.get("/").text
        script = client.get("/playground/grounding.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "function groundingLine" in script.text
    assert page.index('src="/playground/grounding.js"') < page.index('src="/playground/app.js"')
