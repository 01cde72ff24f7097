"""Generated tokens' log-probabilities in the OpenAI shapes.

Chat: ``choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": null}`` with exactly ``top_logprobs`` alternatives per token. Completions (the legacy
shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where each
``top_logprobs`` entry maps token strings to log-probabilities and also holds the sampled token
(so up to ``logprobs`` + 1 of them, as OpenAI documents). A token's string is
``tokenizer.decode([id])`` (as vLLM) and ``text_offset`` counts those strings' characters.
End-of-sequence and stop tokens that end an answer are not part of its text and carry no entry.
"""

from __future__ import annotations

from typing import Any

from fovea.engine.request import TokenLogprob


class LogprobFormatter:
    """One choice's entries; ``kind`` is "chat" or "text". Streams call ``format`` per chunk:
    the text offsets carry on from one call to the next."""

    def __init__(self, tokenizer: Any, kind: str) -> None:
        self.tokenizer, self.kind = tokenizer, kind
        self.offset = 0
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self.tokenizer.decode([token_id])
        return text

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def format(self, entries: list[TokenLogprob]) -> dict:
        if self.kind == "chat":
            content = [{**self._chat_entry(e.token_id, e.logprob),
                        "top_logprobs": [self._chat_entry(t, lp) for t, lp in e.top]} for e in entries]
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self.token(e.token_id))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        tops = [{**{self.token(t): lp for t, lp in e.top}, self.token(e.token_id): e.logprob} for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}
