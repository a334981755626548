"""The input processor: prompts and sampling settings in, validated engine requests out.

Every door into the engine passes through here (the OpenAI routes, Serve handle calls,
the offline `LLM`), so a request is judged by one set of rules wherever it comes from:

- a prompt is text, token ids, a prompt dict (`{"prompt": ...}` or
  `{"prompt_token_ids": [...]}`, vLLM's TextPrompt / TokensPrompt), or chat messages (a
  list, or a `ChatPrompt` with the template's options), rendered here with the model's
  chat template;
- sampling settings are a `SamplingParams` or a dict of its fields (validated by
  SamplingParams itself: the value ranges live in runtime/engine/sampling_params.py); a
  dict gets its unset fields here, `max_tokens` included (`sampling_params`);
- the limits that depend on the model and the engine (vocabulary, context length,
  max_logprobs, max_num_seqs) are checked here;
- token constraints (structured outputs, allowed_token_ids, bad_words) are compiled here,
  so a bad grammar is refused before anything is queued and compiling never holds up the
  engine loop (runtime/engine/structured_output.py).

Bad input raises `InvalidRequestError` (with `.param`) or `PromptTooLongError`, before
anything is queued. Runs on the caller's thread, never the engine loop's.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from runtime.engine.errors import InvalidRequestError, PromptTooLongError, check_token_ids
from runtime.engine.pooling import PoolingParams
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.structured_output import CompiledConstraints, TokenMaskCompiler



@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render with the chat template, and the template's options.

    Attributes:
        messages: OpenAI-shaped messages ({"role": ..., "content": ...}).
        add_generation_prompt: end with the assistant's turn opened.
        continue_final_message: leave the last (assistant) message open to be continued.
        chat_template: a Jinja template to use instead of the model's.
        chat_template_kwargs: further variables for the template.
        tools: OpenAI's tool entries ({"type": "function", "function": {...}}) for the template.
    """

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None


# A prompt in any of the accepted forms (chat messages are a list of dicts with a role).
PromptType = str | Sequence[int] | Mapping[str, Any] | Sequence[Mapping[str, Any]] | ChatPrompt


@dataclasses.dataclass
class ProcessedRequest:
    """A validated, tokenized request, ready for `Engine.add_processed`."""

    request_id: str
    prompt: str | None  # the text, when the prompt was text (or rendered chat)
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    constraints: CompiledConstraints | None = None  # the token mask's grammar / allowed ids / bad words
    lora_request: Any = None  # runtime.engine.lora_request.LoRARequest of the adapter to generate with, or None
    kv_transfer: Any = None  # P/D: kv_transfer.ExportKV (prefill) or a KVTransfer to import (decode); None: neither


def to_sampling_params(fields: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams(**fields), with an unknown field refused by name.

    Raises:
        InvalidRequestError: an unknown field or a value out of range (.param names it).
    """
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidRequestError(
            f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}",
            param=unknown[0],
        )
    return SamplingParams(**fields)


def is_chat(prompt: Any) -> bool:
    """A conversation: a ChatPrompt, or a non-empty list of dicts that have a role."""
    return isinstance(prompt, ChatPrompt) or isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(m, Mapping) and "role" in m for m in prompt
    )


class InputProcessor:
    """Turns user input into engine requests for one model.

    Args:
        tokenizer: the model's Hugging Face tokenizer, or None (token ids only).
        vocab_size: rows of the model's logits; token ids must be below it.
        max_model_len: the engine's context limit.
        max_logprobs: the most logprobs / prompt_logprobs a request may ask for.
        max_num_seqs: the most sequences in a step; a request's `n` may not exceed it.
        sampling_defaults: SamplingParams fields for settings a request leaves unset (the
            model's generation_config.json under generation_config="auto", as vLLM does).
        eos_token_ids: the model's end-of-sequence ids (a complete grammar allows them).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, max_logprobs: int,
                 max_num_seqs: int, sampling_defaults: Mapping[str, Any] | None = None,
                 eos_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.token_masks = TokenMaskCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.max_num_seqs = max_num_seqs

    # -- sampling ------------------------------------------------------------------------
    def sampling_params(self, sampling: SamplingParams | Mapping[str, Any] | None, *,
                        chat: bool = False) -> SamplingParams:
        """A SamplingParams from itself, a dict of its fields (vLLM's names), or None.

        A SamplingParams is taken as given. A dict or None gets, for the fields it leaves
        unset, the model's sampling defaults, then SamplingParams' own. This is the one place
        that decides an unset `max_tokens`, for every door: the model's default
        (generation_config's max_new_tokens) if it has one; else a reply to a conversation
        (`chat`) may fill the context, as OpenAI's chat completions do, and any other prompt
        gets SamplingParams' default (16, vLLM's and OpenAI's completions').

        Raises:
            InvalidRequestError: an unknown field or a value out of range (.param names it).
        """
        if isinstance(sampling, SamplingParams):
            return sampling
        if sampling is not None and not isinstance(sampling, Mapping):
            raise InvalidRequestError("sampling params must be a SamplingParams or a dict", param="sampling_params")
        unset = {"max_tokens": None} if chat else {}  # None: until the context is full
        return to_sampling_params({**unset, **self.sampling_defaults, **(sampling or {})})

    # -- prompts -------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Mapping[str, Any]] | ChatPrompt, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[int]]:
        """Chat messages rendered by the model's chat template (or `chat_template`): (text, token ids).

        `messages` is a list of messages with the options as keywords, or a ChatPrompt that
        carries both (its options win).

        Content is a string or a list of text parts; the `developer` role is the `system`
        role to templates (as OpenAI defines it). `continue_final_message` leaves the last
        (assistant) message open for the model to continue, instead of a generation prompt.
        `tools` (OpenAI's `{"type": "function", "function": {...}}` entries) reach the
        template as `tools`; assistant `tool_calls` arguments reach it as objects.

        Raises:
            InvalidRequestError: no chat template, a non-text part, contradicting options, or
                the template failed.
        """
        if isinstance(messages, ChatPrompt):
            chat = messages
            messages, add_generation_prompt, continue_final_message = (
                chat.messages, chat.add_generation_prompt, chat.continue_final_message)
            chat_template, chat_template_kwargs, tools = chat.chat_template, chat.chat_template_kwargs, chat.tools
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send token ids", param="messages")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt or a chat_template",
                                      param="messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")
        rendered = [template_message(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                tools=list(tools) if tools else None, **dict(chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja raises many kinds (TemplateError, TypeError, ...)
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from None
        # The template writes BOS and the like itself; tokenizing must not add them twice.
        return text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt in any accepted form.

        Raises:
            InvalidRequestError: an unknown form, text without a tokenizer, ids out of range,
                an empty prompt.
        """
        text: str | None = None
        if is_chat(prompt):
            text, ids = self.render_chat(prompt)  # type: ignore[arg-type]
        elif isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return self.tokenize(list(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids", param="prompt")
            text, ids = prompt, list(self.tokenizer(prompt).input_ids)
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            ids = [int(t) for t in prompt]
        else:
            raise InvalidRequestError(
                "prompt must be a string, a list of token ids, a prompt dict or chat messages", param="prompt"
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        check_token_ids(ids, self.vocab_size, "prompt")
        return text, ids

    # -- the whole request ---------------------------------------------------------------
    def process(self, request_id: str, prompt: PromptType, sampling: SamplingParams | Mapping[str, Any] | None = None,
                *, arrival_time: float | None = None) -> ProcessedRequest:
        """Validate and tokenize one request.

        Raises:
            InvalidRequestError: bad prompt or sampling settings (.param names the field).
            PromptTooLongError: prompt + 1 generated token does not fit max_model_len.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        params = self.sampling_params(sampling, chat=is_chat(prompt))
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            kept = self.truncate(token_ids, params.truncate_prompt_tokens, params.truncation_side)
            text, token_ids = (text if len(kept) == len(token_ids) else None), kept
        if len(token_ids) + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; with at least one generated token it needs "
                f"{len(token_ids) + 1}, more than max_model_len={self.max_model_len}",
                param="prompt",
            )
        params = self.check_limits(params)
        constraints = self.token_masks.compile(params)
        return ProcessedRequest(request_id, text, token_ids, params, arrival_time or time.time(), constraints)

    def process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams, *,
                        arrival_time: float | None = None) -> ProcessedRequest:
        """Validate and tokenize one pooling request (an embedding or a score: nothing is
        generated, so the whole context may be prompt).

        Raises:
            InvalidRequestError: bad prompt or params; PromptTooLongError: over max_model_len.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            kept = self.truncate(token_ids, keep, None)
            text, token_ids = (text if len(kept) == len(token_ids) else None), kept
        if len(token_ids) > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(token_ids)} tokens in the input for pooling. Please reduce the length of the input "
                "(or set truncate_prompt_tokens).", param="input")
        return ProcessedRequest(request_id, text, token_ids, params, arrival_time or time.time())  # type: ignore[arg-type]

    def truncate(self, token_ids: list[int], keep: int, side: str | None) -> list[int]:
        """The prompt cut to `keep` tokens (-1: the context less one token to generate) from
        `side` ("left" keeps the last tokens; None: the tokenizer's truncation_side), as vLLM.

        Raises:
            InvalidRequestError: `keep` is more than the context holds, or leaves no prompt.
        """
        if keep > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len={self.max_model_len}; "
                "request a smaller truncation size", param="truncate_prompt_tokens")
        keep = self.max_model_len - 1 if keep == -1 else keep
        if keep == 0:
            raise InvalidRequestError("truncate_prompt_tokens=0 leaves no prompt", param="truncate_prompt_tokens")
        if keep >= len(token_ids):
            return token_ids
        side = side or getattr(self.tokenizer, "truncation_side", None)
        return token_ids[-keep:] if side == "left" else token_ids[:keep]

    def check_limits(self, params: SamplingParams) -> SamplingParams:
        """The checks of `params` that depend on this model and engine.

        Returns:
            `params`, with logprobs / prompt_logprobs of -1 (vLLM's "the whole vocabulary")
            as the vocabulary's size.

        Raises:
            InvalidRequestError: the first setting over a limit (.param names it).
        """
        vocab = self.vocab_size
        whole_vocab = {}
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v == -1:
                v = whole_vocab[name] = vocab
            if v is not None and v > self.max_logprobs:
                asked = f"-1 (the whole vocabulary, {vocab})" if name in whole_vocab else str(v)
                raise InvalidRequestError(
                    f"{name}={asked} exceeds this engine's max_logprobs={self.max_logprobs} "
                    "(max_logprobs: -1 allows the whole vocabulary)", param=name
                )
        check_token_ids(params.logit_bias, vocab, "logit_bias")
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids(params.logprob_token_ids or (), vocab, "logprob_token_ids")
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n must be <= max_num_seqs={self.max_num_seqs}", param="n")
        return params.clone(**whole_vocab) if whole_vocab else params


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One chat message as templates expect it: text content, `developer` as `system`."""
    out = dict(message)
    role = out.get("role")
    if not isinstance(role, str):
        raise InvalidRequestError("every chat message needs a string 'role'", param="messages")
    if role == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(f"only text content parts are supported, got {kind!r}", param="messages")
            parts.append(str(part.get("text", "")))
        out["content"] = "".join(parts)
    elif content is None:
        out["content"] = ""
    elif not isinstance(content, str):
        raise InvalidRequestError("message content must be a string or a list of text parts", param="messages")
    if out.get("tool_calls"):
        out["tool_calls"] = [_template_tool_call(c) for c in out["tool_calls"]]
    return out


def _template_tool_call(call: Any) -> Any:
    """A tool call of an assistant message, its JSON-text arguments decoded (as vLLM does:
    templates write `arguments | tojson`)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass
    return {**call, "function": function}
