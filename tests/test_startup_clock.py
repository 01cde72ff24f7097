"""The start-up clock: phases summed, nested phases reported beside their parent, ready once."""

from __future__ import annotations

import time

import pytest

from fovea.startup_clock import StartupClock, process_start_wall


def test_phases_sum_nest_and_account_for_the_rest() -> None:
    clock = StartupClock(started_wall=time.time() - 5.0)  # "the process started 5 s ago"
    with clock.phase("load weights"):
        time.sleep(0.02)
    with clock.phase("engine"), clock.phase("memory profile"):
        time.sleep(0.02)
    with clock.phase("load weights"):  # a phase that runs twice is summed
        time.sleep(0.02)
    ready = clock.mark_ready()
    assert ready >= 5.0
    assert clock.mark_ready() == ready  # once: a later call does not move it
    report = clock.report()
    assert list(report["phases"]) == ["load weights", "engine", "memory profile"]
    assert report["phases"]["load weights"] >= 0.04
    assert report["phases"]["engine"] >= report["phases"]["memory profile"]
    # Only top-level phases are accounted; the nested one is inside "engine".
    top = report["phases"]["load weights"] + report["phases"]["engine"]
    assert report["unaccounted_s"] == pytest.approx(report["ready_after_s"] - top, abs=0.02)
    line = clock.summary()
    assert line.startswith(f"start-up: ready after {ready:.1f} s: load weights ")
    assert ", >memory profile " in line and "imports and the rest" in line


def test_a_phase_that_raises_is_still_counted() -> None:
    clock = StartupClock(started_wall=time.time())
    with pytest.raises(RuntimeError), clock.phase("contract"):
        raise RuntimeError("refused")
    assert "contract" in clock.report()["phases"]
    with clock.phase("engine"):  # the stack was unwound: this one is top-level again
        pass
    assert clock.depth["engine"] == 0


def test_process_start_is_in_the_past() -> None:
    started = process_start_wall()
    assert started <= time.time()
    assert time.time() - started < 24 * 3600  # this test process did not start a day ago
