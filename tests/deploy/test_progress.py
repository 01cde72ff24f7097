"""Progress bars draw on a terminal only, unless FOVEA_PROGRESS forces them on or off."""

from __future__ import annotations

import io

from fovea.progress import progress


def test_quiet_when_not_a_tty(monkeypatch):
    monkeypatch.delenv("FOVEA_PROGRESS", raising=False)
    out = io.StringIO()  # not a TTY
    for _ in progress(range(5), file=out, desc="x"):
        pass
    assert out.getvalue() == ""


def test_forced_on_and_off(monkeypatch):
    monkeypatch.setenv("FOVEA_PROGRESS", "1")
    out = io.StringIO()
    for _ in progress(range(5), file=out, desc="loading"):
        pass
    assert "loading" in out.getvalue() and "5/5" in out.getvalue()
    monkeypatch.setenv("FOVEA_PROGRESS", "0")
    out = io.StringIO()
    for _ in progress(range(5), file=out):
        pass
    assert out.getvalue() == ""
