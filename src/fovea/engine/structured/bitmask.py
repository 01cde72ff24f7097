"""The structured rows' token masks, applied to a step's logits in place on their device.

Only the rows of structured sequences are filled (on the host, by each row's matcher) and
masked (xgrammar's ``apply_token_bitmask_inplace`` with their indices): free-text rows of the
same batch are not touched. On CUDA the filled rows cross in one asynchronous copy from
pinned memory, queued behind the step's forward like the rest of the step's inputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence as Seq

import torch
import xgrammar as xgr

from fovea.engine.transfer import to_device

log = logging.getLogger("fovea.engine.structured")
_device_backend = "auto"  # xgrammar picks Triton on CUDA; "torch_native" once that failed here

PARALLEL_FILL_ROWS = 16  # from this many structured rows on, masks are filled on several threads
_batch_matcher: xgr.BatchGrammarMatcher | None = None


def fill_masks(states: list, compact: torch.Tensor) -> None:
    """Row k of ``compact`` gets state k's next mask; many rows are filled by xgrammar's own
    thread pool (its C++ threads, outside the GIL), a few one after another."""
    global _batch_matcher
    if len(states) < PARALLEL_FILL_ROWS:
        for k, state in enumerate(states):
            state.fill(compact, k)
        return
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max(1, min(8, (os.cpu_count() or 2) // 2)))
    _batch_matcher.batch_fill_next_token_bitmask([state.matcher for state in states], compact)
    for k, state in enumerate(states):
        state.drop_dead_ends(compact, k)


def structured_rows(seqs: Seq) -> list[int]:
    """Rows to mask: a row whose sequence ended while the step was queued (its grammar complete,
    or it failed) samples a token nobody reads, and its matcher has nothing left to allow."""
    return [i for i, seq in enumerate(seqs) if (grammar := getattr(seq, "grammar", None)) is not None
            and not grammar.terminated and not getattr(seq, "ended", False)]


def apply_grammar_masks_(logits: torch.Tensor, seqs: Seq) -> None:
    """Mask, in ``logits`` ([len(seqs), vocab]), every token the row's grammar does not allow next."""
    rows = structured_rows(seqs)
    if not rows:
        return
    vocab = logits.shape[-1]
    on_cuda = logits.device.type == "cuda"
    compact = torch.full(xgr.get_bitmask_shape(len(rows), vocab), -1, dtype=torch.int32, pin_memory=on_cuda)
    fill_masks([seqs[row].grammar for row in rows], compact)
    empty = (compact == 0).all(dim=-1)
    for k in empty.nonzero().flatten().tolist():
        # No token can go on (only past a dead-end search that ran out of steps). Raising here
        # would fail the whole batch: the row samples unmasked and its matcher refuses that
        # token when it reaches the host, failing this sequence only.
        seqs[rows[k]].grammar.dead = True
        compact[k] = -1
    if on_cuda:
        apply_staged_(logits, compact, rows)
        return
    full = torch.empty((len(seqs), compact.shape[-1]), dtype=torch.int32)
    full[rows] = compact
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=rows)


def apply_staged_(logits: torch.Tensor, compact: torch.Tensor, rows: list[int]) -> None:
    """The device path: ``compact`` (the structured rows' masks, on the host) and the row indices
    cross without waiting for the running step, into a batch-sized mask on the logits' device
    whose other rows are never read (the kernel masks only ``rows``)."""
    index = to_device(logits.device, [(rows, torch.int32)])[0]
    full = torch.empty((logits.shape[0], compact.shape[-1]), dtype=torch.int32, device=logits.device)
    full.index_copy_(0, index.long(), compact.to(logits.device, non_blocking=True))
    global _device_backend
    try:
        xgr.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[-1], indices=index,
                                        backend=_device_backend)
    except (ImportError, RuntimeError) as exc:  # xgrammar's Triton kernel could not build here
        if _device_backend == "torch_native" or isinstance(exc, torch.OutOfMemoryError):
            raise
        log.warning("xgrammar's Triton mask kernel failed (%s: %s); masking with torch from now on",
                    type(exc).__name__, exc)
        _device_backend = "torch_native"
        xgr.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[-1], indices=index,
                                        backend=_device_backend)
