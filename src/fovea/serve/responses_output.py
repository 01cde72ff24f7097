"""The output items of one /v1/responses answer, built as its tokens arrive.

A streamed and a non-streamed response run the same builder (the second drops the events),
so both carry the same items. The answer's text is one ``message`` item; with tools it is held
back from the first ``<tool_call>`` on (chat's ``CallHoldback``), it exists only when it is
not empty (or there are no calls), and each call becomes a ``function_call`` item after it.
Log-probabilities, when asked, belong to the text they were released with; the tokens of the
calls (and of text after them) carry none, as the calls are no ``output_text``.
"""

from __future__ import annotations

from typing import Any

from fovea.engine.request import FinishEvent, TokenEvent, TokenLogprob
from fovea.serve.logprobs_format import LogprobFormatter
from fovea.serve.responses_api import function_call_item, message_item, new_id, output_text
from fovea.serve.tools import CallHoldback

Event = tuple[str, dict[str, Any]]  # (type, fields), written by responses_api.EventWriter


class ResponseOutput:
    def __init__(self, message_id: str, tools: bool, logprobs: LogprobFormatter | None) -> None:
        self.message_id = message_id
        self.holdback = CallHoldback() if tools else None
        self.formatter = logprobs
        self.text = ""  # the message's text so far
        self.logprobs: list[dict[str, Any]] = []  # its tokens' entries
        self.pending: list[TokenLogprob] = []  # tokens whose text is not released yet
        self.index: int | None = None  # the message's output_index once it is open
        self.items: list[dict[str, Any]] = []  # finished output items

    def start(self) -> list[Event]:
        """Without tools the message opens at once (its text is all there will be)."""
        return [] if self.holdback is not None else self._open()

    def on_token(self, event: TokenEvent) -> list[Event]:
        if self.formatter is not None and event.logprob is not None:
            self.pending.append(event.logprob)
        released = event.text if self.holdback is None else self.holdback.feed(event.text)
        return self._text(released, take_logprobs=True) if released else []

    def on_finish(self, finish: FinishEvent) -> list[Event]:
        status = "completed" if finish.finish_reason == "stop" else "incomplete"
        rest, calls = self.holdback.finish() if self.holdback is not None else ("", [])
        events = self._text(rest, take_logprobs=not calls) if rest or (self.pending and not calls) else []
        if self.index is None and not calls:
            events += self._open()  # an empty answer is still one (empty) message
        if self.index is not None:
            events += self._close(status)
        for call in calls:
            item = function_call_item(new_id("fc"), "completed", call["id"], call["function"]["name"],
                                      call["function"]["arguments"])
            where = {"item_id": item["id"], "output_index": len(self.items)}
            events += [("response.output_item.added", {"output_index": len(self.items),
                                                       "item": {**item, "status": "in_progress", "arguments": ""}}),
                       ("response.function_call_arguments.delta", {**where, "delta": item["arguments"]}),
                       ("response.function_call_arguments.done", {**where, "arguments": item["arguments"]}),
                       ("response.output_item.done", {"output_index": len(self.items), "item": item})]
            self.items.append(item)
        return events

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
        return [("response.output_text.done", {**self._where(), "text": self.text, "logprobs": self.logprobs}),
                ("response.content_part.done", {**self._where(), "part": item["content"][0]}),
                ("response.output_item.done", {"output_index": self.index, "item": item})]
