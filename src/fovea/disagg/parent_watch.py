"""A child of a fovea process dies the moment its parent is gone, even when the parent was killed (SIGKILL).

The parent holds the write end of a pipe whose read end the child has, and writes nothing. The
kernel closes the write end when the parent dies, however it dies; a thread of the child, blocked
on reading the pipe, wakes on the end of file and kills its own process. A blocked read, not a
poll: the child is gone at once, and with it the memory it holds (a GPU's, in production), before
a restarted server plans its own. SIGKILL rather than a clean stop: nobody is left to read the
child's answers, the kernel frees its memory, and the shared memory it owned is unlinked by its
resource tracker once its last holder is gone.

Not ``prctl(PR_SET_PDEATHSIG)``: that fires when the parent *thread* that started the child ends,
and fovea starts some children from worker threads (a preprocessing pool started again after a
crash, from ``asyncio.to_thread``).

A ``multiprocessing`` spawned child has the pipe already (its parent's sentinel). A child started
with ``subprocess`` gets one from ``lifeline`` and finds its end in ``PARENT_FD_ENV``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading

PARENT_FD_ENV = "FOVEA_PARENT_FD"


def lifeline() -> tuple[int, int]:
    """For a child started with subprocess: (the read end, for its ``pass_fds`` and its
    environment's ``PARENT_FD_ENV``, closed here once it is started; the write end, which this
    process keeps open for the child's life and closes only after the child has exited)."""
    return os.pipe()  # both ends close-on-exec: no other child inherits them


def exit_with_parent() -> None:
    """Start the watch (at the child's start). Without a pipe to watch (a process started by
    hand, or by a parent that holds none) there is nothing to do."""
    fd = _parent_fd()
    if fd is not None:
        threading.Thread(target=_watch, args=(fd,), name="fovea-parent-watch", daemon=True).start()


def _parent_fd() -> int | None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        return parent.sentinel
    value = os.environ.pop(PARENT_FD_ENV, "")  # popped: this process's own children have their own
    return int(value) if value.isdigit() else None


def _watch(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 64):  # nothing is written; the end of file comes when the parent is gone
            pass
    os.kill(os.getpid(), signal.SIGKILL)
