"""A pytest fixture that keeps fovea's log lines inside pytest's capture.

A test that runs ``fovea.cli.main`` in-process calls ``fovea.logs.configure``, which adds a
handler on the root logger writing to stderr and sets the level to INFO. Left in place, that
handler goes on writing the lines of the session's server threads (``fovea.access`` after a
response was sent) at moments when pytest has suspended its capture to draw its progress line,
so they land between the dots. The fixture removes it after each test and restores the levels;
pytest's own handlers, which ``caplog`` and the failure report read, stay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from fovea import logs

_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture(autouse=True)
def logging_left_as_found() -> Iterator[None]:
    root, named = logging.getLogger(), [logging.getLogger(name) for name in _UVICORN]
    level, saved = root.level, [(lg.level, lg.propagate, lg.disabled, lg.handlers[:]) for lg in named]
    yield
    logs.unconfigure()
    root.setLevel(level)
    for lg, (lg_level, propagate, disabled, handlers) in zip(named, saved, strict=True):
        lg.setLevel(lg_level)
        lg.propagate, lg.disabled, lg.handlers[:] = propagate, disabled, handlers
