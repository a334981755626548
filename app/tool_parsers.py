"""Tool calls in generated text: one parser per model family, chosen by the engine setting
`tool_call_parser` (vLLM's names), and the two JSON forms that `tool_choice` "required"
and a named function force with a grammar (as vLLM does):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text around
  them is content (Hermes 2/3, Qwen 2/2.5/3 and most chat models trained on that format);
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` objects separated
  by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2/3.3); otherwise it is content;
- `openai`: gpt-oss's harmony messages (app/harmony.py): a message to `functions.NAME` is a
  call, its text the arguments; the `final` channel is content, `analysis` is left out;
- required: a JSON array `[{"name": ..., "parameters": {...}}, ...]`;
- named: the reply is the arguments object of that function.

A parser reads the text generated so far and says which part is content (never a piece
that may still turn out to be a tool call) and which tool calls it holds: each with its
name once complete and the raw JSON text of its arguments so far. What it returns only
grows as text is added, so a stream can send the difference each time
(`ToolCallStream`), and the deltas reassemble to the same calls as the final parse.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, ClassVar

from app.harmony import parse_messages
from runtime.engine.errors import InvalidRequestError

_WS = " \t\r\n"


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class ToolCallText:
    """One tool call as far as it has been generated."""

    name: str | None = None  # None until the name string is complete
    arguments: str = ""  # JSON text of the arguments so far (a prefix of the final text)
    complete: bool = False  # the call's JSON ended
    valid: bool = True  # False once the text cannot be a tool call of this format


@dataclasses.dataclass
class ParsedText:
    content: str
    calls: list[ToolCallText]


# ---- JSON scanning over partial text -------------------------------------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at text[i] == '"'; None if it has not ended."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    return None


def _scan_value(text: str, i: int, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None if it has not ended."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _scan_string(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) or final else None


def _scan_call(text: str, i: int, argument_keys: tuple[str, ...], final: bool) -> tuple[ToolCallText, int | None]:
    """The tool-call object starting at text[i] == '{': what is known, and its end (None: not ended)."""
    call = ToolCallText()
    i = _skip_ws(text, i + 1)
    while True:
        if i >= len(text):
            return call, None
        if text[i] == "}":
            call.complete = True
            return call, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            call.valid = False
            return call, None
        key_end = _scan_string(text, i)
        if key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            call.valid = False
            return call, None
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return call, None
        end = _scan_value(text, i, final)
        if key == "name":
            if end is None:
                return call, None
            name = json.loads(text[i:end]) if text[i] == '"' else None
            if not isinstance(name, str):
                call.valid = False
                return call, None
            call.name = name
        elif key in argument_keys:
            if text[i] == '"':  # arguments written as a JSON string holding JSON
                if end is None:
                    return call, None
                call.arguments = json.loads(text[i:end])
            else:
                call.arguments = text[i:end] if end is not None else text[i:]
        if end is None:
            return call, None
        i = _skip_ws(text, end)


def _held_back(text: str, marker: str) -> str:
    """`text` less a suffix that could be the start of `marker` (it may still become one)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


# ---- the parsers ----------------------------------------------------------------------------

class ToolParser:
    """Reads tool calls from generated text (see the module docstring)."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False  # its markers may be special tokens: keep them in the text
    forced: ClassVar[bool] = False  # a grammar forces the calls (tool_choice "required" or named)
    finishes_as_tool_calls: ClassVar[bool] = True  # a reply that stopped by itself with calls: "tool_calls"
    reads_harmony: ClassVar[bool] = False  # it reads harmony messages (a reasoning parser keeps them so)

    def parse(self, text: str, final: bool) -> ParsedText:
        """Content and tool calls of `text`; `final`: no more text will come."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedText:
        content: list[str] = []
        calls: list[ToolCallText] = []
        pos = 0
        while True:
            at = text.find(self.start, pos)
            if at < 0:
                content.append(text[pos:] if final else _held_back(text[pos:], self.start))
                break
            content.append(text[pos:at])
            i = _skip_ws(text, at + len(self.start))
            if i >= len(text):
                calls.append(ToolCallText())
                break
            if text[i] != "{":
                calls.append(ToolCallText(valid=False))
                break
            call, end = _scan_call(text, i, ("arguments", "parameters"), final)
            calls.append(call)
            close = text.find(self.end, end) if end is not None else -1
            if close < 0:
                break
            pos = close + len(self.end)
        return ParsedText("".join(content), calls)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedText:
        i = _skip_ws(text, 0)
        if text.startswith(self.python_tag, i):
            i = _skip_ws(text, i + len(self.python_tag))
        elif not final and i < len(text) and self.python_tag.startswith(text[i:]):
            return ParsedText("", [])  # maybe the tag, maybe not: wait
        if i >= len(text):
            return ParsedText(text if final else "", [])
        if text[i] != "{":
            return ParsedText(text, [])
        calls: list[ToolCallText] = []
        while i < len(text) and text[i] == "{":
            call, end = _scan_call(text, i, ("parameters", "arguments"), final)
            calls.append(call)
            if end is None:
                break
            i = _skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = _skip_ws(text, i + 1)
        return ParsedText("", calls)


class RequiredToolCalls(ToolParser):
    """The JSON array that tool_choice "required" forces (see `required_tool_calls_schema`)."""

    name = "required"
    forced = True

    def parse(self, text: str, final: bool) -> ParsedText:
        calls: list[ToolCallText] = []
        i = _skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ParsedText("", calls)
        i = _skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            call, end = _scan_call(text, i, ("parameters",), final)
            calls.append(call)
            if end is None:
                break
            i = _skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
        return ParsedText("", calls)


class NamedToolCall(ToolParser):
    """A named tool_choice: the whole reply is the function's arguments, as far as they got
    (a reply cut off by max_tokens still calls the function, with partial arguments, as vLLM),
    and the reply finishes as it stopped ("stop", "length"), as vLLM and OpenAI do."""

    name = "named"
    forced = True
    finishes_as_tool_calls = False

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedText:
        arguments = text.strip() if final else text.lstrip()
        end = _scan_value(arguments, 0, final) if arguments else None
        return ParsedText("", [ToolCallText(self.function_name, arguments, complete=end is not None)])


class HarmonyToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True
    reads_harmony = True

    def parse(self, text: str, final: bool) -> ParsedText:
        messages = parse_messages(text, final)
        content = "\n".join(m.content for m in messages if m.kind == "content" and m.content)
        calls = [ToolCallText(m.function_name, m.content, complete=final or m.end is not None)
                 for m in messages if m.kind == "tool"]
        return ParsedText(content, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser,
                                                                  HarmonyToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name` (a `tool_call_parser` setting).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


# ---- the schemas that force calls ---------------------------------------------------------

def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


_DEFINITIONS = ("$defs", "definitions")  # where a schema keeps what its "#/..." references point to


def _lift_definitions(functions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each function's parameters less their `$defs` / `definitions`, and those collected for
    the root of a schema that nests the parameters (a `"#/$defs/X"` reference resolves from the
    root), as vLLM does.

    Raises:
        InvalidRequestError: two tools define one name differently (param "tools").
    """
    lifted: dict[str, dict[str, Any]] = {}
    stripped = []
    for f in functions:
        params = dict(_parameters(f))
        for key in _DEFINITIONS:
            defs = params.pop(key, None)
            if not isinstance(defs, dict):
                continue
            for name, schema in defs.items():
                known = lifted.setdefault(key, {})
                if name in known and known[name] != schema:
                    raise InvalidRequestError(
                        f"tools define {key} {name!r} differently ({f['name']!r} and an earlier tool); "
                        "give the types different names", param="tools")
                known[name] = schema
        stripped.append({**f, "parameters": params})
    return stripped, lifted


def required_tool_calls_schema(functions: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of {name, parameters} of the given tools,
    the tools' `$defs` at its root.

    Raises:
        InvalidRequestError: two tools define one `$defs` name differently (param "tools").
    """
    functions, definitions = _lift_definitions(functions)
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": f["parameters"]},
             "required": ["name", "parameters"], "additionalProperties": False}
            for f in functions
        ]},
        **definitions,
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def named_tool_call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The schema of a named tool_choice: the function's parameters."""
    return _parameters(function)


# ---- results ------------------------------------------------------------------------------

def final_tool_calls(parser: ToolParser, text: str, parallel_tool_calls: bool = True
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls in OpenAI's shape) of a finished reply.

    A call that did not end or whose arguments are not a JSON object makes the whole reply
    content (the model did not call a tool the way its format says), as vLLM does; but a
    named tool_choice calls its function with whatever arguments were written (vLLM's), and
    with calls the content of a forced choice is "" (vLLM's).
    """
    parsed = parser.parse(text, final=True)
    if isinstance(parser, NamedToolCall):
        (call,) = parsed.calls
        if not call.arguments:
            return None, []
        return "", [{"id": new_tool_call_id(), "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]
    calls = []
    for call in parsed.calls:
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = None
        if not (call.valid and call.complete and call.name and isinstance(arguments, dict)):
            return text, []
        calls.append({"id": new_tool_call_id(), "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments or "{}"}})
    if not parallel_tool_calls:
        calls = calls[:1]
    content = parsed.content if calls else text
    if calls and parser.forced:
        return "", calls
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Turns a growing reply into content deltas and OpenAI tool-call deltas.

    `update(text, final)` gets the whole text so far and returns (new content, tool-call
    deltas): the first delta of a call carries index, id, type and name (and any arguments
    known), later ones only `function.arguments` pieces.
    """

    def __init__(self, parser: ToolParser, parallel_tool_calls: bool = True):
        self.parser = parser
        self.parallel_tool_calls = parallel_tool_calls
        self._content_sent = 0
        self._arguments_sent: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self._arguments_sent)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = self.parser.parse(text, final)
        content = parsed.content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        limit = len(parsed.calls) if self.parallel_tool_calls else min(1, len(parsed.calls))
        for index, call in enumerate(parsed.calls[:limit]):
            if call.name is None or not call.valid:
                break  # later calls wait: deltas go out in order
            if index == len(self._arguments_sent):
                deltas.append({"index": index, "id": new_tool_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self._arguments_sent.append(len(call.arguments))
            elif len(call.arguments) > self._arguments_sent[index]:
                deltas.append({"index": index,
                               "function": {"arguments": call.arguments[self._arguments_sent[index]:]}})
                self._arguments_sent[index] = len(call.arguments)
        return content, deltas
