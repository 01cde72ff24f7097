"""The step-input staging: packing lists by dtype, and pending tokens resolved on the device."""

import torch

from fovea.engine.runner.staging import pending_token, resolve_pending
from fovea.engine.transfer import pack, to_device, unpack


def test_pack_groups_by_dtype_and_unpack_restores_every_array():
    arrays = [([5, 6, 7], torch.long), ([[1, 2], [3, 4]], torch.int32), ([], torch.long), ([9], torch.int32)]
    groups, layout = pack(arrays)
    assert set(groups) == {torch.long, torch.int32}
    flat = {dtype: torch.cat(parts) for dtype, parts in groups.items()}
    # Every array starts 64-byte aligned (Triton compiles a variant per pointer alignment).
    assert [offset * dtype.itemsize % 64 for dtype, offset, _, _ in layout] == [0, 0, 0, 0]
    assert flat[torch.long][:3].tolist() == [5, 6, 7] and flat[torch.int32][-1].item() == 9
    out = unpack(flat, layout)
    assert [t.tolist() for t in out] == [values for values, _ in arrays]
    assert [t.dtype for t in out] == [dtype for _, dtype in arrays]
    assert out[1].shape == (2, 2)


def test_to_device_on_cpu_keeps_values_shapes_and_dtypes():
    ids, table = to_device(torch.device("cpu"), [([3, 1], torch.long), ([[4, 5, 6]], torch.int32)])
    assert ids.tolist() == [3, 1] and ids.dtype == torch.long
    assert table.tolist() == [[4, 5, 6]] and table.dtype == torch.int32


def test_pending_tokens_are_read_from_the_previous_steps_samples():
    previous = torch.tensor([40, 41, 42])
    ids = torch.tensor([7, pending_token(2), 0, pending_token(0)])
    assert resolve_pending(ids, previous).tolist() == [7, 42, 0, 40]
    assert pending_token(0) < 0  # never a vocabulary id
    # Without a previous step (or one that sampled nothing) nothing can be pending.
    known = torch.tensor([1, 2])
    assert resolve_pending(known, None) is known
    assert resolve_pending(known, torch.tensor([], dtype=torch.long)) is known
