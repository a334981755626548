"""The data the scheduler, the runner and the output processor hand each other.

A module none of them owns (as vLLM v1's `sched/output.py` and `v1/outputs.py`): the runner
reads a `SchedulerOutput` and returns a `RunnerOutput` without importing the scheduler or the
request class. What the runner reads of a scheduled request is spelled out by `StepRequest`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np


class StepRequest(Protocol):
    """What the runner reads of a scheduled request (runtime.engine.request.Request has it)."""

    request_id: str
    sampling_params: Any  # runtime.engine.sampling_params.SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    num_prompt_logprobs: int  # prompt positions whose logprobs were computed already
    sample_seed: int
    lora_slot: int
    token_constraints: Any  # runtime.engine.structured_output.TokenConstraints, or None
    eos_token_ids: tuple[int, ...]
    pooling_params: Any  # runtime.engine.pooling.PoolingParams of a pooling request, else None


@dataclasses.dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: StepRequest
    num_computed_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int  # tokens computed this step
    # Prompt-logprob prefill: each token gets its own sequence slot so that every
    # position yields logits (see runner_inputs.py).
    one_slot_per_token: bool = False
    # Speculation: tokens proposed after the request's last token (computed this step, after
    # it, each in its own slot); [] without a proposal.
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return self.num_new_tokens if self.one_slot_per_token else 1


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes: the scheduled requests, in row order."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_ids: list[str]

    @property
    def num_slots(self) -> int:
        return sum(s.num_slots for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass
class RowResult:
    """Sampler results of one row, on the host."""

    chosen_logprob: float
    chosen_rank: int
    top_ids: np.ndarray  # [K]
    top_logprobs: np.ndarray  # [K]


@dataclasses.dataclass
class RunnerOutput:
    """A step's results on the host."""

    # Per scheduled request its row's token (meaningless for partial prefill chunks), or with
    # drafts one token per row.
    sampled: list[list[int]]
    sample_logprobs: dict[str, list[RowResult]]  # request id -> its sampled tokens' logprobs, as `sampled`
    # request id -> (prompt index of the token, result) for newly computed prompt logprobs
    prompt_logprobs: dict[str, list[tuple[int, RowResult]]]
    # Pooling requests: request id -> (first prompt token of its chunk, tokens in it, the chunk's
    # pooled row [D] or [K]; runtime/ops/pooling.py); empty when the step pooled nothing.
    pooled: dict[str, tuple[int, int, np.ndarray]] = dataclasses.field(default_factory=dict)
