"""The Responses output builder (serve/responses/output.py) on made-up token streams: where text
ends and calls begin, the items' order and indexes, and which tokens' log-probabilities the text
carries."""

from __future__ import annotations

import json

from fovea.engine.core.request import FinishEvent, TokenEvent, TokenLogprob
from fovea.serve.logprobs_format import LogprobFormatter
from fovea.serve.responses.output import ResponseOutput

CALL = '<tool_call>\n{"name": "flip", "arguments": {"heads": true}}\n</tool_call>'


class Pieces:
    """A tokenizer whose token i is ``pieces[i]``."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]


def run(pieces: list[str], tools: bool, logprobs: bool = True, reason: str = "stop", incremental: bool = False):
    formatter = LogprobFormatter(Pieces(pieces), "chat") if logprobs else None
    out = ResponseOutput("msg_1", tools, formatter, incremental)
    events = out.start()
    for i, piece in enumerate(pieces):
        events += out.on_token(TokenEvent(piece, i, TokenLogprob(i, -0.5 - i, [(i, -0.5 - i)])))
    events += out.on_finish(FinishEvent(reason, "".join(pieces), 3, len(pieces), 0.0, 0.0))
    return events, out.items


def test_text_then_a_call():
    events, items = run(["Sure", ".", "\n<", CALL[1:]], tools=True)
    kinds = [kind for kind, _ in events]
    assert kinds == ["response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * 3,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done"]
    deltas = [f["delta"] for kind, f in events if kind == "response.output_text.delta"]
    assert deltas == ["Sure", ".", "\n"]  # the "<" that could begin a call was held, then was one
    message, call = items
    assert message["type"] == "message" and message["content"][0]["text"] == "Sure.\n"
    # The text's three tokens carry log-probabilities; the call's token is no output_text.
    assert [e["token"] for e in message["content"][0]["logprobs"]] == ["Sure", ".", "\n<"]
    assert call["type"] == "function_call" and call["name"] == "flip" and json.loads(call["arguments"]) == {"heads": True}
    assert [f["output_index"] for kind, f in events if kind == "response.output_item.added"] == [0, 1]
    assert {f["item_id"] for kind, f in events if "function_call_arguments" in kind} == {call["id"]}


def test_only_a_call_has_no_message():
    events, items = run([CALL[:5], CALL[5:]], tools=True)
    assert [i["type"] for i in items] == ["function_call"]
    assert events[0][0] == "response.output_item.added" and events[0][1]["item"]["arguments"] == ""
    assert events[0][1]["output_index"] == 0


def test_held_text_that_begins_no_call_is_released():
    events, items = run(["a<", "tool", "!"], tools=True)
    (message,) = items
    assert message["content"][0]["text"] == "a<tool!"
    assert "".join(f["delta"] for kind, f in events if kind == "response.output_text.delta") == "a<tool!"
    assert len(message["content"][0]["logprobs"]) == 3


def test_without_tools_the_message_opens_first_and_an_empty_answer_is_one_empty_message():
    events, items = run([], tools=False, logprobs=False, reason="length")
    assert [kind for kind, _ in events][:2] == ["response.output_item.added", "response.content_part.added"]
    (message,) = items
    assert message["status"] == "incomplete" and message["content"][0] == {
        "type": "output_text", "text": "", "annotations": [], "logprobs": []}
    events, items = run([CALL], tools=False)  # no tools: a call-shaped text is text
    assert items[0]["content"][0]["text"] == CALL


def test_incremental_arguments_and_text_after_the_calls():
    pieces = ["Hi", "<tool_call>\n", '{"name": "flip", "arguments": ', '{"heads"', ": true}", "}\n</tool_call>", " bye"]
    events, items = run(pieces, tools=True, incremental=True)
    kinds = [kind for kind, _ in events]
    start = kinds.index("response.output_item.done")  # the text before the call closes when it begins
    assert kinds[start + 1:start + 5] == ["response.output_item.added", *["response.function_call_arguments.delta"] * 2,
                                          "response.function_call_arguments.done"]
    deltas = [f["delta"] for kind, f in events if kind == "response.function_call_arguments.delta"]
    assert deltas == ['{"heads"', ": true}"]  # as written, without the call's closing "}"
    message, call, after = items
    assert message["content"][0]["text"] == "Hi" and after["content"][0]["text"] == "bye"
    assert message["id"] == "msg_1" and after["id"] != "msg_1" and after["content"][0]["logprobs"] == []
    assert call["arguments"] == '{"heads": true}' and call["status"] == "completed"
    assert [f["output_index"] for kind, f in events if kind == "response.output_item.added"] == [0, 1, 2]
    assert [f["item"]["id"] for kind, f in events if kind == "response.output_item.done"] == [i["id"] for i in items]


def test_a_call_without_a_grammar_goes_out_when_its_block_closes():
    events, items = run([CALL[:30], CALL[30:], " and more"], tools=True)
    kinds = [kind for kind, _ in events]
    # All four of the call's events come with the token that closed it, before the text after it.
    assert kinds[:4] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done"]
    assert [i["type"] for i in items] == ["function_call", "message"]
