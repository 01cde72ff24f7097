"""Where a start-up's seconds go: named phases, summed, and one line when the server is ready.

Operators ask "why does it take a minute to start?"; the answer should be in the log, not in a
profiler. The phases nest: ``memory profile`` contains ``kernel choices`` and
``worst step``, and a nested phase's seconds are reported beside its parent's, not taken out of
them. The clock starts at the process's own start (Linux: ``/proc/self/stat``), so the imports
of torch and transformers, which no phase covers, show as the remainder.

    with STARTUP.phase("load weights"):
        ...
    log.info("%s", STARTUP.summary())   # once, when /health first answers ready
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator


def process_start_wall() -> float:
    """The wall-clock time this process started (Linux); else now, at this module's import."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after the ')' of the name
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - (uptime - start_ticks / ticks)
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupClock:
    """Phases in the order they started, with their summed seconds (a phase may run twice)."""

    def __init__(self, started_wall: float | None = None) -> None:
        self.started_wall = process_start_wall() if started_wall is None else started_wall
        self.seconds: dict[str, float] = {}
        self.depth: dict[str, int] = {}
        self._stack: list[str] = []
        self._lock = threading.Lock()
        self.ready_after: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            depth = len(self._stack)
            self._stack.append(name)
            self.depth.setdefault(name, depth)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            with self._lock:
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
                if self._stack and self._stack[-1] == name:
                    self._stack.pop()

    def merge(self, seconds: dict[str, float], depth: dict[str, int]) -> None:
        """Phases another process ran for this one (the engine core's load, contract and engine)."""
        with self._lock:
            for name, value in seconds.items():
                self.seconds[name] = self.seconds.get(name, 0.0) + value
                self.depth.setdefault(name, depth.get(name, 0))

    def elapsed(self) -> float:
        """Seconds since the process started."""
        return time.time() - self.started_wall

    def mark_ready(self) -> float:
        """Record (once) the seconds from the process's start to ready; returns them."""
        if self.ready_after is None:
            self.ready_after = self.elapsed()
        return self.ready_after

    def report(self) -> dict:
        """{"ready_after_s", "phases": {name: seconds}, "unaccounted_s"} (top-level phases only
        count towards the accounted time)."""
        total = self.ready_after if self.ready_after is not None else self.elapsed()
        top = sum(s for name, s in self.seconds.items() if self.depth.get(name, 0) == 0)
        phases = {name: round(self.seconds[name], 2) for name in self.depth if name in self.seconds}  # start order
        return {"ready_after_s": round(total, 2), "phases": phases,
                "unaccounted_s": round(max(0.0, total - top), 2)}

    def summary(self) -> str:
        """One line: the total, then each phase (nested ones indented by a '>' per level)."""
        report = self.report()
        parts = [f"{'>' * self.depth.get(name, 0)}{name} {seconds:.1f} s"
                 for name, seconds in report["phases"].items()]
        rest = f"imports and the rest {report['unaccounted_s']:.1f} s"
        phases = ", ".join(parts) + "; " if parts else ""  # a further API process may time no phase
        return f"start-up: ready after {report['ready_after_s']:.1f} s: {phases}{rest}"


STARTUP = StartupClock()
