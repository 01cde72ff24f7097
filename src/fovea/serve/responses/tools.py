"""Function tools on /v1/responses, in the Responses API's shapes over chat's machinery.

The tools are chat's (serve/tools/calls.py): the same template check (400 ``tools_not_supported``),
the same ``<tool_call>`` parsing and the same grammar for ``required`` and a named function.
Only the shapes differ: a tool is flat (``{"type": "function", "name", "parameters", ...}``),
a named choice is ``{"type": "function", "name"}``, an earlier call comes back as a
``function_call`` input item and its result as a ``function_call_output`` item, and the
answer's calls are ``function_call`` output items.
"""

from __future__ import annotations

from typing import Any

from fovea.errors import InvalidRequest
from fovea.serve.fields import UnsupportedParameter
from fovea.serve.responses.api import FunctionCallItem, FunctionCallOutputItem, ResponsesRequest
from fovea.serve.responses.store import Turn
from fovea.serve.tools.calls import ToolRequest, check_template, function_spec, resolve_tools

# FunctionTool's keys beyond the function itself: accepted only at the value that changes nothing.
_NEUTRAL = {"defer_loading": (False,), "allowed_callers": (["direct"],), "async": (False,), "output_schema": ()}


def _tool_type(tool: Any, where: str) -> None:
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{where} must be an object: {{\"type\": \"function\", \"name\": ..., "
                             "\"parameters\": {...}}.", param=where)
    kind = tool.get("type")
    if kind != "function":
        raise UnsupportedParameter(f"{where} is a {kind!r} tool; fovea takes function tools only (it has no "
                                   "built-in tools: web_search, file_search, mcp, code_interpreter, ...).",
                                   param=f"{where}.type")
    for key, neutral in _NEUTRAL.items():
        if tool.get(key) is not None and tool[key] not in neutral:
            raise UnsupportedParameter(f"{where}.{key}={tool[key]!r} is not supported: fovea has no deferred "
                                       "tools, programmatic callers, asynchronous calls or output schemas; "
                                       "leave it out.", param=f"{where}.{key}")


def _flat_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    fn = {k: v for k, v in tool.items() if k != "type" and k not in _NEUTRAL}
    return {"type": "function", "function": function_spec(fn, where)}


def tool_request(req: ResponsesRequest, loaded: Any) -> ToolRequest | None:
    """The request's function tools (None: none, or ``tool_choice: "none"``)."""
    choice, named = req.tool_choice, None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise UnsupportedParameter(f"tool_choice {choice!r} is not supported: fovea takes \"none\", \"auto\", "
                                       "\"required\" or {\"type\": \"function\", \"name\": ...} (it has no built-in "
                                       "tools, MCP or allowed-tools lists).", param="tool_choice")
        choice, named = "named", choice.get("name")
    elif choice not in (None, "none", "auto", "required"):
        raise InvalidRequest("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                             "\"name\": ...}.", param="tool_choice")
    for i, tool in enumerate(req.tools or []):
        _tool_type(tool, f"tools[{i}]")
    return resolve_tools(loaded, req.tools, choice, named, req.parallel_tool_calls, "tools", _flat_function)


def call_turn(turns: list[Turn], item: FunctionCallItem, where: str) -> None:
    """An earlier call joins the assistant turn before it (the text the model wrote first),
    or begins one."""
    call = {"id": item.call_id, "name": item.name, "arguments": item.arguments, "where": f"{where}.arguments"}
    if turns and turns[-1]["role"] == "assistant":
        turns[-1].setdefault("tool_calls", []).append(call)
    else:
        turns.append({"role": "assistant", "content": [], "tool_calls": [call]})


def output_turn(item: FunctionCallOutputItem, where: str) -> Turn:
    """A function's result as a ``tool`` turn; a list output takes ``input_text`` parts only."""
    if isinstance(item.output, str):
        text = item.output
    else:
        texts = []
        for j, part in enumerate(item.output):
            if not isinstance(part, dict) or part.get("type") != "input_text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UnsupportedParameter(f"{where}.output[{j}] is a {kind!r} part; a function's output here is "
                                           "text (a string or input_text parts): the template's tool turn takes "
                                           "no images or files.", param=f"{where}.output[{j}]")
            texts.append(part["text"])
        text = "".join(texts)
    return {"role": "tool", "tool_call_id": item.call_id,
            "content": [{"type": "text", "text": text, "where": f"{where}.output"}]}


def check_tool_turns(loaded: Any, turns: list[Turn]) -> None:
    """A conversation with calls needs a template that renders them, and every result answers
    an earlier call (as OpenAI refuses an output with no call)."""
    called: set[str] = set()
    for turn in turns:
        calls = turn.get("tool_calls") or []
        if calls or turn["role"] == "tool":
            where = (calls[0] if calls else turn["content"][0]).get("where", "previous_response_id").split(".")[0]
            check_template(loaded, f"{where} is a function call or its output", where)
        called.update(c["id"] for c in calls)
        if turn["role"] == "tool" and turn["tool_call_id"] not in called:
            where = turn["content"][0].get("where", "previous_response_id").removesuffix(".output")
            raise InvalidRequest(f"{where} is the output of call {turn['tool_call_id']!r}, which no earlier "
                                 "function_call item (or stored response) made.",
                                 param=f"{where}.call_id" if where != "previous_response_id" else where)
