"""Live ``fovea serve`` processes for the client suite: the demo model and a tiny random Qwen2.5-VL
with a byte-level tokenizer and a tool template, each started under every set-up of
``servers.SETUPS`` (one set-up at a time: pytest groups the tests by it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import SETUPS, Served, Setup, start, stop

from fovea.testing.byte_level_model import write_model_dir


@pytest.fixture(scope="session", params=SETUPS, ids=[s.id for s in SETUPS])
def setup(request) -> Setup:
    return request.param


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fovea-serve-logs")


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("byte-qwen"))


@pytest.fixture(scope="session")
def live_server(setup: Setup, server_logs: Path) -> Iterator[Served]:
    """The demo model, with its grounding canary at start-up as ``fovea serve`` runs it."""
    served = start(setup, "demo", None, server_logs, canary=True)
    yield served
    stop(served)


@pytest.fixture(scope="session")
def byte_server(setup: Setup, server_logs: Path, byte_model_dir: Path) -> Iterator[Served]:
    """Random weights: no canary (it would find, rightly, that the answers ignore the image)."""
    served = start(setup, "byte", byte_model_dir, server_logs, canary=False)
    yield served
    stop(served)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the end of the logs of the servers it talked to."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name in ("live_server", "byte_server"):
            served = getattr(item, "funcargs", {}).get(name)
            if isinstance(served, Served):
                report.sections.append((f"fovea serve log ({name}, {served.setup.id})", served.tail()))
