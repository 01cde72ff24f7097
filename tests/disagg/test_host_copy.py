"""The encoder pool's host copies: exact bytes, clear refusals, and the GIL kept throughout."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from fovea.disagg import host_copy, wire
from fovea.disagg.shared_segment import Segment


def test_the_bytes_land_exactly_and_nothing_beside_them_changes():
    src = torch.randn(3, 17, 19).to(torch.bfloat16)
    buffer = torch.full((host_copy.nbytes(src) + 64,), 0xAB, dtype=torch.uint8)
    host_copy.copy_bytes(buffer[32:32 + host_copy.nbytes(src)], src)
    assert torch.equal(buffer[32:-32].view(torch.bfloat16).view(3, 17, 19), src)
    assert bool((buffer[:32] == 0xAB).all()) and bool((buffer[-32:] == 0xAB).all())


@pytest.mark.parametrize("case", ["not contiguous", "lengths differ"])
def test_what_it_cannot_copy_is_refused(case):
    src = torch.randn(8, 8)
    dst = torch.empty(host_copy.nbytes(src), dtype=torch.uint8)
    if case == "not contiguous":
        src = src.t()
    else:
        dst = dst[:-4]
    with pytest.raises(ValueError, match="contiguous host tensors of equal byte length"):
        host_copy.copy_bytes(dst, src)


def test_a_non_contiguous_tensor_still_crosses_in_the_segment():
    segment = Segment(4096)
    try:
        src = torch.arange(64, dtype=torch.float32).view(8, 8).t()  # torch's copy, not the memmove
        message = wire.encode([({"n": 1}, src)], segment)
        assert len(message) < host_copy.nbytes(src)  # the bytes went into the segment, not inline
        items = wire.decode(message, lambda name: segment)
        assert torch.equal(items[0][1].view(torch.float32).view(8, 8), src)
    finally:
        segment.close()


def test_the_copy_keeps_the_gil():
    """A neighbour thread counts while it can run. With a switch interval longer than the test,
    this thread is never preempted: the neighbour runs only while this one releases the GIL. A
    sleep lets it count (the probe works); a 64 MB copy does not."""
    count, stop = [0], threading.Event()

    def neighbour() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.0001)  # releases the GIL: this thread gets it back

    src = torch.randn(16 << 20)  # 64 MB: milliseconds of copying
    dst = torch.empty(host_copy.nbytes(src), dtype=torch.uint8)
    interval = sys.getswitchinterval()
    thread = threading.Thread(target=neighbour, daemon=True)
    thread.start()
    try:
        time.sleep(0.01)
        sys.setswitchinterval(100.0)
        before = count[0]
        time.sleep(0.01)
        slept = count[0]
        host_copy.copy_bytes(dst, src)
        copied = count[0]
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join()
    assert slept > before  # the neighbour runs whenever this thread lets go
    assert copied == slept  # and the copy never let go
    assert torch.equal(dst.view(torch.float32), src)
