"""Events posted from the engine thread reach the loop in order, with few wake-ups."""

import asyncio
import threading

from fovea.engine.core.request import LoopMailbox


def test_events_from_another_thread_arrive_in_order_with_batched_wakeups():
    async def main():
        loop = asyncio.get_running_loop()
        box = LoopMailbox.of(loop)
        assert LoopMailbox.of(loop) is box
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return real(*args)

        loop.call_soon_threadsafe = counting
        got: list[int] = []
        done = asyncio.Event()

        def deliver(n):
            got.append(n)
            if n == 9999:
                done.set()

        ready = threading.Event()

        def engine():
            ready.wait()
            for n in range(10000):
                box.post(deliver, n)

        thread = threading.Thread(target=engine)
        thread.start()
        ready.set()
        await asyncio.wait_for(done.wait(), 10)
        thread.join()
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == list(range(10000))
    assert 1 <= wakeups < 10000  # far fewer wake-ups than events
