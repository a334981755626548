"""N-gram speculative decoding (prompt lookup): proposals from a request's own tokens.

    LLM("...", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})

Each step, a decoding request whose last tokens (an n-gram, n from prompt_lookup_max down
to prompt_lookup_min) occurred earlier in its prompt or output proposes the k tokens that
followed that earlier occurrence (vLLM's rule: the longest n-gram, its earliest match).
The scheduler gives the request 1 + k token slots (its last sampled token and the drafts),
each in a sequence slot of its own so that every position yields logits (the layout the
prompt-logprob rows use), and the sampler draws one token per row.

Verification (`accept_drafts`): row j's token is drawn from the model's distribution given
the tokens before it, with the request's own sampling settings and the key of output
position j; draft j+1 is accepted while it equals that draw. Every emitted token is thus
exactly the token the request would have drawn without speculation (greedy: the argmax;
sampled: the same Gumbel-max draw, keyed by seed and position), so outputs keep their
distribution, and seeded requests their tokens. With a deterministic proposal this is the
standard rejection rule: a draft d is accepted with probability p(d).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(BaseModel):
    """vLLM's `speculative_config` for the method servax implements: ngram (prompt lookup).

    As vLLM: `prompt_lookup_min` and `prompt_lookup_max` default to each other, and both to 5.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] | None = Field(None, description="ngram: draft from the request's own tokens.")
    model: str | None = Field(None, description="'[ngram]' is vLLM's older spelling of method='ngram'.")
    num_speculative_tokens: int = Field(gt=0, le=MAX_SPECULATIVE_TOKENS,
                                        description="Draft tokens proposed (and verified) per step.")
    prompt_lookup_max: int | None = Field(None, gt=0, description="Longest n-gram matched.")
    prompt_lookup_min: int | None = Field(None, gt=0, description="Shortest n-gram matched.")
    adaptive_drafts: bool = Field(
        True, description="servax's own: propose per request only drafts whose expected accepted tokens repay "
                          "the verification step's measured cost (DraftPolicy); False: always up to "
                          "num_speculative_tokens, as vLLM.")

    @model_validator(mode="before")
    @classmethod
    def _method(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        method, model = data.get("method"), data.get("model")
        if method is None and model in ("[ngram]", "ngram"):
            data["method"] = "ngram"
        elif method is None:
            raise ValueError("speculative_config needs method='ngram' (servax drafts by prompt lookup)")
        elif method != "ngram":
            raise ValueError(f"speculative method {method!r} is not supported; servax implements 'ngram' "
                             "(prompt lookup; no draft model, EAGLE or Medusa heads)")
        if model not in (None, "[ngram]", "ngram"):
            raise ValueError(f"speculative_config.model={model!r}: ngram speculation uses no draft model")
        lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        data["prompt_lookup_min"] = hi if lo is None else lo
        data["prompt_lookup_max"] = lo if hi is None else hi
        return data

    @model_validator(mode="after")
    def _ordered(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        return self


def propose_ngram(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """The (at most k) tokens that followed the earliest earlier occurrence of the longest
    suffix n-gram of `tokens` (min_n <= n <= max_n); [] when no suffix recurs.

    tokens: [L] int, the request's prompt and output so far.
    """
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows starting at i < total - n: every earlier occurrence (overlaps allowed).
        num_windows = total - n
        hit = tokens[:num_windows] == tokens[total - n]
        for j in range(1, n):
            hit &= tokens[j:num_windows + j] == tokens[total - n + j]
        starts = np.flatnonzero(hit)
        if len(starts):
            start = int(starts[0]) + n
            return tokens[start:start + k].tolist()
    return []


def accept_drafts(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified step emits: the draws of rows 0..a, where the first a drafts
    equal the draws before them (sampled: one draw per row, len(drafts) + 1 rows)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return sampled[:accepted + 1]


@dataclasses.dataclass
class AcceptanceHistory:
    """One request's recent draft acceptance: decayed counts of accepted draft tokens and of
    rejections (a verification that stopped before its last draft)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def rate(self) -> float:
        """Estimated chance that the next draft token is accepted (one accepted token of prior:
        a new request starts optimistic, and a silent one drifts back towards trying)."""
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 1.0)

    def decay(self, factor: float = 0.95) -> None:
        self.accepted *= factor
        self.rejected *= factor

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted += accepted
        self.rejected += accepted < drafted


class DraftPolicy:
    """How many draft tokens a request proposes this step: the length with the most tokens
    expected per unit of step time, or none when no length beats a plain step.

    A draft of k tokens emits 1 + a + a^2 + ... + a^k tokens in expectation (a: the request's
    acceptance rate, each draft token accepted with chance a after the one before) and costs
    `step_cost[k]` one-token steps. The costs are measured when the engine starts: on an
    accelerator they are ~1 and every request drafts all it can (vLLM's behaviour); on a
    2-core CPU a 4-token step costs ~1.9 one-token steps (the matmuls leave their
    matrix-vector path), so drafts pay only where they are mostly accepted. Outputs never
    depend on this, only speed.

    Args:
        max_tokens: num_speculative_tokens.
        step_cost: {k: time of a step of 1 + k tokens / time of a 1-token step} for the
            lengths to consider (others are not chosen); None: every length costs 1.
    """

    def __init__(self, max_tokens: int, step_cost: dict[int, float] | None = None):
        self.max_tokens = max_tokens
        self.step_cost = dict(step_cost) if step_cost else {max_tokens: 1.0}

    def draft_length(self, history: AcceptanceHistory, room: int) -> int:
        """Draft tokens to propose (<= room); 0: decode plainly this step."""
        rate = history.rate()
        best, best_gain = 0, 1.0
        for k, cost in sorted(self.step_cost.items()):
            k = min(k, room)
            if k <= 0:
                continue
            gain = sum(rate ** i for i in range(k + 1)) / cost
            if gain > best_gain:
                best, best_gain = k, gain
        return best


def candidate_draft_lengths(max_tokens: int) -> list[int]:
    """Draft lengths worth costing: those that fill a power-of-two token bucket (1, 3, 7, ...)
    below num_speculative_tokens, and num_speculative_tokens itself."""
    out, k = [], 1
    while k < max_tokens:
        out.append(k)
        k = 2 * k + 1
    return out + [max_tokens]


@dataclasses.dataclass
class SpecDecodeStats:
    """Totals since startup, as vLLM's spec-decode counters."""

    num_drafts: int = 0  # verification steps of requests that had a proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (1 + accepted drafts), as vLLM logs it."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
