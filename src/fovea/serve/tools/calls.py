"""Tool calling: ``tools`` rendered by the model's chat template, answers parsed into ``tool_calls``.

fovea parses one tool-call format, the Hermes style of Qwen2.5 and its kin:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. A model whose chat template
does not mention tools, or writes calls in another format, refuses tool requests with 400
``tools_not_supported`` (Qwen2.5-VL's own template has no tools; LLaVA's neither).
``tool_choice``: ``"auto"`` lets the model choose (nothing is constrained); ``"required"`` or a
named function is enforced by a grammar (an xgrammar structural tag over the calls' JSON
schemas); ``"none"`` disables tools (they are not rendered). The deprecated ``functions`` /
``function_call`` are read as ``tools`` / ``tool_choice``. The Responses API runs the same
checks, grammar, parsing and streamed-text holdback in its own shapes (serve/responses/tools.py).
Streamed calls: serve/tools/stream.py (when their pieces go out), serve/tools/chunks.py (chat's chunks).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fovea.engine.structured.spec import GrammarSpec
from fovea.errors import FoveaError, InvalidRequest
from fovea.serve.tools.scanner import CallScanner

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolsNotSupported(FoveaError):
    status, code = 400, "tools_not_supported"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}, checked
    choice: str  # "auto" | "required" | "named"
    name: str | None  # the named function
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def chat_template(loaded: Any) -> str:
    for owner in (loaded.processor, loaded.tokenizer):
        template = getattr(owner, "chat_template", None)
        if isinstance(template, str) and template:
            return template
    return ""


def check_template(loaded: Any, what: str, param: str) -> None:
    template = chat_template(loaded)
    if "tools" not in template:
        raise ToolsNotSupported(f"{what}: this model's chat template does not render tools, so the model was "
                                "not trained to call them; describe the functions in the prompt instead.", param=param)
    if CALL_OPEN not in template:
        raise ToolsNotSupported(f"{what}: this model's chat template writes tool calls in a format fovea does not "
                                f"parse (fovea parses {CALL_OPEN}{{...}}{CALL_CLOSE}).", param=param)


def function_spec(fn: dict[str, Any], where: str) -> dict[str, Any]:
    """One function's ``name``, ``description``, ``parameters`` and ``strict`` (kept when true;
    ``required`` and named calls are always held to their schema), checked; ``where`` is its request path. Chat nests it under ``function``,
    the Responses API sends it flat."""
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidRequest(f"{where} takes name, description, parameters and strict, not {sorted(unknown)}.",
                             param=where)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(f"{where}.name must be 1-64 letters, digits, _ or -.", param=f"{where}.name")
    params = fn.get("parameters")
    params = {"type": "object", "properties": {}} if params is None else params
    if not isinstance(params, dict):
        raise InvalidRequest(f"{where}.parameters must be a JSON schema object.", param=f"{where}.parameters")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise InvalidRequest(f"{where}.strict must be true or false.", param=f"{where}.strict")
    out = {"name": name, "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    if fn.get("strict"):
        out["strict"] = True  # (call_grammar: it holds unconstrained `auto` calls to their schema too)
    return out


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise InvalidRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}}.", param=where)
    return {"type": "function", "function": function_spec(tool["function"], f"{where}.function")}


def tool_request(req: Any, loaded: Any) -> ToolRequest | None:
    """Chat's tools (None: no tools, or disabled by ``tool_choice: "none"``)."""
    tools, choice, where = req.tools, req.tool_choice, "tools"
    if req.functions is not None or req.function_call is not None:  # deprecated: the same, older shape
        if tools is not None or choice is not None:
            raise InvalidRequest("send tools/tool_choice or the deprecated functions/function_call, not both.",
                                 param="functions")
        tools = None if req.functions is None else [{"type": "function", "function": f} for f in req.functions]
        call = req.function_call
        choice = {"type": "function", "function": call} if isinstance(call, dict) else call
        where = "functions"
    named = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
    elif choice not in (None, "none", "auto", "required"):
        raise InvalidRequest("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}.", param="tool_choice")
    return resolve_tools(loaded, tools, "named" if isinstance(choice, dict) else choice, named,
                         req.parallel_tool_calls, where, _function)


def resolve_tools(loaded: Any, tools: list[Any] | None, choice: str | None, named: str | None,
                  parallel: bool | None, where: str, check: Callable[[Any, str], dict[str, Any]]
                  ) -> ToolRequest | None:
    """The checked tools of chat or the Responses API; ``choice`` is None, "none", "auto",
    "required" or "named" (then ``named`` is the function); ``check`` turns one tool of the
    request's shape into chat's, refusing a bad one."""
    if not tools or choice == "none":
        if choice not in (None, "none", "auto") and not tools:
            raise InvalidRequest("tool_choice needs tools.", param="tool_choice")
        return None
    check_template(loaded, where, where)
    checked = [check(t, f"{where}[{i}]") for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequest("two tools have the same name.", param=where)
    if choice == "named" and named not in names:
        raise InvalidRequest(f"tool_choice names {named!r}, which is not one of the tools {names}.",
                             param="tool_choice")
    kind = "auto" if choice is None else choice
    return ToolRequest(checked, kind, named if kind == "named" else None, True if parallel is None else bool(parallel))


def _call_tag(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    return {"type": "tag", "begin": f'{CALL_OPEN}\n{{"name": "{fn["name"]}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": fn["parameters"], "max_whitespace_cnt": 1},
            "end": f"}}\n{CALL_CLOSE}"}


def call_grammar(tools: ToolRequest) -> GrammarSpec | None:
    """For ``required`` and a named function: the answer is one call (or, with parallel calls,
    one or more separated by newlines) and nothing else. For ``auto`` without parallel calls:
    at most one call. For ``auto`` with parallel calls: nothing, unless a tool asks for
    ``strict``: then free text in which every call that begins is valid."""
    if tools.choice == "auto":
        if tools.parallel and not any(t["function"].get("strict") for t in tools.tools):
            return None  # the model chooses freely
        # Free text, and once a call begins it is valid (without parallel calls it ends the answer).
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": [_call_tag(t) for t in tools.tools],
               "stop_after_first": not tools.parallel}
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), "tool_choice")
    chosen = [t for t in tools.tools if tools.choice == "required" or t["function"]["name"] == tools.name]
    tags = [_call_tag(t) for t in chosen]
    if tools.parallel and tools.choice == "required":
        fmt: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
    else:
        fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), "tool_choice")


def template_call(call_id: str | None, name: str, arguments: str, param: str) -> dict[str, Any]:
    """An earlier call as chat templates expect it: its arguments JSON as an object."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        raise InvalidRequest("the arguments of an earlier tool call are not JSON.", param=param) from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def template_messages_tools(tools: ToolRequest | None) -> list[dict[str, Any]] | None:
    return None if tools is None else tools.tools


def parse_block(body: str) -> tuple[str, str] | None:
    """One ``<tool_call>`` block's (name, arguments), or None when it is not a JSON call with a
    name. The arguments are the model's own text of the value (its whitespace kept, so that
    streamed pieces join to exactly this), a string value's contents, or ``{}`` when absent; a
    repeated key (JSON keeps the last) gives ``json.dumps`` of the parsed value."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):
        return parsed["name"], arguments
    scanner = CallScanner()
    scanner.feed(body)
    if scanner.state == "done" and scanner.arguments is not None:
        return parsed["name"], scanner.arguments
    return parsed["name"], json.dumps(arguments)


def call_spans(text: str) -> list[tuple[int, int, dict[str, Any]]]:
    """Each valid call's (start, end) in ``text`` and the call in chat's shape."""
    spans = []
    for match in _CALL.finditer(text):
        block = parse_block(match.group(1))
        if block is not None:
            spans.append((match.start(), match.end(), {"id": new_call_id(), "type": "function",
                                                       "function": {"name": block[0], "arguments": block[1]}}))
    return spans


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def outside_calls(text: str, spans: list[tuple[int, int, dict[str, Any]]], start: int = 0) -> str:
    """The text from ``start`` on without the calls' blocks."""
    kept, last = [], start
    for begin, end, _ in spans:
        if end <= start:
            continue
        kept.append(text[last:max(begin, last)])
        last = end
    kept.append(text[last:])
    return "".join(kept)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls, or None; the calls in OpenAI's shape). A block that is not
    a JSON call with a name stays in the text."""
    spans = call_spans(text)
    content = outside_calls(text, spans).strip() if spans else text
    return (content or None), [call for _, _, call in spans]


class CallHoldback:
    """One answer's text as it streams: released up to the first ``<tool_call>`` (and held while
    a suffix could begin one); at the end, the calls and the text not yet released."""

    def __init__(self) -> None:
        self.full = ""
        self.sent = 0  # characters already released

    def feed(self, text: str) -> str:
        """The new text that may be released now ("" while held back)."""
        self.full += text
        at = self.full.find(CALL_OPEN)
        end = at if at >= 0 else len(self.full) - _open_prefix(self.full)
        if end <= self.sent:
            return ""
        released, self.sent = self.full[self.sent:end], end
        return released

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(the rest to release: all the held-back text when there are no calls, else the text
        between and after them, as the non-streamed content has it; the calls in chat's shape)."""
        spans = call_spans(self.full)
        rest = self.full[self.sent:]
        if not spans:
            return rest, []
        return outside_calls(self.full, spans, self.sent).strip(), [call for _, _, call in spans]


def _open_prefix(text: str) -> int:
    """The length of the longest suffix of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
