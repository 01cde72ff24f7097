"""The output items of one /v1/responses answer, built as its tokens arrive.

A streamed and a non-streamed response run the same builder (the second drops the events),
so both carry the same items. Without tools the answer's text is one ``message`` item. With
tools the text is released up to the first ``<tool_call>`` (chat's ``CallHoldback``) into a
``message`` item that closes when the first call begins; each call is a ``function_call`` item
whose arguments stream as serve/tools/stream.py says; the text between and after the calls, if
any, is a second ``message`` at the end. A message exists only when it is not empty (or there
are no calls). Log-probabilities, when asked, belong to the text they were released with; the
tokens of the calls (and of text after them) carry none, as the calls are no ``output_text``.
"""

from __future__ import annotations

from typing import Any

from fovea.engine.core.request import FinishEvent, TokenEvent, TokenLogprob
from fovea.serve.logprobs_format import LogprobFormatter
from fovea.serve.responses.api import function_call_item, message_item, new_id, output_text
from fovea.serve.tools.calls import CallHoldback
from fovea.serve.tools.stream import CallEvent, CallStream

Event = tuple[str, dict[str, Any]]  # (type, fields), written by responses.api.EventWriter


class ResponseOutput:
    """``tools``: the answer may hold calls; ``incremental``: a grammar enforces them, so their
    arguments stream as they are written."""

    def __init__(self, message_id: str, tools: bool, logprobs: LogprobFormatter | None,
                 incremental: bool = False) -> None:
        self.message_id = message_id
        self.holdback = CallHoldback() if tools else None
        self.calls = CallStream(incremental) if tools else None
        self.formatter = logprobs
        self.text = ""  # the open message's text so far
        self.logprobs: list[dict[str, Any]] = []  # its tokens' entries
        self.pending: list[TokenLogprob] = []  # tokens whose text is not released yet
        self.index: int | None = None  # the open message's output_index
        self.items: list[dict[str, Any]] = []  # finished output items
        self.call_items: dict[int, dict[str, Any]] = {}  # call index -> its item, once begun

    def start(self) -> list[Event]:
        """Without tools the message opens at once (its text is all there will be)."""
        return [] if self.holdback is not None else self._open()

    def on_token(self, event: TokenEvent) -> list[Event]:
        if self.formatter is not None and event.logprob is not None:
            self.pending.append(event.logprob)
        if self.holdback is None or self.calls is None:
            return self._text(event.text, take_logprobs=True) if event.text else []
        released = self.holdback.feed(event.text)
        events = self._text(released, take_logprobs=True) if released else []
        for call_event in self.calls.feed(event.text):
            events += self._call(call_event)
        return events

    def on_finish(self, finish: FinishEvent) -> list[Event]:
        """Raises ``ToolCallIncomplete`` when streamed call pieces are no valid call."""
        status = "completed" if finish.finish_reason == "stop" else "incomplete"
        if self.holdback is None or self.calls is None:
            rest, calls, streamed = "", [], 0
        else:
            _, calls, streamed = self.calls.finish(finish.text)
            rest, _ = self.holdback.finish()
        events: list[Event] = []
        for i, call in enumerate(calls[streamed:], start=streamed):  # not streamed (none in practice)
            fn = call["function"]
            item = {"id": new_id("fc"), "call_id": call["id"], "name": fn["name"]}
            self.call_items[i] = item
            events += self._call(("end", i, None), fn["arguments"])
        if calls and rest and self.index is None:
            self.message_id = new_id("msg")  # the text after the calls: a message of its own
        if rest or (self.pending and not calls):
            events += self._text(rest, take_logprobs=not calls)
        if self.index is None and not self.items:
            events += self._open()  # an empty answer is still one (empty) message
        if self.index is not None:
            events += self._close(status)
        return events

    def _call(self, event: CallEvent, whole: str | None = None) -> list[Event]:
        """One call event's Responses events; ``whole``: a call not streamed, sent at once."""
        kind, i, call = event
        events: list[Event] = []
        if kind == "begin":
            if self.index is not None:
                events += self._close("completed")  # the text before the call is whole
            self.pending = []  # the call's tokens: no output_text, no log-probabilities
            self.call_items[i] = {"id": new_id("fc"), "call_id": call.id, "name": call.name}
            return [*events, *self._added(i)]
        item = self.call_items[i]
        if whole is not None:  # the end of a call not streamed: all of it at once
            events += self._added(i)
        where = {"item_id": item["id"], "output_index": item["output_index"]}
        if kind == "arguments":
            return [("response.function_call_arguments.delta", {**where, "delta": call})]
        if whole is not None:
            events.append(("response.function_call_arguments.delta", {**where, "delta": whole}))
        arguments = whole if whole is not None else call.arguments
        done = function_call_item(item["id"], "completed", item["call_id"], item["name"], arguments)
        self.items.append(done)
        return [*events, ("response.function_call_arguments.done", {**where, "arguments": arguments}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": done})]

    def _added(self, i: int) -> list[Event]:
        item = self.call_items[i]
        item["output_index"] = len(self.items)
        fields = function_call_item(item["id"], "in_progress", item["call_id"], item["name"], "")
        return [("response.output_item.added", {"output_index": item["output_index"], "item": fields})]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": self.index, "content_index": 0}

    def _open(self) -> list[Event]:
        self.index = len(self.items)
        return [("response.output_item.added", {"output_index": self.index,
                                                "item": message_item(self.message_id, "in_progress", None)}),
                ("response.content_part.added", {**self._where(), "part": output_text("")})]

    def _text(self, text: str, take_logprobs: bool) -> list[Event]:
        events = self._open() if self.index is None else []
        entries: list[dict[str, Any]] = []
        if take_logprobs and self.formatter is not None:
            entries = self.formatter.format(self.pending)["content"]
            self.logprobs += entries
        self.pending = []
        self.text += text
        return [*events, ("response.output_text.delta", {**self._where(), "delta": text, "logprobs": entries})]

    def _close(self, status: str) -> list[Event]:
        item = message_item(self.message_id, status, self.text, self.logprobs)
        self.items.append(item)
        events = [("response.output_text.done", {**self._where(), "text": self.text, "logprobs": self.logprobs}),
                  ("response.content_part.done", {**self._where(), "part": item["content"][0]}),
                  ("response.output_item.done", {"output_index": self.index, "item": item})]
        self.index, self.text, self.logprobs = None, "", []
        return events
