"""Responses kept for GET/DELETE /v1/responses/{id} and ``previous_response_id``, in memory.

Only a response created with ``store: true`` is kept. The store is bounded twice: at most
``max_entries`` responses and ``max_bytes`` of their conversations (texts and image
references, data URLs included). A new response that does not fit evicts the least recently
used ones (a GET or a continuation counts as a use); one larger than ``max_bytes`` on its own
is refused before it runs (400 ``response_too_large_to_store``). Nothing survives a restart.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fovea.errors import FoveaError

MAX_ENTRIES = 1024
MAX_BYTES = 64 * 1024 * 1024


class ResponseNotFound(FoveaError):
    status, code = 404, "response_not_found"


class TooLargeToStore(FoveaError):
    status, code = 400, "response_too_large_to_store"


# A conversation turn as the server keeps it: {"role": ..., "content": [part, ...]}, each part
# {"type": "text", "text": ...} or {"type": "image", "ref": <the image_url or file_id sent>};
# an assistant turn may add "tool_calls": [{"id", "name", "arguments"}], and a "tool" turn
# (a function's output) has "tool_call_id".
Turn = dict[str, Any]


def conversation_bytes(turns: list[Turn]) -> int:
    parts = sum(len(p.get("text") or p.get("ref") or "") + 16 for t in turns for p in t["content"])
    calls = sum(len(c["id"]) + len(c["name"]) + len(c["arguments"]) + 16 for t in turns for c in t.get("tool_calls", ()))
    return parts + calls + sum(len(t.get("tool_call_id", "")) for t in turns)


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as GET returns it
    conversation: list[Turn]  # its input (previous turns included, instructions not) and its answer
    size: int


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()
        self.evicted = 0

    def check_fits(self, turns: list[Turn]) -> None:
        """Before a response runs: refuse one whose conversation could never be stored."""
        size = conversation_bytes(turns)
        if size > self.max_bytes:
            raise TooLargeToStore(f"this response's conversation is {size} bytes, over the {self.max_bytes} bytes "
                                  "this server keeps for stored responses; send it with store: false (and the "
                                  "whole conversation as input)", param="store")

    def put(self, response_id: str, body: dict[str, Any], conversation: list[Turn]) -> None:
        size = conversation_bytes(conversation)
        with self._lock:
            self._drop(response_id)
            self._entries[response_id] = StoredResponse(body, conversation, size)
            self._total += size
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._total > self.max_bytes):
                self._drop(next(iter(self._entries)))
                self.evicted += 1

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
                return entry
        raise ResponseNotFound(f"no response {response_id!r} is stored on this server. fovea keeps a response only "
                               "when it was created with store: true (its default is false, unlike OpenAI's), in "
                               "memory, the least recently used going first beyond "
                               f"{self.max_entries} responses or {self.max_bytes / 2**20:g} MiB", param=param)

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._drop(response_id):
                return
        self.get(response_id)  # raises ResponseNotFound

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._total -= entry.size
        return True
