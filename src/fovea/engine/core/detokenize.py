"""Incremental detokenisation with stop strings: emit text as soon as it is final."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes the generated ids incrementally and hands out only new, final text.

    Each token decodes a short window, not the whole output: the text of the ids since
    ``prefix_offset`` minus the text of the ids up to ``read_offset`` is the new text (the
    window keeps one earlier token for context, so tokenizers that drop a leading space or
    merge bytes across tokens decode as they would in the full text). A window that ends in
    U+FFFD (an incomplete multi-byte character) waits for the next token. Per token this
    costs the same at the 10th token as at the 10,000th; decoding everything each time was
    quadratic over a generation.

    Text that could still turn into a stop string is held back until it cannot; once a
    stop string appears, the text before it is the whole answer.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0  # first id of the decode window
        self.read_offset = 0  # ids before this are in ``text``
        self.emitted = 0  # characters of the decoded text already handed out
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _new_text(self) -> str:
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def push(self, token_id: int, check_stops: bool = True) -> str:
        """The new final text after ``token_id``; ``check_stops=False`` (before a request's
        min_tokens) lets the text through without looking for stop strings."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        new = self._new_text()
        self.text += new
        if not check_stops:
            return self._emit(len(self.text))
        # Only a match that ends in the new text can be new.
        start = max(0, len(self.text) - len(new) - self.longest_stop + 1)
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at != -1:
                self.stopped = True
                self.text = self.text[:at]
                return self._emit(len(self.text))
        # Hold back a tail that is a prefix of some stop string.
        safe = len(self.text)
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        return self._emit(safe)

    def flush(self) -> str:
        """The rest of the text at the end: held-back text and an incomplete character."""
        if not self.stopped and self.read_offset < len(self.ids):
            before = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(before):]
            self.read_offset = len(self.ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
