"""The E/PD hand-off's batched checksum kernel against ``handoff.checksum``, image by image.
Runs where triton imports and either CUDA is present or TRITON_INTERPRET=1 (triton's CPU
interpreter, through test_kernels_interpreted.py); skipped otherwise."""

import importlib.util
import os

import pytest
import torch

from fovea.disagg import handoff
from fovea.disagg.checksum_kernel import checksum_many

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def flats(*sizes: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(DEVICE) for n in sizes]


@needs_triton
def test_each_images_sum_equals_the_per_image_checksum():
    # Lengths below, at and far beyond one block of words, one longer than all the programs' stride.
    batch = flats(2, 2048, 2050, 10_000, 2 * 1024 * 64 * 3 + 6)
    assert checksum_many(batch, handoff._STRIDE).tolist() == [int(handoff.checksum(f)) for f in batch]


@needs_triton
def test_a_changed_swapped_or_shifted_word_changes_only_its_images_sum():
    a, b = flats(4096, 4096, seed=1)
    before = checksum_many([a, b], handoff._STRIDE).tolist()
    changed = a.clone()
    changed[100] ^= 1
    swapped = a.clone()
    swapped[[10, 11, 20, 21]] = a[[20, 21, 10, 11]]
    shifted = torch.cat([a[2:], a[:2]])
    for other in (changed, swapped, shifted):
        if torch.equal(other, a):
            continue  # (a swap of two equal words changes nothing: nothing to see)
        after = checksum_many([other, b], handoff._STRIDE).tolist()
        assert after[0] != before[0] and after[1] == before[1]
