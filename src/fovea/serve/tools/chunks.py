"""Chat's answers with tool calls: ``message.tool_calls``, or in a stream ``delta.tool_calls``.

A call's first chunk carries ``{index, id, type: "function", function: {name, arguments: ""}}``
and the next ones ``{index, function: {arguments: <piece>}}``, as OpenAI's and vLLM's streams
do (serve/tools/stream.py says when the pieces go out). Streamed text is released up to the
first ``<tool_call>``; the text between and after calls is sent at the end, as the non-streamed
``content`` has it.
"""

from __future__ import annotations

from typing import Any

from fovea.engine.core.request import FinishEvent
from fovea.serve import protocol
from fovea.serve.generation import Format
from fovea.serve.tools.calls import CallHoldback, parse_tool_calls
from fovea.serve.tools.stream import CallEvent, CallStream


class ToolFormat(Format):
    """One instance per request (it holds each choice's streamed text); ``incremental``: a grammar
    enforces the calls, so their arguments stream as they are written."""

    def __init__(self, incremental: bool = False) -> None:
        super().__init__("chat")
        self.incremental = incremental
        self.held: dict[int, CallHoldback] = {}
        self.calls: dict[int, CallStream] = {}

    def choice(self, index: int, finish: FinishEvent, logprobs: dict | None) -> dict:
        body = super().choice(index, finish, logprobs)
        content, calls = parse_tool_calls(finish.text)
        if calls:
            body["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            if finish.finish_reason == "stop":
                body["finish_reason"] = "tool_calls"
        return body

    def _stream(self, index: int) -> tuple[CallHoldback, CallStream]:
        if index not in self.held:
            self.held[index], self.calls[index] = CallHoldback(), CallStream(self.incremental)
        return self.held[index], self.calls[index]

    def on_text(self, rid, model, created, text: str, index: int = 0, logprobs: dict | None = None) -> list[dict]:
        held, calls = self._stream(index)
        released = held.feed(text)
        chunks = [self._call_chunk(rid, model, created, event, index) for event in calls.feed(text)]
        chunks = [c for c in chunks if c is not None]
        if released or logprobs is not None:
            # A held-back token's log-probabilities still go out, with no text.
            chunks.insert(0, self.delta(rid, model, created, released, index=index, logprobs=logprobs))
        return chunks

    def on_finish(self, rid, model, created, finish_reason: str, index: int = 0) -> list[dict]:
        """Raises ``ToolCallIncomplete`` when streamed call pieces are no valid call."""
        held, stream = self._stream(index)
        _, calls, streamed = stream.finish()
        rest, _ = held.finish()
        out = [self.delta(rid, model, created, rest, index=index)] if rest else []
        for i, call in enumerate(calls[streamed:], start=streamed):  # not streamed (none in practice)
            out.append(protocol.chat_chunk(rid, model, created, {"tool_calls": [{"index": i, **call}]}, index=index))
        reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        return [*out, self.delta(rid, model, created, "", reason, index=index)]

    @staticmethod
    def _call_chunk(rid, model, created, event: CallEvent, index: int) -> dict[str, Any] | None:
        kind, i, value = event
        if kind == "begin":
            delta = {"index": i, "id": value.id, "type": "function", "function": {"name": value.name, "arguments": ""}}
        elif kind == "arguments":
            delta = {"index": i, "function": {"arguments": value}}
        else:
            return None
        return protocol.chat_chunk(rid, model, created, {"tool_calls": [delta]}, index=index)
