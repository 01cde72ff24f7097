"""Live ``fovea serve`` processes for the client suite: the demo model and a tiny random Qwen2.5-VL
with a byte-level tokenizer and a tool template, each started under every set-up of
``servers.SETUPS``. pytest groups the tests by set-up; a set-up's servers stop when its tests
are done, and the next ones start while they run (``servers.Fleet``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import transformers
from servers import SETUPS, Fleet, Key, Served, Setup

from fovea.testing.byte_level_model import write_model_dir

MODELS = {"live_server": "demo", "byte_server": "byte"}
ORDER = pytest.StashKey[list[Key]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Which servers the selected tests need, in the order they will run."""
    order: list[Key] = []
    for item in session.items:
        setup = getattr(item, "callspec", None) and item.callspec.params.get("setup")
        for fixture, model in MODELS.items():
            if isinstance(setup, Setup) and fixture in item.fixturenames and (setup.id, model) not in order:
                order.append((setup.id, model))
    session.config.stash[ORDER] = order


@pytest.fixture(scope="session")
def fleet(request, tmp_path_factory) -> Iterator[Fleet]:
    order = request.config.stash.get(ORDER, [])
    byte_dir = write_model_dir(tmp_path_factory.mktemp("byte-qwen"))
    fleet = Fleet(order, {"demo": None, "byte": byte_dir}, tmp_path_factory.mktemp("fovea-serve-logs"))
    yield fleet
    fleet.retire()


@pytest.fixture(scope="session")
def byte_model_config(fleet: Fleet) -> transformers.PretrainedConfig:
    """The byte model's own config, for tolerances derived from its shape (its weights are served)."""
    return transformers.AutoConfig.from_pretrained(fleet.model_dirs["byte"])


@pytest.fixture(scope="session", params=SETUPS, ids=[s.id for s in SETUPS])
def setup(request, fleet: Fleet) -> Iterator[Setup]:
    yield request.param
    fleet.retire(request.param)


@pytest.fixture(scope="session")
def live_server(setup: Setup, fleet: Fleet) -> Served:
    """The demo model, with its grounding canary at start-up as ``fovea serve`` runs it."""
    return fleet.get(setup, "demo")


@pytest.fixture(scope="session")
def byte_server(setup: Setup, fleet: Fleet) -> Served:
    """Random weights: no canary (it would find, rightly, that the answers ignore the image)."""
    return fleet.get(setup, "byte")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the end of the logs of the servers it talked to."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name in MODELS:
            served = getattr(item, "funcargs", {}).get(name)
            if isinstance(served, Served):
                report.sections.append((f"fovea serve log ({name}, {served.setup.id})", served.tail()))
