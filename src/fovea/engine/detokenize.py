"""Incremental detokenisation with stop strings: emit text as soon as it is final."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes the growing list of generated ids and hands out only new, final text.

    Text that could still turn into a stop string is held back until it cannot; once a
    stop string appears, the text before it is the whole answer.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            at = self.text.find(stop)
            if at != -1:
                self.stopped = True
                self.text = self.text[:at]
                return self._emit(len(self.text))
        # Hold back a tail that is a prefix of some stop string, and a trailing U+FFFD
        # (an incomplete multi-byte character that the next token completes).
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        return self._emit(safe)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
