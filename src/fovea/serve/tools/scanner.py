"""One tool call's JSON object, ``{"name": ..., "arguments": {...}}``, read a character at a time.

The scanner knows when the ``name`` string has closed and which characters belong to the
``arguments`` value (string and escape state and bracket depth tell where it ends), so the
arguments can be streamed as the model writes them. It checks the object's shape, not all of
JSON (a bad number passes): ``json.loads`` of the whole block stays the final word
(serve/tools/calls.py ``parse_tool_calls``). A repeated ``name`` or ``arguments`` key breaks it (JSON
would keep the last one, which streaming cannot know).
"""

from __future__ import annotations

import json

_WS = " \t\n\r"  # JSON's whitespace


class CallScanner:
    def __init__(self) -> None:
        # start | key_or_close | key | in_key | colon | value | after | done | broken
        self.state = "start"
        self.key = ""  # the key whose value is being read
        self.raw = ""  # the raw text of that key (in_key) or value (value)
        self.depth = 0
        self.in_string = self.escape = False
        self.seen: set[str] = set()
        self.name: str | None = None  # once its string has closed
        self.arguments: str | None = None  # the raw text of the arguments value once it has ended

    @property
    def broken(self) -> bool:
        return self.state == "broken"

    @property
    def partial_arguments(self) -> str:
        """The arguments object's text so far ("" while none, or when the value is not an object:
        a string or scalar is sent whole once the block has parsed)."""
        if self.arguments is not None:
            return self.arguments if self.arguments.startswith("{") else ""
        if self.state == "value" and self.key == "arguments" and self.raw.startswith("{"):
            return self.raw
        return ""

    def feed(self, text: str) -> None:
        for ch in text:
            if self.state == "broken":
                return
            self._char(ch)

    def _char(self, ch: str) -> None:
        state = self.state
        if state == "value":
            self._value_char(ch)
        elif state == "in_key":
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self._key_done()
                return
            self.raw += ch
        elif ch in _WS:
            return
        elif state == "start":
            self.state = "key_or_close" if ch == "{" else "broken"
        elif state in ("key_or_close", "key") and ch == '"':
            self.state, self.raw = "in_key", ""
        elif state in ("key_or_close", "after") and ch == "}":
            self.state = "done"
        elif state == "colon" and ch == ":":
            self.state, self.raw, self.depth = "value", "", 0
        elif state == "after" and ch == ",":
            self.state = "key"
        else:
            self.state = "broken"

    def _key_done(self) -> None:
        try:
            key = json.loads(f'"{self.raw}"')
        except json.JSONDecodeError:
            self.state = "broken"
            return
        if key in self.seen and key in ("name", "arguments"):
            self.state = "broken"
            return
        self.seen.add(key)
        self.key, self.state = key, "colon"

    def _value_char(self, ch: str) -> None:
        if self.in_string:
            self.raw += ch
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:
                    self._value_done()
            return
        if not self.raw and ch in _WS:
            return
        if ch == '"':
            self.in_string = True
            self.raw += ch
        elif ch in "{[":
            self.depth += 1
            self.raw += ch
        elif ch in "}]" and self.depth > 0:
            self.depth -= 1
            self.raw += ch
            if self.depth == 0:
                self._value_done()
        elif self.depth == 0 and (ch in _WS or ch in ",}]"):
            if not self.raw:
                self.state = "broken"
                return
            self._value_done()  # a scalar ended: the character belongs to what follows
            self._char(ch)
        else:
            self.raw += ch

    def _value_done(self) -> None:
        self.state = "after"
        if self.key == "name":
            try:
                name = json.loads(self.raw)
            except json.JSONDecodeError:
                name = None
            if not isinstance(name, str):
                self.state = "broken"
                return
            self.name = name
        elif self.key == "arguments":
            self.arguments = self.raw
