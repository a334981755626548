"""Reasoning in generated text: where a thinking model's reasoning ends and its answer starts,
one parser per model family, chosen by the serving setting `reasoning_parser` (vLLM's names):

- `deepseek_r1`: `<think>reasoning</think>answer`; the reply is reasoning from its start (the
  template may have written `<think>` into the prompt) until `</think>`; a reply that never
  closes its thinking is all reasoning (DeepSeek-R1 and its distills, QwQ);
- `qwen3`: the same markers, and also: `enable_thinking: false` among the request's
  `chat_template_kwargs` (the template then closes the thinking in the prompt) makes the whole
  reply the answer; a `<tool_call>` ends the reasoning by itself; a repeated `</think>` in the
  answer is dropped (Qwen3, Qwen3-2507 thinking models);
- `openai_gptoss`: gpt-oss's harmony channels (app/harmony.py): the `analysis` messages are
  the reasoning, the `final` ones the answer; calls to `functions.NAME` are kept for the
  `openai` tool parser when the request has one, dropped otherwise (as vLLM's HarmonyParser).
  A structured output is a grammar over the whole harmony reply (an optional analysis
  message, then the final channel holding the constrained answer), as vLLM's harmony
  structural tag; a Lark grammar of the request's own starts at the `final` header instead.

The parsers read text, as vLLM's extraction of a finished reply does, so that a marker the
tokenizer splits into several tokens is found too. A stream (`ReasoningStream`) holds back a
tail that may still become a marker, so what it has sent as reasoning never turns out to be
answer, and the reasoning it sends only grows, then the answer.

`reasoning_end_token_ids` gives the token sequences that end the reasoning, for the engine's
grammar gate (structured outputs and forced tool calls apply to the answer only, see
runtime/engine/structured_output.py): the gate and the text split agree on where reasoning ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from app.harmony import CHANNEL, ENDS, MARKERS, MESSAGE, START, final_channel_grammar, header_fields, parse_messages


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """Splits a reply into (reasoning, answer) at its end-of-thinking marker.

    Attributes:
        name: the setting's value.
        start: the marker that opens the reasoning (dropped; text before it is reasoning too).
        end: the marker that closes it (dropped).
        implicit_ends: markers that close the reasoning and start the answer, themselves
            kept in the answer (Qwen3's `<tool_call>`: the tool parser reads it there).
        drop_repeated_end: later `end` markers are dropped from the answer too.
        switch: the chat_template_kwargs key whose false turns thinking off for a request.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_ends: tuple[str, ...] = ()
    drop_repeated_end: bool = False
    switch: str | None = None

    keeps_special_tokens: bool = False  # its markers are special tokens: keep them in the reply's text

    def thinks(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a reply to a request with these template arguments starts in its reasoning."""
        if self.switch is None:
            return True
        return (chat_template_kwargs or {}).get(self.switch, True) is not False

    def split(self, text: str, final: bool = True) -> tuple[str, str | None]:
        """(reasoning, answer) of a reply, answer None while (or if) the reasoning has not ended.

        final: False for a stream's text so far: a tail that may still grow into a marker is
        left out of both parts.
        """
        cut, marker = _first_marker(text, (self.end, *self.implicit_ends))
        if cut is None:
            if not final:
                text = text[:len(text) - _partial_marker_len(text, (self.start, self.end, *self.implicit_ends))]
            return text.replace(self.start, "", 1), None
        reasoning = text[:cut].replace(self.start, "", 1)
        answer = text[cut + (len(marker) if marker == self.end else 0):]
        if self.drop_repeated_end:
            answer = answer.replace(self.end, "")
            if not final:
                answer = answer[:len(answer) - _partial_marker_len(answer, (self.end,))]
        return reasoning, answer

    def count_tokens(self, tokenizer: Any, token_ids: Sequence[int]) -> int:
        """The reply's reasoning tokens: those after its start marker (if it wrote one) and
        before its first end marker (all of them while the reasoning has not ended)."""
        ids = list(token_ids)
        start_ids = self.marker_ids(tokenizer, self.start)
        begin = _find(ids, start_ids)
        begin = 0 if begin is None else begin + len(start_ids)
        ends = [i for e in self.reasoning_end_token_ids(tokenizer) if (i := _find(ids, e, begin)) is not None]
        return (min(ends) if ends else len(ids)) - begin

    def constrain(self, spec: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
        """The structured-outputs spec a thinking request's grammar becomes: here, the same
        grammar, started after the reasoning ends (vLLM's reasoning gate)."""
        return {**spec, "reasoning_end_token_ids": self.reasoning_end_token_ids(tokenizer)}

    def for_tool_parser(self, tool_parser: Any) -> ReasoningParser:
        """The parser to split a reply that `tool_parser` (None: no tools) reads the answer of."""
        return self

    @staticmethod
    def marker_ids(tokenizer: Any, marker: str) -> list[int]:
        return list(tokenizer.encode(marker, add_special_tokens=False))

    def reasoning_end_token_ids(self, tokenizer: Any) -> list[list[int]]:
        """The token sequences that end the reasoning, for the engine's grammar gate."""
        return [self.marker_ids(tokenizer, m) for m in (self.end, *self.implicit_ends)]


def _find(ids: list[int], seq: list[int], start: int = 0) -> int | None:
    """Index of the first occurrence of `seq` in `ids` at or after `start`."""
    for i in range(start, len(ids) - len(seq) + 1):
        if ids[i:i + len(seq)] == seq:
            return i
    return None


def _first_marker(text: str, markers: Sequence[str]) -> tuple[int | None, str | None]:
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (None, None)


def _partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


@dataclasses.dataclass(frozen=True)
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony channels (see app/harmony.py).

    Attributes:
        answer_frames: the answer keeps its messages as harmony text, tool calls included,
            for the `openai` tool parser; otherwise it is the text of the answer messages,
            joined by newlines (vLLM's), and tool calls are dropped.
    """

    start: str = CHANNEL + "analysis" + MESSAGE
    end: str = CHANNEL + "final" + MESSAGE
    keeps_special_tokens: bool = True
    answer_frames: bool = False

    def split(self, text: str, final: bool = True) -> tuple[str, str | None]:
        messages = parse_messages(text, final)
        reasoning = "\n".join(m.content for m in messages if m.kind == "reasoning" and m.content)
        answers = [m for m in messages if m.kind in ("content", "tool")]
        if not answers:
            return reasoning, None
        if self.answer_frames:
            return reasoning, (START + "assistant").join(m.render() for m in answers)
        return reasoning, "\n".join(m.content for m in answers if m.kind == "content" and m.content)

    def count_tokens(self, tokenizer: Any, token_ids: Sequence[int]) -> int:
        """Tokens of analysis messages and of calls to tools (vLLM's count), markers and
        headers left out."""
        markers = {i: m for m in MARKERS if (i := tokenizer.convert_tokens_to_ids(m)) is not None
                   and tokenizer.convert_ids_to_tokens(i) == m}
        count, head, counting = 0, [], None  # counting: None while in a header
        for t in token_ids:
            marker = markers.get(t)
            if counting is None:
                if marker == MESSAGE:
                    channel, recipient, _ = header_fields("".join(head))
                    counting = channel == "analysis" or (channel == "commentary" and recipient is not None)
                else:
                    head.append(marker or tokenizer.decode([t]))
            elif marker in (*ENDS, START):
                counting, head = None, []
            elif counting and marker is None:
                count += 1
        return count

    def reasoning_end_token_ids(self, tokenizer: Any) -> list[list[int]]:
        return [self.marker_ids(tokenizer, self.end)]

    def constrain(self, spec: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
        grammar = final_channel_grammar(spec)
        return super().constrain(spec, tokenizer) if grammar is None else {"grammar": grammar}

    def for_tool_parser(self, tool_parser: Any) -> ReasoningParser:
        return dataclasses.replace(self, answer_frames=bool(getattr(tool_parser, "reads_harmony", False)))


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1"),
    "qwen3": ReasoningParser("qwen3", implicit_ends=("<tool_call>",), drop_repeated_end=True,
                             switch="enable_thinking"),
    "openai_gptoss": HarmonyReasoningParser("openai_gptoss"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name`.

    Raises:
        ValueError: no parser of that name (the message lists them).
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning_parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """Turns a stream's growing text into (reasoning delta, answer delta) pairs."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.reasoning_sent = 0
        self.answer_sent = 0
        self.ended = False  # the reasoning has ended: everything from now on is answer

    def update(self, text: str, final: bool) -> tuple[str, str]:
        """The new reasoning and answer text since the last call, given all text so far."""
        reasoning, answer = self.parser.split(text, final)
        reasoning_delta = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        if answer is None:
            return reasoning_delta, ""
        self.ended = True
        answer_delta = answer[self.answer_sent:]
        self.answer_sent = max(self.answer_sent, len(answer))
        return reasoning_delta, answer_delta

    def answer_so_far(self, text: str, final: bool) -> str:
        """All answer text so far (what a tool-call parser reads)."""
        _, answer = self.parser.split(text, final)
        return answer or ""
