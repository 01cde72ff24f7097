"""Generated tokens' log-probabilities in the OpenAI shapes.

Chat: ``choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": null}`` with exactly ``top_logprobs`` alternatives per token. Completions (the legacy
shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where each
``top_logprobs`` entry maps token strings to log-probabilities and also holds the sampled token
(so up to ``logprobs`` + 1 of them, as OpenAI documents). A token's string is
``tokenizer.decode([id])`` (as vLLM) and ``text_offset`` counts those strings' characters. A
token that is part of a UTF-8 character decodes to U+FFFD; its ``bytes`` are then its real
bytes (byte-level BPE's byte alphabet, or SentencePiece's ``<0xNN>`` byte tokens), so a client
can join them.
End-of-sequence and stop tokens that end an answer are not part of its text and carry no entry.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from fovea.engine.core.request import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The UTF-8 bytes a token stands for; ``text`` is its decoded string."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:
            return [int(byte.group(1), 16)]
        table = _byte_of_char()
        if piece and all(c in table for c in piece):
            return [table[c] for c in piece]
    return list(text.encode("utf-8"))


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
        return {"token": text, "logprob": logprob, "bytes": token_bytes(self.tokenizer, token_id, text)}

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


LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token float32 gives no probability at all (as vLLM clamps)


def prompt_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then per token a dict of
    ``"<token id>": {"logprob", "rank", "decoded_token"}`` holding the prompt's own token (with
    its rank, whether or not it is among the top ones) and the top tokens (ranks 1..k). Each
    distinct id is decoded once, in one batch."""
    ids = sorted({e.token_id for e in entries} | {t for e in entries for t, _ in e.top})
    text = dict(zip(ids, tokenizer.batch_decode([[i] for i in ids]))) if ids else {}
    out: list[dict | None] = [None]
    for e in entries:
        row = {str(e.token_id): {"logprob": max(e.logprob, LOGPROB_FLOOR), "rank": e.rank,
                                 "decoded_token": text[e.token_id]}}
        for rank, (token, logprob) in enumerate(e.top, 1):
            row.setdefault(str(token), {"logprob": max(logprob, LOGPROB_FLOOR), "rank": rank,
                                        "decoded_token": text[token]})
        out.append(row)
    return out
