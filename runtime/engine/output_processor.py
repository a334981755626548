"""The output processor: what a step's sampled tokens mean to the user.

After the scheduler has taken a step's tokens (and finished the requests whose token alone
ends them), the OutputProcessor detokenizes each new token, finds stop strings, asks the
one stop decision (runtime/engine/stop.py) whether a stop string ends its sequence, keeps
logprobs, regroups the n child sequences of a user request, and builds RequestOutput
snapshots with streaming deltas.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from runtime.engine.detokenizer import IncrementalDetokenizer
from runtime.engine.interfaces import RowResult, RunnerOutput
from runtime.engine.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from runtime.engine.pooling import Pooler, PoolingParams
from runtime.engine.request import Request
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.stop import StopDecision, check_stop, is_stop_token


class TokenTexts:
    """Cached single-token texts for logprob entries."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def logprob_entry(token_id: int, row: RowResult, n: int, texts: TokenTexts) -> dict[int, Logprob]:
    """{chosen token: its Logprob} plus the top-n tokens (rank 1 = most likely), or the n ids the
    request named (vLLM's logprob_token_ids: ranked by their place in its list, as vLLM ranks
    them; the chosen token among them takes that entry, as in vLLM)."""
    entry = {token_id: Logprob(row.chosen_logprob, row.chosen_rank, texts(token_id))}
    for rank in range(min(n, len(row.top_ids))):
        tid = int(row.top_ids[rank])
        entry[tid] = Logprob(float(row.top_logprobs[rank]), rank + 1, texts(tid))
    return entry


class CompletionState:
    """One child sequence as the user will see it."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, want_logprobs: bool):
        self.index = index
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._sent_tokens = 0
        self._sent_logprobs = 0

    def snapshot(self) -> CompletionOutput:
        finished = self.finish_reason is not None
        delta_text = self.detokenizer.delta(finished)
        delta_ids = self.token_ids[self._sent_tokens:]
        delta_lps = self.logprobs[self._sent_logprobs:] if self.logprobs is not None else None
        self._sent_tokens = len(self.token_ids)
        self._sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        return CompletionOutput(
            index=self.index, text=self.detokenizer.streamed_text(), token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            delta_text=delta_text, delta_token_ids=delta_ids, delta_logprobs=delta_lps,
        )


class RequestState:
    """A user request: its prompt and its n completions."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        tokenizer: Any,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens = 0
        self.arrival_time: float | None = None
        self.first_scheduled_time: float | None = None
        self.completions = [
            CompletionState(
                i,
                IncrementalDetokenizer(
                    tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                ),
                params.logprobs is not None,
            )
            for i in range(params.n)
        ]
        self.child_ids: list[str] = []

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def add_token(self, request: Request, token: int, row: RowResult | None, texts: TokenTexts) -> str | None:
        """Record a child's new token; returns a stop string its text completed, if any.

        Whether that string ends the child is runtime.engine.stop's decision; if it does, the
        caller calls `stop_at_match`.
        """
        self.num_cached_tokens = max(self.num_cached_tokens, request.num_cached_tokens)
        if self.first_scheduled_time is None:
            self.arrival_time, self.first_scheduled_time = request.arrival_time, request.first_scheduled_time
        comp = self.completions[request.index]
        comp.token_ids.append(token)
        if comp.logprobs is not None and row is not None:
            comp.logprobs.append(logprob_entry(token, row, self.params.logprobs or 0, texts))
            comp.cumulative_logprob += row.chosen_logprob
        if is_stop_token(request, token):
            return None  # stop tokens stay out of the text (the tokenizer may skip them anyway)
        return comp.detokenizer.update([token])

    def stop_at_match(self, index: int) -> None:
        """Cut child `index`'s text at the stop string its last token completed."""
        self.completions[index].detokenizer.stop_at_match()

    def add_prompt_logprobs(self, rows: list[tuple[int, RowResult]], texts: TokenTexts) -> None:
        if self.prompt_logprobs is None:
            return
        for target, row in rows:
            if target == len(self.prompt_logprobs):
                token = self.prompt_token_ids[target]
                self.prompt_logprobs.append(logprob_entry(token, row, self.params.prompt_logprobs or 0, texts))

    def finish_child(self, index: int, finish_reason: str, stop_reason: int | str | None) -> None:
        comp = self.completions[index]
        if comp.finish_reason is None:
            comp.finish_reason = finish_reason
            comp.stop_reason = stop_reason

    def snapshot(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            outputs=[c.snapshot() for c in self.completions], finished=self.finished,
            num_cached_tokens=self.num_cached_tokens, arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
        )


class PoolingState:
    """A pooling request: its prompt's pooled state, accumulated chunk by chunk until the
    chunk that completes the prompt, then finished into one PoolingRequestOutput."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: PoolingParams,
                 pooler: Pooler):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.pooler = pooler
        self.acc: np.ndarray | None = None
        self.child_ids: list[str] = []
        self.num_cached_tokens = 0

    def add_chunk(self, first: int, num_tokens: int, row: np.ndarray) -> PoolingRequestOutput | None:
        """Pool one computed chunk; the final output once the chunk completes the prompt."""
        prompt_len = len(self.prompt_token_ids)
        self.acc = self.pooler.accumulate(self.acc, first, num_tokens, prompt_len, row)
        if first + num_tokens < prompt_len:
            return None
        result = self.pooler.finish(self.acc, prompt_len, self.params)
        data = np.asarray([result] if isinstance(result, float) else result, np.float32)
        return PoolingRequestOutput(self.request_id, PoolingOutput(data), self.prompt_token_ids, True,
                                    self.num_cached_tokens, self.prompt)

    def finish_child(self, index: int, finish_reason: str, stop_reason: int | str | None) -> None:
        """(Aborted: nothing to record; the abort's snapshot says it is over.)"""

    def snapshot(self) -> PoolingRequestOutput:
        """An aborted request's last word: finished, with no data."""
        return PoolingRequestOutput(self.request_id, PoolingOutput(np.zeros(0, np.float32)), self.prompt_token_ids,
                                    True, self.num_cached_tokens, self.prompt)


class OutputProcessor:
    """Turns sampled tokens into RequestOutputs for every request the engine holds.

    Args:
        tokenizer: the model's tokenizer (None: token ids only). A private copy detokenizes,
            so that the input processor may tokenize on another thread meanwhile (a Rust
            tokenizer is borrowed by one caller at a time).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.texts = TokenTexts(self.tokenizer)
        self.states: dict[str, RequestState] = {}  # user request id -> state
        self.generation_tokens = 0
        self.num_finished = 0

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestState:
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        self.states[request_id] = state
        return state

    def add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                            params: PoolingParams, pooler: Pooler) -> PoolingState:
        state = PoolingState(request_id, prompt, prompt_token_ids, params, pooler)
        self.states[request_id] = state  # type: ignore[assignment]
        return state

    def process_pooled(self, pooled: dict[str, tuple[int, int, np.ndarray]],
                       requests: dict[str, Request]) -> list[PoolingRequestOutput]:
        """Pool a step's chunks of pooling requests; the outputs of those it completed.
        `requests`: the scheduler's live requests (their prefix-cache hits), read before the
        update that finishes them."""
        outs = []
        for rid, (first, num_tokens, row) in pooled.items():
            state = self.states.get(rid)
            if not isinstance(state, PoolingState):
                continue  # aborted while its step ran
            request = requests.get(rid)
            if request is not None:
                state.num_cached_tokens = max(0, request.num_cached_tokens)
            out = state.add_chunk(first, num_tokens, row)
            if out is not None:
                outs.append(out)
                del self.states[rid]
                self.num_finished += 1
        return outs

    def abort_request(self, request_id: str) -> RequestState | None:
        """Forget a request; its state (for a final snapshot), or None if unknown."""
        return self.states.pop(request_id, None)

    def add_prompt_logprobs(self, result: RunnerOutput, requests: dict[str, Request]) -> None:
        """Record the prompt logprobs a step computed (before the next step is scheduled: the
        runner reads how many each request has)."""
        for rid, rows in result.prompt_logprobs.items():
            request = requests.get(rid)
            if request is not None:
                request.num_prompt_logprobs += len(rows)
                state = self.states.get(request.parent_id)
                if state is not None:
                    state.add_prompt_logprobs(rows, self.texts)

    def process(self, advanced: list[tuple[Request, int]], result: RunnerOutput,
                ) -> tuple[list[RequestOutput], list[tuple[Request, StopDecision]]]:
        """The snapshots of the requests that advanced, and the child sequences a stop string
        ended that the scheduler has not finished yet (the caller finishes them).

        advanced: (child sequence, tokens it gained this step), as the scheduler returned them.
        """
        touched: dict[str, RequestState] = {}
        to_finish: list[tuple[Request, StopDecision]] = []
        for request, num_new in advanced:
            state = self.states[request.parent_id]
            touched[request.parent_id] = state
            rows = result.sample_logprobs.get(request.request_id)
            new_tokens = request.output_token_ids[-num_new:]  # more than one: accepted drafts
            for j, token in enumerate(new_tokens):
                self.generation_tokens += 1
                stop_str = state.add_token(request, token, rows[j] if rows else None, self.texts)
                last = j == num_new - 1
                finish = (request.status, request.stop_reason) if last and request.is_finished else None
                if stop_str is not None:
                    count = request.num_output_tokens - num_new + j + 1  # output tokens through this one
                    decision = check_stop(request, token, stop_str, num_output_tokens=count)
                    if decision is not None and decision.reason == stop_str:
                        state.stop_at_match(request.index)
                        if not request.is_finished:
                            to_finish.append((request, decision))
                        finish = (decision.status, decision.reason)
                if finish is not None:
                    state.finish_child(request.index, finish[0].finish_reason, finish[1])
                    break
        outs = []
        for parent_id, state in touched.items():
            outs.append(state.snapshot())
            if state.finished:
                del self.states[parent_id]
                self.num_finished += 1
        return outs, to_finish
