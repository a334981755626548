"""What the engine hands back: RequestOutput snapshots with CompletionOutputs (vLLM shapes).

Each snapshot carries the cumulative state (text, token_ids, logprobs) and, for
streaming, the delta since the previous snapshot of the same completion.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class Logprob:
    """The log probability of one token, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has none


@dataclasses.dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None


@dataclasses.dataclass
class RequestOutput:
    """A snapshot of one request: its prompt and its n completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # When the engine took the request (after tokenization) and first scheduled it (time.time();
    # None until then): its queue time, as vLLM's RequestOutput.metrics has it.
    arrival_time: float | None = None
    first_scheduled_time: float | None = None


@dataclasses.dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's PoolingOutput): the vector, or a classify score as
    a one-element array."""

    data: np.ndarray  # [D] float32 (embed) or [1] (classify)


@dataclasses.dataclass
class PoolingRequestOutput:
    """The one, final output of a pooling request (vLLM's PoolingRequestOutput)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: `.embedding` as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput([float(x) for x in out.outputs.data]), out.prompt_token_ids,
                   out.finished, out.num_cached_tokens)


@dataclasses.dataclass
class ScoringOutput:
    """vLLM's ScoringOutput: `.score`."""

    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair (vLLM's ScoringRequestOutput)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
