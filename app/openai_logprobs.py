"""Logprobs in OpenAI's and vLLM's shapes, from the engine's per-position entries.

The engine gives, per position, {token id: Logprob(logprob, rank, decoded_token)}: the
chosen (or prompt) token first, then the top-N by rank. Completions list them as token
strings with text offsets, chat as `content` entries with `top_logprobs`, and vLLM's
`prompt_logprobs` as the entries themselves. A `top_n` of -1 is vLLM's "the whole
vocabulary": every entry the engine computed. Logprobs of -inf (a token masked out) are
sent as -9999.0, as vLLM sends them: JSON has no infinity.
"""

from __future__ import annotations

from typing import Any

from app.openai_responses import (
    ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob,
)

FLOOR = -9999.0  # what vLLM sends for a logprob of -inf


def _finite(logprob: float) -> float:
    return logprob if logprob >= FLOOR else FLOOR  # NaN too compares False


def _ranked(entry: dict[int, Any], top_n: int | None, named: bool) -> list[tuple[int, Any]]:
    """The entry's alternatives to list: the top_n by rank (-1: all; None: none), or with `named`
    every one in the engine's order (the chosen token, then the ids logprob_token_ids named, as
    vLLM lists them)."""
    if named:
        return list(entry.items())
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return ranked if top_n == -1 else ranked[:top_n or 0]


class LogprobFormatter:
    """Turns the engine's logprob entries into response fields, with the model's tokenizer
    for tokens whose text the engine did not decode.

    `as_ids` (vLLM's return_tokens_as_token_ids): tokens are named "token_id:<id>" instead of
    their text, so tokens that are not whole UTF-8 characters stay distinguishable; text
    offsets then count those names, as vLLM's do.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token_str(self, token_id: int, logprob: Any = None, as_ids: bool = False) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        decoded = getattr(logprob, "decoded_token", None)
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    def completion(self, token_ids: list[int], logprobs: list[Any] | None, top_n: int,
                   offset: int = 0, as_ids: bool = False, named: bool = False) -> CompletionLogprobs:
        """Completions' logprobs of `token_ids` (text offsets from `offset`); as vLLM lists them,
        each position's top_logprobs names its own token first, then the top_n by rank."""
        result = CompletionLogprobs()
        for pos, token_id in enumerate(token_ids):
            entry = logprobs[pos] if logprobs is not None and pos < len(logprobs) else None
            token = self.token_str(token_id, entry.get(token_id) if entry else None, as_ids)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if entry is None:  # the first prompt token has no logprob
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(_finite(entry[token_id].logprob) if token_id in entry else None)
            top = {token: _finite(entry[token_id].logprob)} if token_id in entry else {}
            for t, lp in _ranked(entry, top_n, named):
                top.setdefault(self.token_str(t, lp, as_ids), _finite(lp.logprob))
            result.top_logprobs.append(top)
        return result

    def chat(self, token_ids: list[int], logprobs: list[Any] | None, top_n: int | None,
             as_ids: bool = False, named: bool = False) -> ChatLogprobs | None:
        """Chat's logprobs `content` of `token_ids`, each with its top_n alternatives by rank.
        With `as_ids`, a position's own `bytes` stay those of its text (vLLM's)."""
        if logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            entry = entry or {}
            token = self.token_str(token_id, entry.get(token_id), as_ids)
            text = self.token_str(token_id, entry.get(token_id))
            top = [TopLogprob(token=(s := self.token_str(t, lp, as_ids)), logprob=_finite(lp.logprob),
                              bytes=list(s.encode()))
                   for t, lp in _ranked(entry, top_n, named)]
            lp = _finite(entry[token_id].logprob) if token_id in entry else FLOOR
            content.append(ChatTokenLogprob(token=token, logprob=lp, bytes=list(text.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)

    @staticmethod
    def prompt(prompt_logprobs: list[dict[int, Any] | None] | None) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}}
        (the prompt's own token first); None for the first token."""
        if prompt_logprobs is None:
            return None
        return [None if entry is None else
                {t: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                 for t, lp in entry.items()}
                for entry in prompt_logprobs]


def join_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs, shift: int) -> CompletionLogprobs:
    """`head` followed by `tail`, whose text offsets start `shift` characters later."""
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens, token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + [o + shift for o in tail.text_offset],
    )
