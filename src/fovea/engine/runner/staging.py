"""How a decode input that is not on the host yet is written (``pending_token``) and read back
on the device (``resolve_pending``): with the next step queued behind the running one (see
``PagedEngine.step``), a decode's input token may still be on the device. The step inputs'
copies themselves are ``fovea.engine.transfer.to_device``.
"""

from __future__ import annotations

import torch


def pending_token(row: int) -> int:
    """The placeholder for a token still on the device: row ``row`` of the previous step's
    sampled tokens. Negative, so it can never be mistaken for a vocabulary id."""
    return -1 - row


def resolve_pending(ids: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """``ids`` (int64, on the device) with every ``pending_token(row)`` replaced by
    ``previous[row]``, the previous step's sampled tokens, without a round trip to the host."""
    if previous is None or previous.numel() == 0:  # no sampled rows: nothing can be pending
        return ids
    rows = (-1 - ids).clamp(min=0)
    return torch.where(ids < 0, previous[rows], ids)
