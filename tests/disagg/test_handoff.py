"""The hand-off header: every field is checked, and a mismatch names its field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fovea.disagg.handoff import (
    Expectation,
    HandoffMismatch,
    from_frame,
    open_rows,
    seal,
    to_frame,
    vision_fingerprint,
)

GRID = (1, 8, 6)


def sealed(rows: torch.Tensor, **overrides):
    fields = {"request_id": "r1", "image_hash": "abc", "model_id": "m", "vision_fp": "v", "recipe_fp": "p",
              "grid": GRID} | overrides
    return seal(rows, **fields)


def expectation(**overrides) -> Expectation:
    fields = {"request_id": "r1", "image_hash": "abc", "model_id": "m", "vision_fingerprint": "v",
              "recipe_fingerprint": "p", "dtype": "bfloat16", "hidden": 32, "tokens": 12, "grid": GRID}
    return Expectation(**(fields | overrides))


ROWS = torch.randn(12, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def test_rows_cross_a_frame_bit_identical():
    header, payload = sealed(ROWS)
    got_header, got_payload = from_frame(to_frame(header, payload))
    assert got_header == header
    assert torch.equal(open_rows(got_header, got_payload, expectation()), ROWS)


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("request_id", "r2", "request"), ("image_hash", "other-image", "image"), ("model_id", "other", "model"),
    ("vision_fingerprint", "w", "vision_weights"), ("recipe_fingerprint", "q", "preprocessing"),
    ("dtype", "float16", "dtype"), ("tokens", 11, "tokens"), ("grid", (1, 6, 8), "grid"), ("hidden", 64, "shape"),
])
def test_each_field_that_differs_is_refused_by_name(field, value, reason):
    header, payload = sealed(ROWS)
    with pytest.raises(HandoffMismatch) as info:
        open_rows(header, payload, expectation(**{field: value}))
    assert info.value.reason == reason and info.value.code == "image_embedding_mismatch"


def test_same_grid_other_image_is_refused():
    """Dynamo's failure: two images of one grid. The content hash tells them apart."""
    header, payload = sealed(ROWS, image_hash="image-a")
    with pytest.raises(HandoffMismatch, match="image"):
        open_rows(header, payload, expectation(image_hash="image-b"))


def test_corrupted_or_truncated_bytes_are_refused():
    header, payload = sealed(ROWS)
    flipped = bytearray(payload.numpy().tobytes())
    flipped[7] ^= 0x10
    with pytest.raises(HandoffMismatch) as info:
        open_rows(header, bytes(flipped), expectation())
    assert info.value.reason == "checksum"
    frame = to_frame(header, payload)
    with pytest.raises(HandoffMismatch) as info:
        from_frame(frame[:-3])
    assert info.value.reason == "frame"
    with pytest.raises(HandoffMismatch):
        from_frame(b"\x80\x04pickle" + frame[12:])  # not a frame: nothing is unpickled


def test_the_vision_fingerprint_changes_with_the_weights():
    tower = torch.nn.Linear(16, 8)
    before = vision_fingerprint([tower])
    assert vision_fingerprint([tower]) == before
    with torch.no_grad():
        tower.weight[0, 0] += 1.0
    assert vision_fingerprint([tower]) != before


def test_an_embedding_for_another_dtype_cannot_pass_as_this_one():
    header, payload = sealed(ROWS.float())
    forged = dataclasses.replace(header, dtype="bfloat16")
    with pytest.raises(HandoffMismatch) as info:
        open_rows(forged, payload, expectation())
    assert info.value.reason == "shape"
