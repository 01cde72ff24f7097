"""The E/PD hand-off's batched checksum kernel against ``handoff.checksum``, image by image.
Runs where triton imports and either CUDA is present or TRITON_INTERPRET=1 (triton's CPU
interpreter, through test_kernels_interpreted.py); skipped otherwise."""


import pytest
import torch
from kernel_helpers import DEVICE, needs_triton

from fovea.disagg import handoff
from fovea.engine.kernels.checksum_kernel import checksum_many


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


def lying_back_to_back(widths: list[int], tokens: list[int], dtype=torch.bfloat16, align: int = 256):
    """Sealed images whose payloads lie in one buffer at ``align``-byte offsets, as the pool's
    shared segment holds them, and the rows they were sealed from."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(n, w, generator=g).to(dtype) for n, w in zip(tokens, widths, strict=True)]
    meta = {"request_id": "r", "image_hash": "h", "model_id": "m", "vision_fingerprint": "v",
            "recipe_fingerprint": "p", "grid": None}
    sealed = handoff.seal_many(rows, [meta] * len(rows))
    sizes = [f.numel() for _, f in sealed]
    buffer = torch.zeros(sum(-(-n // align) * align for n in sizes), dtype=torch.uint8)
    items, at = [], 0
    for (header, flat), n in zip(sealed, sizes, strict=True):
        buffer[at:at + n] = flat
        items.append((header, buffer[at:at + n]))
        at += -(-n // align) * align
    return items, rows


@needs_triton
@pytest.mark.parametrize(("widths", "views"), [([128, 128, 128], 2), ([3, 3, 5], 6)], ids=["one-table", "view-each"])
def test_a_batch_lands_as_its_images_rows_and_a_corrupt_one_fails_alone(widths, views, monkeypatch):
    """Row-aligned images (every served model's width) become slices of one table, two views
    for the batch; odd widths (rows that do not divide the 256-byte alignment) two views each.
    Both give each image's rows exactly, in one landed block, and a flipped byte fails only
    its image."""
    items, rows = lying_back_to_back(widths, [4, 9, 2])
    calls, real_view = [], torch.Tensor.view
    monkeypatch.setattr(torch.Tensor, "view", lambda self, *a: calls.append(a) or real_view(self, *a))
    landed = handoff.land_each(items, DEVICE, batched=True, timing=(timing := {}))
    monkeypatch.undo()
    assert len(calls) == views, calls
    for got, want in zip(landed, rows, strict=True):
        assert torch.equal(got.cpu(), want) and got.dtype == want.dtype
    assert len({t.untyped_storage().data_ptr() for t in landed}) == 1  # one landed block
    assert timing["wait_s"] >= 0
    items[1][1][5] ^= 0xFF  # in the buffer, after sealing
    corrupt = handoff.land_each(items, DEVICE, batched=True)
    assert isinstance(corrupt[1], handoff.HandoffMismatch) and corrupt[1].reason == "checksum"
    assert torch.equal(corrupt[0].cpu(), rows[0]) and torch.equal(corrupt[2].cpu(), rows[2])
