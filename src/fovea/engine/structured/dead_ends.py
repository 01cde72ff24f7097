"""Tokens a grammar allows that the vocabulary cannot finish, found and masked.

xgrammar allows a token when its text can begin the rest of a valid answer; it does not ask
whether this vocabulary can write that rest. When every byte is a token (byte-level BPE,
SentencePiece with byte fallback) it always can. When some are not (the demo's word-level
vocabulary has "on" beside "one" but no "e", and no space), a token can lead where no token
goes on: greedy decoding takes it whenever the model prefers it to every whole word, and the
answer stops halfway. For such vocabularies each allowed token is checked by a bounded search
for a way to the grammar's end, and the tokens that have none are masked.

Dead ends come from literal words (a choice, an alternation, an enum) met by a vocabulary that
splits them badly, where a mask allows few tokens. A mask that allows many (free text inside a
string, ``[a-z]+`` over a 150k-word vocabulary) is left as filled: checking each of its tokens
would cost more than the step.
"""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

SEARCH_STEPS = 4096  # tokens tried per check; past it, what is not yet known is kept (allowed)
MAX_DEPTH = 64  # tokens looked ahead
MAX_CHECKED = 1024  # a mask allowing more tokens than this is not checked


def spells_every_byte(info: xgr.TokenizerInfo) -> bool:
    """Whether each of the 256 bytes is a token of its own: then any text a grammar allows can
    be written one byte at a time, and no allowed token is a dead end."""
    return len({token for token in info.decoded_vocab if len(token) == 1}) == 256


class Budget:
    def __init__(self, steps: int | None = None) -> None:
        self.left = SEARCH_STEPS if steps is None else steps

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_count(mask_row: torch.Tensor) -> int:
    """How many bits are set in one packed int32 mask row (0.5 ms for a 152k vocabulary)."""
    return int(np.unpackbits(mask_row.contiguous().numpy().view(np.uint8)).sum())


def allowed_tokens(mask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids whose bit is set in one packed int32 mask row (only its non-zero words
    are unpacked)."""
    words = mask_row.nonzero().flatten()
    bits = ((mask_row[words].unsqueeze(-1) >> _BITS) & 1).bool()
    ids = (words.unsqueeze(-1) * 32 + _BITS)[bits]
    return ids[ids < vocab_size].tolist()


def can_finish(matcher: xgr.GrammarMatcher, vocab_size: int, budget: Budget) -> bool | None:
    """True: some tokens take ``matcher`` to a complete answer; False: none can; None: the
    search ran out of steps first. Iterative deepening finds the shortest way first, and the
    matcher is left as it was (each token tried is rolled back)."""
    scratch = xgr.allocate_token_bitmask(1, vocab_size)
    stops = set(matcher.stop_token_ids)
    for depth in range(MAX_DEPTH + 1):
        found = _within(matcher, depth, vocab_size, stops, scratch, budget)
        if found is not None:
            return found
        if budget.left <= 0:
            return None
    return None


def _within(matcher: xgr.GrammarMatcher, depth: int, vocab_size: int, stops: set[int], scratch: torch.Tensor,
            budget: Budget) -> bool | None:
    """Whether an answer completes within ``depth`` more tokens (None: cut by depth or budget)."""
    if matcher.is_completed():
        return True
    if depth == 0:
        return None
    matcher.fill_next_token_bitmask(scratch)
    cut = False
    for token in allowed_tokens(scratch[0], vocab_size):
        if token in stops:
            continue
        if not budget.take():
            return None
        if not matcher.accept_token(token):  # not in a filled mask; guards the rollback below
            continue
        found = _within(matcher, depth - 1, vocab_size, stops, scratch, budget)
        matcher.rollback(1)
        if found:
            return True
        cut |= found is None
    return None if cut else False


def mask_dead_ends_(matcher: xgr.GrammarMatcher, bitmask: torch.Tensor, row: int, vocab_size: int) -> None:
    """Clear, in ``bitmask[row]`` (already filled for ``matcher``), every allowed token after
    which no answer can be completed. One budget covers the row: tokens it does not reach stay."""
    if allowed_count(bitmask[row]) > MAX_CHECKED:
        return
    allowed = allowed_tokens(bitmask[row], vocab_size)
    budget = Budget()
    stops = set(matcher.stop_token_ids)
    for token in allowed:
        if token in stops:
            continue  # ends a complete answer
        if not matcher.accept_token(token):
            continue
        finishes = can_finish(matcher, vocab_size, budget)
        matcher.rollback(1)
        if finishes is False:
            bitmask[row, token // 32] &= _cleared(token % 32)
        if budget.left <= 0:
            return


def _cleared(bit: int) -> int:
    """An int32 with every bit set but ``bit`` (as a signed value: bit 31 is the sign)."""
    return (~(1 << bit) + 2**31) % 2**32 - 2**31
