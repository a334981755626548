"""The scheduler: continuous batching under a token budget, chunked prefill, preemption.

Each step it decides how many new tokens each request computes. There is no separate
prefill or decode phase (as in vLLM v1): a request computes
`num_tokens - num_computed_tokens` tokens, capped by the step's budget, so a long prompt
is spread over several steps (chunked prefill) and a decode is one token.

Order: running requests first (oldest first), then waiting ones (FIFO, preempted ones at
the front). When the block pool runs dry the newest running request is preempted: its
blocks are freed and it is recomputed later (its prefix may still be in the cache).

A pooling request (an embedding or a score, runtime/engine/pooling.py) is scheduled as a
prompt like any other and finished, its blocks freed, in the update after its last prompt
token was computed; it never decodes.

With n-gram speculation (runtime/engine/speculative.py) a decoding request may compute its last
token plus draft tokens in one step, each in a sequence slot of its own; the drafts are
the first thing dropped when tokens, slots or blocks run short.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from runtime.engine.interfaces import ScheduledRequest, SchedulerOutput
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.lora import LoRAManager
from runtime.engine.request import Request, RequestStatus
from runtime.engine.speculative import DraftPolicy, SpecDecodeStats, SpeculativeConfig, accept_drafts, propose_ngram
from runtime.engine.stop import check_stop


class Scheduler:
    """Decides each step's batch; owns the waiting queue and the running list.

    Args:
        kv: the KV cache manager to allocate from.
        max_num_seqs: most sequence slots in one step.
        max_num_batched_tokens: token budget of one step.
        enable_chunked_prefill: allow a prompt to be split across steps.
        speculative: n-gram speculation settings (None: off).
    """

    def __init__(
        self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True, speculative: SpeculativeConfig | None = None,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.speculative = speculative
        self.spec_stats = SpecDecodeStats()
        # Replaced by the engine once it has measured what verification steps cost.
        self.draft_policy = DraftPolicy(speculative.num_speculative_tokens) if speculative else None
        # LoRA: admits a waiting request only once its adapter has a device slot (runtime.ops.lora).
        self.lora: LoRAManager | None = None
        # P/D: copies blocks out of / into the device cache (runtime.engine.kv_transfer.KVMover).
        self.kv_mover = None

    # -- queue ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> Request | None:
        """End a request (stop, length, abort) and free its blocks. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.set_status(status)
        request.stop_reason = stop_reason
        if request.kv_export and status != RequestStatus.FINISHED_ABORTED:
            self.kv_mover.export(request)  # P/D prefill: its blocks copied out before they are freed
        self.kv.free(request)
        return request

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        slots_left = self.max_num_seqs
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0 and slots_left > 0:
            request = self.running[i]
            if request.has_pending_token and request.num_output_tokens >= request.max_tokens:
                i += 1  # its last token is still on the device: it ends when that arrives
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            per_token = request.needs_prompt_logprobs
            if per_token:
                num_new = min(num_new, slots_left)
            drafts = self._propose(request, min(budget, slots_left) - 1) if num_new == 1 and not per_token else []
            if drafts and self.kv.allocate_slots(request, 1 + len(drafts)):
                entry = ScheduledRequest(request, request.num_computed_tokens, 1 + len(drafts), True, drafts)
            else:  # no drafts, or no blocks for them: the plain step, preempting if it must
                while not self.kv.allocate_slots(request, num_new):
                    victim = self.running.pop()
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                if request.status != RequestStatus.RUNNING:
                    break  # it preempted itself: nothing younger is left to run
                entry = ScheduledRequest(request, request.num_computed_tokens, num_new, per_token)
            scheduled.append(entry)
            budget -= entry.num_new_tokens
            slots_left -= entry.num_slots
            i += 1

        # Admit waiting requests unless this step had to preempt (blocks are short).
        while not preempted and self.waiting and budget > 0 and slots_left > 0 \
                and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.kv_import is not None:  # P/D decode: its prompt's KV came from a prefill engine
                if not self.kv_mover.admit(request):
                    break
                self.waiting.popleft()
                request.set_status(RequestStatus.RUNNING)
                self.running.append(request)
                scheduled.append(ScheduledRequest(request, request.num_computed_tokens, 1, False))
                budget -= 1
                slots_left -= 1
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            per_token = request.needs_prompt_logprobs
            if per_token:
                num_new = min(num_new, slots_left)
            if self.lora is not None and not self.lora.acquire(request, self.adapters_in_use()):
                break  # every adapter slot serves running requests: wait for one to free up
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                break
            self.waiting.popleft()
            request.set_status(RequestStatus.RUNNING)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self.running.append(request)
            entry = ScheduledRequest(request, num_hit, num_new, per_token)
            scheduled.append(entry)
            budget -= num_new
            slots_left -= entry.num_slots

        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted)

    def _propose(self, request: Request, room: int) -> list[int]:
        """Draft tokens for a decoding request (at most `room`, and none that would pass its
        max_tokens); [] without speculation or under a grammar."""
        spec = self.speculative
        if spec is None or room <= 0 or request.token_constraints is not None or request.pooling_params is not None:
            return []
        history = request.draft_history
        history.decay()
        k = self.draft_policy.draft_length(history, min(room, request.max_tokens - request.num_output_tokens - 1))
        if k <= 0:
            return []
        return propose_ngram(np.asarray(request.all_token_ids, np.int64), min_n=spec.prompt_lookup_min,
                             max_n=spec.prompt_lookup_max, k=k)

    def adapters_in_use(self) -> set[int]:
        """lora_int_ids of the running requests' adapters (their slots must stay)."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.set_status(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- async scheduling: a step counted before its tokens are on the host ----------------
    @staticmethod
    def can_run_ahead(output: SchedulerOutput) -> bool:
        """Whether the step after `output` can be scheduled before its tokens are on the host:
        none of its requests needs them there first (a grammar's mask, penalties, drafts,
        pooling, a P/D export)."""
        return not any(e.draft_token_ids or e.request.token_constraints is not None
                       or e.request.pooling_params is not None or e.request.sampling_params.uses_penalties
                       or e.request.kv_export for e in output.scheduled)

    def advance(self, output: SchedulerOutput) -> None:
        """Count a dispatched step's computed tokens and, for each request it samples a token
        for, a pending one (Request.append_pending_token), so that the next step can be
        scheduled while this one runs; `settle` then gives the tokens their values. The step
        holds no drafts and no pooling requests (the engine steps those synchronously)."""
        for entry in output.scheduled:
            request = entry.request
            if request.is_finished:
                continue
            assert not entry.draft_token_ids and request.pooling_params is None
            request.num_computed_tokens += entry.num_new_tokens
            if request.num_computed_tokens >= request.num_tokens:
                request.append_pending_token()

    def settle(self, output: SchedulerOutput, sampled: list[list[int]]) -> list[tuple[Request, int]]:
        """The sampled tokens of a step `advance` counted: each pending token gets its value and
        the stop checks run on it (a request preempted since keeps its token for later).
        Returns (request, 1) for each request that got its token, as update_from_output does."""
        advanced = []
        for entry, tokens in zip(output.scheduled, sampled):
            request = entry.request
            if request.is_finished or not request.has_pending_token:
                continue  # aborted meanwhile, or a prefill chunk (no token)
            token = int(tokens[-1])
            request.settle_pending_token(token)
            decision = check_stop(request, token)
            if decision is not None:
                self.finish_request(request.request_id, decision.status, decision.reason)
            advanced.append((request, 1))
        return advanced

    def update_from_output(self, output: SchedulerOutput, sampled: list[list[int]]) -> list[tuple[Request, int]]:
        """Advance each scheduled request by its computed tokens and append sampled tokens.

        Args:
            sampled: per scheduled request, its row's token (ignored for partial prefill
                chunks), or with drafts one token per row (see runtime.engine.speculative).

        Returns:
            (request, number of tokens appended) for the requests that got new tokens this
            step (finished ones included; their status says why they finished and their
            blocks are already freed).
        """
        advanced = []
        for entry, tokens in zip(output.scheduled, sampled):
            request = entry.request
            if request.is_finished:
                continue
            if request.pooling_params is not None:  # prefill only: done (blocks freed) once the prompt is
                request.num_computed_tokens += entry.num_new_tokens
                if request.num_computed_tokens >= request.num_tokens:
                    self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                continue
            if entry.draft_token_ids:
                tokens = accept_drafts(entry.draft_token_ids, [int(t) for t in tokens])
                self.spec_stats.observe(len(entry.draft_token_ids), len(tokens) - 1)
                request.draft_history.observe(len(entry.draft_token_ids), len(tokens) - 1)
                request.num_computed_tokens += len(tokens)  # the last token and the accepted drafts
            else:
                request.num_computed_tokens += entry.num_new_tokens
                if request.num_computed_tokens < request.num_tokens:
                    continue  # a prefill chunk: its sample is not a real next token
                tokens = tokens[-1:]
            appended = 0
            for token in tokens:
                request.append_output_token(int(token))
                appended += 1
                decision = check_stop(request, int(token))
                if decision is not None:
                    self.finish_request(request.request_id, decision.status, decision.reason)
                    break
            advanced.append((request, appended))
        return advanced
