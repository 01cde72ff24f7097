"""``parent_watch``: a child lives while its parent does, and dies at once when the parent is killed.

A parent process (not the test's own, which must survive) starts one child of each kind fovea
starts: a ``multiprocessing`` spawned worker (a pool's, as the preprocessing workers are) and a
``subprocess`` child holding a ``lifeline`` (as the PD workers are). Both ignore SIGTERM, as a
worker busy with its clean stop would take a while to act on it. Then the parent is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fovea

GONE_WITHIN_S = 2.0

PARENT = r"""
import os, signal, subprocess, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from fovea.disagg.parent_watch import PARENT_FD_ENV, exit_with_parent, lifeline

pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=exit_with_parent)
pool.submit(signal.signal, signal.SIGTERM, signal.SIG_IGN).result()
child_end, keep = lifeline()
child = subprocess.Popen([sys.executable, "-c", "from fovea.disagg.parent_watch import exit_with_parent; "
                          "exit_with_parent(); import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(120)"],
                         env={**os.environ, PARENT_FD_ENV: str(child_end)}, pass_fds=(child_end,))
os.close(child_end)
print(*pool._processes, child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_children_die_at_once_with_their_parent_even_one_slow_to_stop():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fovea.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(children) == 2, children
        time.sleep(0.5)  # the watch has started: a live parent keeps its children
        assert all(alive(pid) for pid in children)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        killed = time.monotonic()
        while any(alive(pid) for pid in children) and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.02)
        assert not [pid for pid in children if alive(pid)], f"alive {GONE_WITHIN_S} s after their parent was killed"
    finally:
        parent.kill()
        parent.wait(10)
        for pid in children if "children" in locals() else []:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
