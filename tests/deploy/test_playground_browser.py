"""The playground at / end to end: headless Chromium (the system's, driven by Playwright; no browser
download) against a live server on the demo model. It picks an image, asks, watches the answer
stream in, reads the grounding score and timings the page shows, and then sends a broken image
and reads the refusal. A screenshot of each is kept (FOVEA_TEST_ARTIFACTS, default runs/test-artifacts).

Without a chromium binary the test is skipped, unless FOVEA_REQUIRE_BROWSER=1 (.ci/run sets it):
then a missing browser fails it.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import pytest
from scene_helpers import fresh_scene

from fovea.demo import scenes

ROOT = Path(__file__).resolve().parents[2]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _need(what: str) -> None:
    if os.environ.get("FOVEA_REQUIRE_BROWSER") == "1":
        pytest.fail(f"FOVEA_REQUIRE_BROWSER=1 but {what} (scripts/install-test-browser installs chromium)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if executable is None:
        _need("no chromium on PATH")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("the 'playwright' package is not installed (the test extra has it)")
    with sync_playwright() as p:
        # --no-sandbox: CI and containers run as root, where Chromium's sandbox refuses to start.
        launched = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture()
def artifacts() -> Path:
    out = Path(os.environ.get("FOVEA_TEST_ARTIFACTS", ROOT / "runs" / "test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_playground_streams_a_grounded_answer_and_shows_refusals(browser, live_server, tmp_path, artifacts):
    scene = fresh_scene(151)
    image = tmp_path / "scene.png"
    scenes.render(scene).save(image)
    page, failures = open_with_image(browser, live_server, image, "fovea-shapes")
    # The last chunk carries fovea.grounding and fovea.timing; the page fills the table from it.
    ask_and_wait(page, "Describe the image.")
    assert page.text_content("#answer") == scenes.describe_answer(scene)
    assert page.text_content("#grounded") == "yes"
    assert "threshold" in page.text_content("#kl")
    encoder = page.text_content("#encoder")
    assert encoder.endswith("(1 encoded, 0 from the encoder cache)") and float(encoder.split(" ms")[0]) > 0, encoder
    assert "tokens/s" in page.text_content("#tps")
    assert page.text_content("#rid").strip() not in ("", "–")
    assert not page.is_visible("#error")
    page.screenshot(path=str(artifacts / "playground-answer.png"), full_page=True)

    # The same image again, dropped this time: the encoder cache answers and the page says so.
    page.evaluate("""(b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], "dropped.png", {type: "image/png"}));
        document.getElementById("drop").dispatchEvent(
            new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true}));
    }""", base64.b64encode(image.read_bytes()).decode())
    page.wait_for_function("document.getElementById('file-info').textContent.includes('dropped.png')")
    page.wait_for_function("document.getElementById('preview').src.startsWith('data:image/png')")
    page.click("#ask")
    page.wait_for_function("document.getElementById('encoder').textContent.includes('from the encoder cache')",
                           timeout=60_000)
    assert page.text_content("#encoder").endswith("(0 encoded, 1 from the encoder cache)")

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png")
    page.set_input_files("#file", str(broken))
    page.wait_for_function("document.getElementById('file-info').textContent.includes('broken.png')")
    page.click("#ask")
    page.wait_for_selector("#error", state="visible", timeout=30_000)
    error = page.text_content("#error")
    assert "HTTP 400" in error and "invalid_image" in error and "messages[0].content[0]" in error, error
    page.screenshot(path=str(artifacts / "playground-refusal.png"), full_page=True)
    assert failures == [], failures


def open_with_image(browser, live_server, image: Path, server_text: str):
    """The playground, once its server line shows ``server_text``, with ``image`` picked; (the
    page, the list its script errors are collected in)."""
    page = browser.new_page(viewport={"width": 1100, "height": 760})
    failures: list[str] = []
    page.on("pageerror", lambda exc: failures.append(str(exc)))
    page.goto(live_server.base_url + "/")
    page.wait_for_function(f"document.getElementById('server').textContent.includes({server_text!r})")
    page.set_input_files("#file", str(image))
    page.wait_for_selector("#preview", state="visible")
    return page, failures


def ask_and_wait(page, question: str) -> None:
    page.fill("#question", question)
    page.click("#ask")
    page.wait_for_function("document.getElementById('grounded').textContent !== '–'", timeout=60_000)
    page.wait_for_function("!document.getElementById('ask').disabled")


def test_an_answer_without_the_picture_is_neutral_and_red_only_when_the_canary_fails(browser, live_server, tmp_path,
                                                                                      artifacts):
    """One shape, "How many shapes are there?": "one" is right, and a blank image gives "one" too.
    The page says so in grey; with /health reporting a failed canary the same answer is red."""
    image = tmp_path / "one.png"
    scenes.render(scenes.Scene(160, 160, (scenes.Shape("orange", "triangle", 4, 0.3, (0.5, 0.5), (0, 0, 0)),))
                  ).save(image)
    page, failures = open_with_image(browser, live_server, image, "canary")
    ask_and_wait(page, "How many shapes are there?")
    assert page.text_content("#answer") == "one"
    assert page.text_content("#grounded") == ("the same answer would come without the picture "
                                              "(a blank image gives the same first words)")
    assert page.get_attribute("#grounded", "class") == "neutral"
    assert page.eval_on_selector("#grounded", "e => getComputedStyle(e).color") == "rgb(85, 85, 85)"  # not red
    page.screenshot(path=str(artifacts / "playground-neutral.png"), full_page=True)

    def failed_canary(route) -> None:
        health = route.fetch().json()
        health["canary"] = {**(health["canary"] or {}), "ok": False}
        route.fulfill(json=health)

    page.route("**/health", failed_canary)  # the page reads /health again before each question
    ask_and_wait(page, "How many shapes are there?")
    assert "canary FAILED" in page.text_content("#server")
    assert page.text_content("#grounded").startswith("NO: the answer did not depend on the image")
    assert page.get_attribute("#grounded", "class") == "bad"
    assert failures == [], failures
