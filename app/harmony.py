"""gpt-oss's harmony format read from a reply's text (#43), for the `openai_gptoss` reasoning
parser and the `openai` tool parser (vLLM's names), without the openai_harmony package.

A reply (after the prompt's `<|start|>assistant`) is a sequence of messages

    [<|start|>assistant[ to=RECIPIENT]]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>CONTENT<|end|>

ended by `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the last answer), or by the end
of the reply. As in vLLM's HarmonyParser: the `analysis` channel is reasoning, `final` (and
`commentary` to no one) is the answer, a message to `functions.NAME` (or to a bare name that
is not a built-in tool) is a call of NAME with the message as its arguments; other messages
(built-in tools: python, browser, container) are dropped. A reply whose first header never
ends (a model that ignored the format) is all answer, as vLLM recovers it.

The markers are special tokens in gpt-oss's tokenizer, so the reply must be decoded with
`skip_special_tokens: false` (the parsers ask for it). While a reply streams, a tail that may
still grow into a marker is held back, so that what was read only ever grows.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
BUILTIN_TOOLS = ("python", "browser", "container")  # recipients that are not the user's functions


@dataclasses.dataclass(frozen=True)
class HarmonyMessage:
    """One message of a reply, as far as it has been generated.

    Attributes:
        channel: analysis, commentary, final (None: the reply never wrote a header).
        recipient: `to=` target (`functions.get_weather`), None if none.
        content_type: `json` from `<|constrain|>json` (or a bare trailing word), None if none.
        content: the message's text so far.
        end: the marker that ended it, None while it has not ended.
    """

    channel: str | None
    recipient: str | None
    content_type: str | None
    content: str
    end: str | None = None

    @property
    def kind(self) -> str:
        """reasoning, content, tool or ignored (vLLM's segment types)."""
        if self.recipient is not None and is_function_recipient(self.recipient):
            return "tool"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel is None or self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return "content"
        return "ignored"

    @property
    def function_name(self) -> str:
        return (self.recipient or "").removeprefix("functions.")

    def render(self) -> str:
        """The message as harmony text (a reply's next message starts with `<|start|>assistant`)."""
        head = f"{CHANNEL}{self.channel}" if self.channel is not None else ""
        if self.recipient is not None:
            head += f" to={self.recipient}"
        if self.content_type is not None:
            head += f" {CONSTRAIN}{self.content_type}"
        return f"{head}{MESSAGE}{self.content}{self.end or ''}"


def is_function_recipient(recipient: str) -> bool:
    """Whether a message to `recipient` calls one of the request's functions (vLLM's rule)."""
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in BUILTIN_TOOLS


def header_fields(head: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a header: the text between a message's start and
    `<|message|>`, role included (`assistant to=functions.f<|channel|>commentary json`)."""
    role_part, _, channel_part = head.partition(CHANNEL)
    channel_words = channel_part.replace(CONSTRAIN, f" {CONSTRAIN}").split()
    words = role_part.split() + channel_words
    recipient = next((w[3:] for w in words if w.startswith("to=")), None)
    channel = channel_words[0] if channel_words and not channel_words[0].startswith(("to=", CONSTRAIN)) else None
    content_type = None
    for w in channel_words[1:]:
        if w.startswith(CONSTRAIN):
            content_type = w[len(CONSTRAIN):] or None
        elif not w.startswith("to=") and content_type is None:
            content_type = w
    return channel, recipient, content_type


def held_back(text: str) -> str:
    """`text` less a tail that may still grow into a marker."""
    for k in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in MARKERS):
            return text[:-k]
    return text


def parse_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of a reply's text so far; `final`: no more text will come.

    A message whose header is still being written is left out, unless the reply is final:
    then its raw text is answer (vLLM's recovery of a reply that broke the format).
    """
    messages = []
    pieces = text.split(START)
    for i, piece in enumerate(pieces):
        if i > 0 or piece:
            last = i == len(pieces) - 1
            head, has_body, body = piece.partition(MESSAGE)
            if not has_body:
                if final and last and head.strip():
                    messages.append(HarmonyMessage(None, None, None, head))
                continue
            channel, recipient, content_type = header_fields(head)
            found = [(at, m) for m in ENDS if (at := body.find(m)) >= 0]
            if found:
                at, end = min(found)
                messages.append(HarmonyMessage(channel, recipient, content_type, body[:at], end))
            else:
                content = body if final or not last else held_back(body)
                messages.append(HarmonyMessage(channel, recipient, content_type, content))
    return messages


def final_channel_grammar(spec: dict[str, Any]) -> str | None:
    """A Lark grammar (llguidance's, special tokens named as `<|channel|>`) for a whole harmony
    reply whose `final` channel follows a structured-outputs spec: an optional `analysis`
    message, then the final one, as vLLM's harmony structural tag has it. None for a spec
    that is itself a grammar (it cannot be nested: it applies from the `final` header on).
    """
    from runtime.engine.structured_output import JSON_WHITESPACE, _no_additional_properties

    if spec.get("choice") is not None:
        answer = " | ".join(json.dumps(c) for c in spec["choice"])
    elif spec.get("regex") is not None:
        answer = "/" + spec["regex"].replace("/", "\\/") + "/"
    elif spec.get("json") is not None or spec.get("json_object"):
        schema = spec.get("json") if spec.get("json") is not None else {"type": "object"}
        try:
            schema = json.loads(schema) if isinstance(schema, str) else copy.deepcopy(schema)
        except ValueError:
            return None  # the grammar compiler names the error
        if not isinstance(schema, dict):
            return None
        compact = bool(spec.get("disable_any_whitespace"))
        options: dict[str, Any] = {"whitespace_flexible": not compact}
        if spec.get("whitespace_pattern") is not None:
            options["whitespace_pattern"] = spec["whitespace_pattern"]
        elif not compact:
            options["whitespace_pattern"] = JSON_WHITESPACE
        answer = "%json " + json.dumps({**_no_additional_properties(schema), "x-guidance": options})
    else:
        return None
    return (f"start: analysis? final\n"
            f'analysis: {CHANNEL} "analysis" {MESSAGE} /(.|\\n)*/ <|end|> {START} "assistant"\n'
            f'final: {CHANNEL} "final" {MESSAGE} answer\n'
            f"answer: {answer}\n")
