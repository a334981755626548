"""Token masks: structured outputs (JSON schema, regex, choice, grammar, any JSON object),
`allowed_token_ids` and `bad_words`, as one packed bitmask row per sequence.

The life of a constrained request:

1. admission (`InputProcessor.process`, on the caller's thread, never the engine loop):
   `TokenMaskCompiler.compile(params)` checks and compiles the grammar (cached by its
   spec: this compiler belongs to one engine, hence one tokenizer) into a
   `CompiledConstraints`; a bad schema, regex or grammar is an `InvalidRequestError`
   naming the field, before anything is queued;
2. `Engine.add_processed` gives each sequence its own `TokenConstraints` (`start()`);
3. every step, the model runner asks `fill_token_masks` for the rows of constrained
   sequences: int32 words, bit `t % 32` of word `t // 32` set when token t is allowed
   (all-ones rows for the others); the sampler unpacks them inside jit;
4. `Request.append_output_token` advances the sequence's matcher with the sampled token,
   and `runtime.engine.stop.check_stop` ends the request ("stop") once the grammar is complete.

The engine pipelines steps, but the next step is dispatched only after the scheduler has
appended this step's tokens (runtime/engine/core.py `step`), so each mask is built from a
matcher that has seen every token before it; constrained requests need no special path.

Grammars are compiled by llguidance rather than xgrammar: it compiles a JSON schema about
a hundred times faster with a large vocabulary, its batch mask costs far less than a decode
step, it fills NumPy arrays directly and needs no torch (benchmarks/grammar_backends.py and
the figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.engine.errors import InvalidRequestError, check_token_ids
from runtime.engine.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("servax.engine")

ALL_ALLOWED = np.int32(-1)  # a mask word with all 32 bits set


def mask_words(vocab_size: int) -> int:
    """Int32 words of one packed mask row over `vocab_size` tokens."""
    return -(-vocab_size // 32)


def pack_token_ids(token_ids: Sequence[int], num_words: int) -> np.ndarray:
    """A packed row [num_words] int32 with exactly `token_ids` set."""
    row = np.zeros(num_words, np.uint32)
    ids = np.asarray(token_ids, np.int64)
    np.bitwise_or.at(row, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return row.view(np.int32)


def unpack_row(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The allowed token ids of a packed row (for tests and debugging)."""
    bits = (row[:, None].astype(np.int64) >> np.arange(32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])


# The whitespace JSON may hold between two tokens unless the request says otherwise: a line
# break and an indent of up to 16 (pretty-printed JSON four levels deep at four spaces; deeper
# lines get that indent), or one space (`{"a": 1, "b": 2}`). Bounded, so that whatever a model
# writes, every run of whitespace ends: under JSON's own `[ \t\n\r]*` a model that favours
# whitespace (a noise model, a degenerate one) can spend all of max_tokens between two braces.
JSON_WHITESPACE = r"(?:\n[ \t]{0,16}| ?)"


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a StructuredOutputsParams (not yet checked).

    JSON schemas are read as vLLM's default backend (xgrammar) reads them: an object that
    does not say `additionalProperties` gets none (write `"additionalProperties": true` to
    allow them; `disable_additional_properties` asks for what is already so); whitespace is
    `JSON_WHITESPACE` unless `disable_any_whitespace` (none) or `whitespace_pattern` is given.
    """
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, dict):
            schema = _no_additional_properties(copy.deepcopy(schema))
        options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        elif not spec.disable_any_whitespace:
            options["whitespace_pattern"] = JSON_WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:  # Lark as is; GBNF / EBNF (`root ::= ...`) converted to Lark
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise InvalidRequestError(f"structured_outputs.grammar: {e}", param="structured_outputs.grammar") from None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else", "anyOf", "oneOf")


def _no_additional_properties(schema: Any, close: bool = True) -> Any:
    """Objects of `schema` that list properties and do not say `additionalProperties` get
    `false` (xgrammar's strict mode, vLLM's default). Only subschemas are walked, never data
    (`const`, `enum`, `default`); the members of an `allOf` are left open, since closing each
    would refuse the properties of the others."""
    if isinstance(schema, list):
        for item in schema:
            _no_additional_properties(item, close)
    if not isinstance(schema, dict):
        return schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _no_additional_properties(sub)
    for key in _SUBSCHEMAS:
        _no_additional_properties(schema.get(key))
    _no_additional_properties(schema.get("allOf"), close=False)
    if close and isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _cache_key(spec: StructuredOutputsParams) -> str:
    fields = dataclasses.asdict(spec)
    fields.pop("reasoning_end_token_ids")  # when the grammar starts, not what it is
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


@dataclasses.dataclass(frozen=True)
class CompiledConstraints:
    """The checked, shareable token constraints of one request (all its n sequences).

    Attributes:
        grammar: a pristine llguidance matcher of the grammar (each sequence copies it), or None.
        allowed: packed row [words] of allowed_token_ids, or None.
        bad_words: token-id sequences whose last token is masked after the rest.
        num_words: words of a packed row (covers the logits' vocabulary).
        reasoning_end: token sequences after the first of which the grammar starts; () from
            the first token.
    """

    grammar: Any
    allowed: np.ndarray | None
    bad_words: tuple[tuple[int, ...], ...]
    num_words: int
    grammar_words: int  # words of the grammar's own masks (its tokenizer may be wider)
    reasoning_end: tuple[tuple[int, ...], ...] = ()

    def start(self) -> TokenConstraints:
        """The constraints of one new sequence (its own grammar state)."""
        matcher = self.grammar.deep_copy() if self.grammar is not None else None
        return TokenConstraints(self, matcher)


class TokenConstraints:
    """Which tokens one sequence may sample next; advanced with every token it samples."""

    def __init__(self, compiled: CompiledConstraints, matcher: Any):
        self.compiled = compiled
        self.matcher = matcher
        self.failed = False
        # Thinking first: the grammar waits for the end of the reasoning (the last tokens seen
        # are kept to spot an end sequence of several tokens).
        self.in_reasoning = bool(compiled.reasoning_end) and matcher is not None
        self._recent: list[int] = []

    @property
    def has_grammar(self) -> bool:
        """A grammar masks this sequence's next token (not while it is still reasoning)."""
        return self.matcher is not None and not self.in_reasoning

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (or broken): no token may follow."""
        return self.has_grammar and (self.failed or self.matcher.is_stopped())

    def accept(self, token_id: int) -> None:
        """Advance the grammar with the token the sequence just got (a reasoning sequence's
        tokens up to its end sequence, that included, are not the grammar's)."""
        if self.in_reasoning:
            longest = max(len(e) for e in self.compiled.reasoning_end)
            self._recent = (self._recent + [token_id])[-longest:]
            if any(tuple(self._recent[-len(e):]) == e for e in self.compiled.reasoning_end):
                self.in_reasoning = False
            return
        if self.matcher is None or self.is_finished:
            return
        if not self.matcher.consume_token(token_id):
            # Only a token outside the mask gets here (a fully masked row); the request
            # then ends as if the grammar were complete rather than run unconstrained.
            self.failed = True
            logger.warning("grammar refused token %d: %s", token_id, self.matcher.get_error())

    def apply_token_lists(self, row: np.ndarray, output_token_ids: Sequence[int]) -> None:
        """AND `row` with allowed_token_ids and clear tokens that would complete a bad word."""
        if self.compiled.allowed is not None:
            row &= self.compiled.allowed
        for word in self.compiled.bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(output_token_ids) and (
                not prefix or tuple(output_token_ids[len(output_token_ids) - len(prefix):]) == prefix
            ):
                t = word[-1]
                row.view(np.uint32)[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    """llguidance's thread pool for filling many grammar masks at once (one per process)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def fill_token_masks(mask: np.ndarray, rows: Sequence[tuple[int, TokenConstraints, Sequence[int]]]) -> None:
    """Write the packed masks of constrained rows into `mask` [S, words] (others stay as they are).

    Args:
        mask: int32 [S, words], C-contiguous; rows not named keep their (all-ones) value.
        rows: (row index, the sequence's constraints, its output token ids so far).
    """
    grammar_rows = [(c.matcher, r) for r, c, _ in rows if c.has_grammar]
    if grammar_rows:
        import llguidance.numpy

        words = next(c.compiled.grammar_words for _, c, _ in rows if c.has_grammar)
        target = mask if words == mask.shape[1] else np.full((mask.shape[0], words), ALL_ALLOWED, np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), grammar_rows, target)
        if target is not mask:
            for _, r in grammar_rows:
                mask[r] = target[r, :mask.shape[1]]
    for r, c, output_ids in rows:
        c.apply_token_lists(mask[r], output_ids)


class TokenMaskCompiler:
    """Compiles the token constraints of requests for one engine (one tokenizer, one vocabulary).

    Args:
        tokenizer: the model's Hugging Face tokenizer (a fast one), or None: then only
            allowed_token_ids works.
        vocab_size: the logits' vocabulary (may exceed the tokenizer's: the extra ids are
            never allowed under a grammar).
        eos_token_ids: the ids that end a sequence; a grammar allows them once complete.
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int] = (), cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = mask_words(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._lltokenizer = None
        self._tokenizer_lock = threading.Lock()

    def _grammar_tokenizer(self):
        """llguidance's view of the tokenizer (built once, ~0.5 s for a 49k vocabulary)."""
        with self._tokenizer_lock:
            if self._lltokenizer is None:
                import llguidance.hf

                n_vocab = max(self.vocab_size, len(self.tokenizer))
                # A private copy: the processor's tokenizer may be tokenizing on another thread.
                self._lltokenizer = llguidance.hf.from_tokenizer(
                    copy.deepcopy(self.tokenizer), n_vocab=n_vocab, eos_token=self.eos_token_ids or None)
            return self._lltokenizer

    def grammar(self, spec: StructuredOutputsParams) -> Any:
        """A pristine matcher for `spec` (cached by spec).

        Raises:
            InvalidRequestError: no tokenizer, or the schema / regex / grammar is invalid or
                uses an unsupported feature (.param is structured_outputs.<kind>).
        """
        param = f"structured_outputs.{spec.kind}"
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer", param=param)
        key = _cache_key(spec)
        with self._lock:
            matcher = self._cache.get(key)
            if matcher is not None:
                self._cache.move_to_end(key)
                return matcher
        import llguidance

        lltok = self._grammar_tokenizer()
        try:
            text = _grammar_text(spec)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"{param}: {e}", param=param) from None
        matcher = llguidance.LLMatcher(lltok, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{param}: {matcher.get_error()}", param=param)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def compile(self, params: SamplingParams) -> CompiledConstraints | None:
        """The constraints `params` asks for, checked and compiled; None when it asks for none.

        Raises:
            InvalidRequestError: a bad grammar, token id or bad word (.param names the field).
        """
        if not params.uses_token_mask:
            return None
        grammar = self.grammar(params.structured_outputs) if params.structured_outputs is not None else None
        allowed = None
        if params.allowed_token_ids is not None:
            check_token_ids(params.allowed_token_ids, self.vocab_size, "allowed_token_ids")
            allowed = pack_token_ids(params.allowed_token_ids, self.num_words)
        bad_words = self._bad_word_ids(params.bad_words or [])
        grammar_words = mask_words(max(self.vocab_size, len(self.tokenizer))) if grammar is not None else self.num_words
        ends = params.structured_outputs.reasoning_end_token_ids if grammar is not None else None
        if ends:
            for end in ends:
                check_token_ids(end, self.vocab_size, "structured_outputs.reasoning_end_token_ids")
        return CompiledConstraints(grammar, allowed, bad_words, self.num_words, grammar_words,
                                   tuple(tuple(e) for e in ends or ()))

    def _bad_word_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's rule: each word as the tokenizer spells it alone and after a space."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words need the model's tokenizer", param="bad_words")
        out: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain:
                raise InvalidRequestError(f"bad word {word!r} has no tokens", param="bad_words")
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        if any(t >= self.vocab_size for w in out for t in w):
            raise InvalidRequestError(f"bad_words tokenize beyond the vocabulary ({self.vocab_size})",
                                      param="bad_words")
        return tuple(out)
