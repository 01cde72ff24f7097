"""One structured sequence's progress through its grammar."""

from __future__ import annotations

import torch
import xgrammar as xgr

from fovea.engine.structured.compiler import Grammar
from fovea.engine.structured.dead_ends import mask_dead_ends_
from fovea.engine.structured.spec import StructuredOutputError


class GrammarState:
    """Accepts each token that reaches the host and fills the mask of the next one.

    The next mask depends on every token before it, so it can be filled only once the previous
    token is on the host: with a step in flight the engine waits for it after queueing the next
    forward and before its sampling (``PagedEngine._complete_before_sampling``)."""

    def __init__(self, grammar: Grammar) -> None:
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.vocab_size = grammar.vocab_size
        self.dead_ends = grammar.dead_ends
        self.dead = False  # set when no token of the vocabulary could continue (see bitmask)

    def accept(self, token: int) -> None:
        if self.dead:
            raise StructuredOutputError("no token of the model's vocabulary can continue this structured answer")
        if not self.matcher.accept_token(token):
            raise StructuredOutputError(f"token {token} was sampled but its grammar does not allow it")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the answer is over."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.drop_dead_ends(bitmask, row)

    def drop_dead_ends(self, bitmask: torch.Tensor, row: int) -> None:
        """Mask, in the filled ``bitmask[row]``, the tokens no answer can be finished after
        (only for a vocabulary where some byte is not a token: see ``dead_ends``)."""
        if self.dead_ends:
            mask_dead_ends_(self.matcher, bitmask, row, self.vocab_size)
