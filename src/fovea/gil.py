"""How soon a thread that waits for the GIL gets it.

An engine's worker thread and the loop that delivers its events share one GIL, in the API
process (``--engine-core thread``) and in the engine core's process alike. A thread that wants
the GIL back must get it within a fraction of a GPU step (a 7B decode step is ~4.5 ms), not
after Python's default 5 ms switch interval. Both processes set it, so the engine core's loop,
which sends the engine thread's events, waits no longer than the API process's loop does.
"""

from __future__ import annotations

import os
import sys

ENV = "FOVEA_SWITCH_INTERVAL_MS"


def set_switch_interval() -> float:
    """Python's switch interval from ``FOVEA_SWITCH_INTERVAL_MS`` (default 1 ms); returns seconds."""
    seconds = float(os.environ.get(ENV, "1")) / 1000
    sys.setswitchinterval(seconds)
    return seconds
