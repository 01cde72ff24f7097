"""One answer's tool calls as its text streams: a call begins (its name known), pieces of its
arguments, it ends; and at the end of the answer, the check that what was streamed is what the
final parse (``parse_tool_calls`` on the whole text) finds.

Where a grammar enforces the calls (``tool_choice`` ``required``, a named function, or ``auto``
without parallel calls, whose calls are valid once begun) the arguments go out as the model
writes them: the model's own characters of the ``arguments`` object, which the final arguments
are too (``parse_block``). Without a grammar (``auto`` with parallel calls) a block may turn out
not to be a call, and text is never taken back, so each call goes out whole once its block has
closed and parsed. Either way an answer that ends where the streamed calls disagree with the
final parse (cut by ``max_tokens`` or a stop string inside a call, a block that broke) ends the
stream with the error ``tool_call_incomplete``, never with a wrong call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fovea.errors import FoveaError
from fovea.serve.tools.calls import CALL_CLOSE, CALL_OPEN, new_call_id, parse_block, parse_tool_calls
from fovea.serve.tools.scanner import CallScanner


class ToolCallIncomplete(FoveaError):
    """Tool-call pieces went out that the finished answer does not hold as a valid call."""

    status, code, type = 500, "tool_call_incomplete", "server_error"


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str = ""  # the pieces sent so far, joined
    ended: bool = False  # its block closed and parsed to this name and these arguments


# ("begin", call index, call) | ("arguments", call index, the new piece) | ("end", call index, call)
CallEvent = tuple[str, int, Any]


class CallStream:
    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self.full = ""
        self.pos = 0  # where the next <tool_call> is looked for
        self.body: int | None = None  # where the open block's JSON begins
        self.fed = 0  # how far the open block's text went to the scanner
        self.scanner = CallScanner()
        self.current: StreamedCall | None = None  # the open block's call once it has begun
        self.calls: list[StreamedCall] = []

    def feed(self, text: str) -> list[CallEvent]:
        old = len(self.full)  # a tag not found before ends in the new text: look only near it
        self.full += text
        events: list[CallEvent] = []
        while True:
            if self.body is None:
                at = self.full.find(CALL_OPEN, max(self.pos, old - len(CALL_OPEN) + 1))
                if at < 0:
                    return events
                self.body = self.fed = at + len(CALL_OPEN)
                self.scanner, self.current = CallScanner(), None
            close = self.full.find(CALL_CLOSE, max(self.body, old - len(CALL_CLOSE) + 1))
            # A suffix that could begin </tool_call> waits: the block may end there.
            limit = close if close >= 0 else max(self.fed, len(self.full) - _close_prefix(self.full))
            if limit > self.fed:
                self.scanner.feed(self.full[self.fed:limit])
                self.fed = limit
                if self.incremental:
                    events += self._progress()
            if close < 0:
                return events
            events += self._end(self.full[self.body:close])
            self.pos, self.body = close + len(CALL_CLOSE), None

    def _begin(self, name: str) -> list[CallEvent]:
        self.current = StreamedCall(new_call_id(), name)
        self.calls.append(self.current)
        return [("begin", len(self.calls) - 1, self.current)]

    def _send(self, call: StreamedCall, arguments: str) -> list[CallEvent]:
        """The piece of ``arguments`` (all of them so far) not sent yet."""
        piece = arguments[len(call.arguments):]
        if not piece:
            return []
        call.arguments = arguments
        return [("arguments", self.calls.index(call), piece)]

    def _progress(self) -> list[CallEvent]:
        scanner = self.scanner  # once broken, it says no more (the end decides)
        events: list[CallEvent] = []
        if self.current is None and scanner.name is not None and not scanner.broken:
            events += self._begin(scanner.name)  # arguments written before the name waited for it
        if self.current is not None:
            events += self._send(self.current, scanner.partial_arguments)
        return events

    def _end(self, body: str) -> list[CallEvent]:
        block = parse_block(body)
        call = self.current
        if call is None:  # nothing of it went out: all of it, or nothing when it is no call
            if block is None:
                return []
            events = self._begin(block[0])
            call = self.current
        elif block is None or block[0] != call.name or not block[1].startswith(call.arguments):
            return []  # what went out is not this call: the finish check fails
        else:
            events = []
        assert call is not None
        events += self._send(call, block[1])
        call.ended = True
        self.current = None
        return [*events, ("end", self.calls.index(call), call)]

    def finish(self, text: str | None = None) -> tuple[str | None, list[dict[str, Any]], int]:
        """The final parse of ``text`` (the streamed text when None): (the content, the calls in
        chat's shape with the streamed calls' ids, how many of them were streamed). Raises
        ``ToolCallIncomplete`` when the streamed calls are not the first of the final ones."""
        content, calls = parse_tool_calls(self.full if text is None else text)
        streamed = self.calls
        if len(streamed) > len(calls) or not all(
                s.ended and s.name == c["function"]["name"] and s.arguments == c["function"]["arguments"]
                for s, c in zip(streamed, calls, strict=False)):
            raise ToolCallIncomplete("the answer ended inside a tool call, or a streamed tool call did not "
                                     "parse (max_tokens or a stop string may have cut it): the call's pieces "
                                     "already sent are not a valid call.")
        for s, c in zip(streamed, calls, strict=False):
            c["id"] = s.id
        return content, calls, len(streamed)


def _close_prefix(text: str) -> int:
    """The length of the longest suffix of ``text`` that begins ``</tool_call>``."""
    for n in range(min(len(CALL_CLOSE) - 1, len(text)), 0, -1):
        if CALL_CLOSE.startswith(text[-n:]):
            return n
    return 0
