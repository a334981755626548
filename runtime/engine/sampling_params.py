"""SamplingParams: how one request wants its tokens chosen and when to stop.

Field names and meanings follow vLLM. Every field is validated when the object is built;
a bad value raises `InvalidRequestError(message, param=<field>)` that says what is wrong
and what is allowed, so the app can return it to the user as an HTTP 400 unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from runtime.engine.errors import InvalidRequestError

# The limits of every request, whatever door it comes in by (HTTP, handle, offline LLM):
# vLLM's ranges. The HTTP models type the fields but leave the ranges to this module.
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit); the sampler gets a fixed-width table
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids; the sampler's row width for them
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request (they share the sampler's bias table)
MAX_BAD_WORDS = 128  # bad_words entries per request (vLLM's VLLM_MAX_NUM_BAD_WORDS)

# StructuredOutputsParams fields that each name one kind of constraint (exactly one is set).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's StructuredOutputsParams; exactly one kind).

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value it accepts.
        regex: a regular expression (Rust `regex` syntax) the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar, or a GBNF / EBNF one (`root ::= ...`).
        json_object: True: the output is any JSON object.
        disable_any_whitespace: JSON without whitespace between tokens (compact); without
            it, a line break and an indent, or one space (bounded, see
            runtime/engine/structured_output.py JSON_WHITESPACE).
        disable_additional_properties: accepted for vLLM; objects of a schema that do not
            say otherwise have no additional properties whatever its value (as under vLLM's
            default backend).
        whitespace_pattern: a regex for the whitespace JSON may hold between tokens.
        structural_tag: vLLM's structural tags are not supported (a 400 says so).
        reasoning_end_token_ids: servax's: token sequences that end a reasoning model's thinking;
            the grammar then starts after the first of them the output holds (the tokens
            before it are unconstrained), as vLLM's reasoning parser gates its grammars.
            None: the grammar starts at the first token. The OpenAI routes set it from the
            model's `reasoning_parser`.

    The grammar is compiled (and its errors found) when a request is admitted, see
    runtime/engine/structured_output.py.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    reasoning_end_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> None:
            raise InvalidRequestError(f"structured_outputs.{name} {message}", param=f"structured_outputs.{name}")

        if self.structural_tag is not None:
            fail("structural_tag", "is not supported; use json, regex, choice or grammar")
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got "
                f"{', '.join(kinds) or 'none'}", param="structured_outputs",
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                fail("json", f"is not valid JSON: {e}")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            fail("json", "must be a JSON schema (an object)")
        if self.regex is not None and not isinstance(self.regex, str):
            fail("regex", "must be a string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            fail("choice", "must be a non-empty list of strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            fail("grammar", "must be a non-empty Lark or EBNF grammar")
        if self.json_object is not None and self.json_object is not True:
            fail("json_object", "must be true when set")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            fail("whitespace_pattern", "must be a string")
        if self.choice is not None:
            self.choice = list(self.choice)
        ends = self.reasoning_end_token_ids
        if ends is not None:
            if not isinstance(ends, (list, tuple)) or not all(
                    isinstance(e, (list, tuple)) and e and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in e) for e in ends):
                fail("reasoning_end_token_ids", "must be a list of non-empty lists of token ids")
            self.reasoning_end_token_ids = [list(e) for e in ends]

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None)

    @classmethod
    def from_any(cls, value: "StructuredOutputsParams | Mapping[str, Any]") -> "StructuredOutputsParams":
        """Itself, or one built from a dict of its fields (an unknown field is refused by name).

        Raises:
            InvalidRequestError: not a dict, an unknown field, or a bad value.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown structured_outputs field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                param=f"structured_outputs.{unknown[0]}",
            )
        return cls(**value)


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM names).

    Attributes:
        n: completions to generate for the prompt (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0, no upper
            limit, as in vLLM).
        top_p: keep the smallest set of tokens whose probability mass reaches top_p (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 turns it off.
        min_p: drop tokens less likely than min_p times the most likely one [0, 1].
        presence_penalty / frequency_penalty: subtracted from logits of tokens already
            generated, once / per occurrence [-2, 2].
        repetition_penalty: divides positive (multiplies negative) logits of tokens seen in
            the prompt or the output; 1 is off (> 0).
        seed: makes sampling reproducible whatever else is in the batch.
        stop: string(s) that end generation; they are cut from the text unless
            include_stop_str_in_output.
        stop_token_ids: token ids that end generation (kept in token_ids, not in text).
        ignore_eos: keep generating past the end-of-sequence token.
        max_tokens: most tokens to generate (None: until the context is full); 16 when a
            SamplingParams is built without it, as vLLM's. A request given as a dict of
            fields gets an unset max_tokens from InputProcessor.sampling_params, the one
            place that decides it.
        min_tokens: EOS and stop tokens are suppressed until this many were generated.
        logprobs: return the top-N logprobs of each generated token (and the chosen one);
            -1: the whole vocabulary (the engine's max_logprobs must allow it).
        prompt_logprobs: return the top-N logprobs of each prompt token; -1 as for logprobs.
        logprob_token_ids: return the logprobs of exactly these token ids (and the chosen one)
            at each generated token instead of the top N (vLLM's; at most 128, and logprobs,
            where set, must equal their number).
        logit_bias: token id -> value added to its logit [-100, 100].
        skip_special_tokens: leave special tokens out of the text.
        structured_outputs: a grammar the output follows (StructuredOutputsParams or a dict
            of its fields).
        allowed_token_ids: only these token ids may be generated.
        bad_words: words that may not be generated: a token that would complete one (as the
            tokenizer spells it, with and without a leading space) is masked out.
        truncate_prompt_tokens: keep only this many prompt tokens (-1: as many as the
            context holds with one token to generate); None keeps the whole prompt.
        truncation_side: which end of the prompt truncation cuts: "left" keeps the last
            tokens, "right" the first; None: the tokenizer's own side (vLLM's rule).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None

    def __post_init__(self) -> None:
        self._validate()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_token_mask(self) -> bool:
        """The sampler must mask tokens for this request (a grammar, allowed ids or bad words)."""
        return self.structured_outputs is not None or self.allowed_token_ids is not None or bool(self.bad_words)

    def clone(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def _validate(self) -> None:
        def fail(param: str, allowed: str) -> None:
            value = getattr(self, param)
            raise InvalidRequestError(f"{param} must be {allowed}, got {value!r}", param=param)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0.0:
            fail("temperature", "a number >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            fail("top_k", "an integer >= 1, or 0 / -1 to disable it")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            lo, hi = PENALTY_RANGE
            if not is_num(v) or not lo <= v <= hi:
                fail(name, f"a number in [{lo:g}, {hi:g}]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            fail("repetition_penalty", "a number > 0 (1 disables it)")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "an integer or None")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                fail("stop", "a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                is_int(t) and t >= 0 for t in self.stop_token_ids
            ) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                fail("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "a boolean")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and is_int(self.min_tokens) and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", param="min_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < -1):
                fail(name, "an integer >= 0, -1 (the whole vocabulary) or None")
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
                fail("logprob_token_ids", "a list of token ids")
            if len(ids) > MAX_LOGPROB_TOKEN_IDS:
                raise InvalidRequestError(f"logprob_token_ids holds {len(ids)} ids; at most {MAX_LOGPROB_TOKEN_IDS}",
                                          param="logprob_token_ids")
            if self.logprobs is not None and self.logprobs != len(ids):
                raise InvalidRequestError(
                    f"when both logprobs and logprob_token_ids are set, logprobs must equal len(logprob_token_ids); "
                    f"got logprobs={self.logprobs}, len(logprob_token_ids)={len(ids)}", param="logprob_token_ids")
            self.logprob_token_ids = [int(t) for t in ids]
            self.logprobs = len(ids)  # the entries each position reports (vLLM's num_logprobs)
        if self.logit_bias is not None:
            lo, hi = LOGIT_BIAS_RANGE
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", f"a mapping of token id to a bias in [{lo:g}, {hi:g}]")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
                    param="logit_bias",
                )
            # Every offending entry is named, as vLLM names every key it cannot read.
            bad_keys, bad_biases = [], []
            for k, v in self.logit_bias.items():
                try:
                    token = int(k)
                except (TypeError, ValueError):
                    token = -1
                if token < 0:
                    bad_keys.append(k)
                elif not is_num(v) or not lo <= v <= hi:
                    bad_biases.append(f"{k!r}: {v!r}")
            if bad_keys:
                raise InvalidRequestError(
                    f"logit_bias contains key(s) that are not token ids (integers >= 0): {bad_keys!r}",
                    param="logit_bias",
                )
            if bad_biases:
                raise InvalidRequestError(
                    f"logit_bias values must be numbers in [{lo:g}, {hi:g}]; out of range: {', '.join(bad_biases)}",
                    param="logit_bias",
                )
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a boolean")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
            or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "a non-empty list of token ids >= 0")
        if self.truncate_prompt_tokens is not None and (
            not is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < -1
        ):
            fail("truncate_prompt_tokens", "an integer >= 0, -1 (the context's size) or None")
        if self.truncation_side not in (None, "left", "right"):
            fail("truncation_side", "'left', 'right' or None")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, (list, tuple)) or len(self.bad_words) > MAX_BAD_WORDS
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            fail("bad_words", f"a list of at most {MAX_BAD_WORDS} non-empty strings")
