"""What a test's own processes hold, so that checks ignore whatever else runs on the machine."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


def mapped_segments(pids: set[int]) -> set[str]:
    """The shared-memory segments (/dev/shm/psm_*) these processes have mapped."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found |= {line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)") for line in maps.splitlines()
                  if "/dev/shm/psm_" in line}
    return found


def stop_process(process: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM a server process still running, and SIGKILL it if it has not exited after ``grace_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
