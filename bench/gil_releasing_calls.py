"""Which torch calls release the GIL? Each one that does must retake it, and beside a thread
that holds the GIL in one long C call (as json encoding, tokenizers or pydantic do while a
server streams), retaking it waits for that whole call.

    python3 bench/gil_releasing_calls.py [--reps 30]

A neighbour thread runs ``json.dumps`` of a large list in a loop (each call holds the GIL for
tens of milliseconds); this thread times each call below on small CPU tensors. A median near
zero: the call keeps the GIL. A median near the neighbour's call: it releases it. The E/PD
landing (``handoff._row_views``) is built from the calls that keep it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


class GilHolder:
    """A daemon thread that calls ``json.dumps`` on a list of ``rows`` dicts in a loop: one C call
    that holds the GIL for ``hold_ms`` each time (measured alone first). ``with`` runs it."""

    def __init__(self, rows: int) -> None:
        self.big = [{"k": i, "v": "x" * 20} for i in range(rows)]
        started = time.perf_counter()
        json.dumps(self.big)
        self.hold_ms = 1e3 * (time.perf_counter() - started)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            json.dumps(self.big)

    def __enter__(self) -> GilHolder:  # noqa: PYI034
        self.thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    holder = GilHolder(60_000)
    seg = torch.zeros(16 << 20, dtype=torch.uint8)
    data = seg[4096:4096 + 8192 * 576]
    table = data.view(torch.bfloat16).view(-1, 4096)
    calls = {
        "t.numel()": lambda: data.numel(), "t.storage_offset()": lambda: data.storage_offset(),
        "t.data_ptr()": lambda: data.data_ptr(), "t.is_contiguous()": lambda: data.is_contiguous(),
        "t[a:b] (1-D)": lambda: seg[100:200], "t[a:b] (2-D rows)": lambda: table[10:20],
        "t.view(dtype)": lambda: data.view(torch.bfloat16), "t.view(shape)": lambda: data.view(576, 8192),
        "t.as_strided(...)": lambda: seg.as_strided((100,), (1,), 5),
        "torch.split(t, sizes)": lambda: torch.split(seg[:81920], [8192] * 10),
        "torch.tensor(list)": lambda: torch.tensor([[1, 2], [3, 4]]),
    }
    with holder:
        print(f"neighbour: one json.dumps call holds the GIL {holder.hold_ms:.1f} ms\n")
        print("| call | median ms | max ms |\n|---|---|---|")
        for name, call in calls.items():
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                call()
                times.append(1e3 * (time.perf_counter() - t0))
            print(f"| `{name}` | {statistics.median(times):.3f} | {max(times):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
