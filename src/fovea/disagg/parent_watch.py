"""A child of the front exits when the front is gone, even when it was killed (SIGKILL)."""

from __future__ import annotations

import os
import signal
import threading
import time

WATCH_S = 1.0


def exit_with_parent() -> None:
    """Send this process SIGTERM (its clean shutdown) once its parent has gone: orphans are
    adopted by another process, so the parent's pid changes."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fovea-parent-watch", daemon=True).start()
