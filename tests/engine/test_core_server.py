"""The engine core's loop (``engine.process.core_main.CoreServer``) without an engine: what it
does when one of several API processes dies."""

import asyncio
import subprocess
import sys
import threading

from fovea.engine.process.core_main import CoreServer, Held, Observations


def test_a_dead_api_processs_requests_are_dropped_and_the_others_kept():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # an API process's stand-in

    async def scenario() -> tuple[bool, bool, bool, bool]:
        server = CoreServer(sock=None, observed=Observations())
        mine, theirs = threading.Event(), threading.Event()
        server.held[(b"dies", 1)] = Held(b"dies", 1, None, cancelled=mine)
        server.held[(b"stays", 1)] = Held(b"stays", 1, None, cancelled=theirs)
        server.peers |= {b"dies", b"stays"}
        server.watch(b"dies", child.pid)
        assert not mine.is_set()  # watching alone drops nothing
        child.kill()
        for _ in range(200):  # the pidfd wakes the loop when the process ends; 10 s at most
            if mine.is_set():
                break
            await asyncio.sleep(0.05)
        return mine.is_set(), theirs.is_set(), (b"stays", 1) in server.held, b"dies" in server.peers

    try:
        dropped, other_dropped, other_held, still_a_peer = asyncio.run(scenario())
    finally:
        child.kill()
        child.wait()
    assert dropped and not other_dropped and other_held and not still_a_peer
