"""--log-format json: every line a request causes carries its id, which the response returns."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time

import httpx
import pytest
from scene_helpers import data_url, fresh_scene

from fovea import logs
from fovea.cli import build_parser
from fovea.demo import scenes


@pytest.fixture()
def json_log():
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("uvicorn.access").disabled
    buffer = io.StringIO()
    logs.configure("info", "json", stream=buffer)
    yield buffer
    root.handlers[:], level, logging.getLogger("uvicorn.access").disabled = saved
    root.setLevel(level)


def lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def ask(base: str, url: str, **headers) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", headers=headers, timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "How many shapes are there?"}]}]})


def test_a_refusal_and_an_answer_are_tied_to_their_request_ids(live_server, json_log):
    bad = ask(live_server.base_url, "data:image/png;base64,AAAA", **{"X-Request-Id": "client-id-7"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "client-id-7"
    good = ask(live_server.base_url, data_url(scenes.render(fresh_scene(77))), **{"X-Request-Id": "bad id with spaces"})
    assert good.status_code == 200
    rid = good.headers["x-request-id"]
    assert rid.startswith("req-") and rid != "client-id-7"  # an unusable client id is replaced

    records = lines(json_log)
    access = [r for r in records if r["logger"] == "fovea.access"]
    refused = next(r for r in access if r.get("request_id") == "client-id-7")
    assert refused["status"] == 400 and refused["error_code"] == "invalid_image"
    assert refused["path"] == "/v1/chat/completions"
    mine = [r for r in records if r.get("request_id") == rid]
    assert {r["logger"] for r in mine} >= {"fovea.access", "fovea.request"}
    finished = next(r for r in mine if r["logger"] == "fovea.request")
    assert finished["completion_tokens"] >= 1 and finished["images_encoded"] == 1 and finished["encoder_ms"] > 0


def test_log_flags_are_checked():
    args = build_parser().parse_args(["--log-level", "DEBUG", "--log-format", "json", "doctor"])
    assert (args.log_level, args.log_format) == ("debug", "json")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-format", "xml", "doctor"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "loud", "doctor"])


def test_text_format_appends_the_request_id():
    record = logging.LogRecord("fovea.x", logging.INFO, __file__, 1, "hello", None, None)
    record.request_id = "req-1"
    assert logs.TextFormatter().format(record).endswith("fovea.x: hello [req-1]")


def test_the_default_handler_writes_to_the_stderr_of_the_moment(monkeypatch):
    """Threads that log after stderr was swapped (and the old one closed) write to the new one."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr("sys.stderr", first)
        logs.configure("info", "text")
        logging.getLogger("fovea.test").info("before")
        first.close()
        monkeypatch.setattr("sys.stderr", second)
        logging.getLogger("fovea.test").info("after")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    written = second.getvalue()
    assert "INFO fovea.test: after" in written and "Logging error" not in written and "before" not in written


def test_caplog_sees_a_live_servers_access_lines_after_the_cli_configured_logging(live_server, caplog):
    """``fovea.cli.main`` run in-process calls ``logs.configure``; pytest's capture handler stays."""
    logs.configure("info", "text", stream=io.StringIO())
    caplog.set_level(logging.INFO, logger="fovea.access")
    response = httpx.post(live_server.base_url + "/tokenize", json={"prompt": "hi", "x-unknown": 1},
                          timeout=30)
    assert response.status_code == 400
    # The line is written once the response has gone out: wait for it, within a deadline.
    deadline = time.monotonic() + 10
    while not (mine := [r for r in caplog.records if r.name == "fovea.access" and r.path == "/tokenize"]):
        assert time.monotonic() < deadline, "no fovea.access record reached caplog"
        time.sleep(0.01)
    assert mine[0].status == 400 and mine[0].request_id == response.headers["x-request-id"]


INNER_CONFTEST = """
import logging
from fovea.testing.quiet_logs import logging_left_as_found  # noqa: F401

def pytest_runtest_logreport(report):
    # What a server thread does after a test: log while pytest draws its progress line.
    if report.when == "teardown":
        logging.getLogger("fovea.access").warning("LEAKED-%s", report.nodeid.rsplit("::", 1)[-1])
"""

INNER_TESTS = """
from fovea import logs

def test_runs_the_cli_in_process():
    logs.configure("info", "text")

def test_after_it():
    pass
"""


def test_fovea_lines_stay_off_pytests_progress_line(tmp_path):
    """A test that configured logging in-process leaves no handler that writes onto the terminal
    between tests (pytest's capture is suspended there)."""
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
    assert "LEAKED" not in result.stdout + result.stderr, result.stdout + result.stderr
