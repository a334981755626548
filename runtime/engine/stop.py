"""When a request stops, and why: the one place that decides.

Everything that can end a sequence is asked here, in vLLM's order of precedence:

1. below `min_tokens` nothing but the length limit can end it (EOS, stop token ids and
   stop strings are ignored; the sampler also suppresses those tokens, see
   `suppressed_token_ids`);
2. an end-of-sequence token (unless `ignore_eos`), a `stop_token_ids` entry, or a stop
   string the new text completed: finish_reason "stop";
3. the request's grammar (structured outputs) is complete, so no token may follow:
   finish_reason "stop", whatever min_tokens says;
4. `max_tokens` reached, or the context full: finish_reason "length".

The scheduler asks with the new token alone (it frees blocks before the next step is
scheduled); the engine asks again, after detokenizing, when the detokenizer found a stop
string in the new text. A stop string completed by the last allowed token still wins
over the length limit, as in vLLM.
"""

from __future__ import annotations

import dataclasses

from runtime.engine.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """A request finishes: with which status, and vLLM's `stop_reason`.

    Attributes:
        status: FINISHED_STOPPED or FINISHED_LENGTH_CAPPED.
        reason: the stop token id or stop string that matched; None for EOS and length.
    """

    status: RequestStatus
    reason: int | str | None = None

    @property
    def finish_reason(self) -> str:
        return self.status.finish_reason


def check_stop(request: Request, token: int, stop_string: str | None = None, *,
               num_output_tokens: int | None = None) -> StopDecision | None:
    """Whether `request` finishes with its newest output token `token` (already appended).

    Args:
        request: the sequence; its output tokens include `token`.
        token: the token just generated.
        stop_string: a stop string the detokenizer found in the text `token` completed.
        num_output_tokens: output tokens up to and including `token`, when tokens after it
            were appended in the same step (accepted drafts); default all of them.

    Returns:
        the decision, or None to keep generating.
    """
    params = request.sampling_params
    count = request.num_output_tokens if num_output_tokens is None else num_output_tokens
    if count >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return StopDecision(RequestStatus.FINISHED_STOPPED)
        if token in params.stop_token_ids:
            return StopDecision(RequestStatus.FINISHED_STOPPED, token)
        if stop_string is not None:
            return StopDecision(RequestStatus.FINISHED_STOPPED, stop_string)
    if request.token_constraints is not None and request.token_constraints.is_finished:
        return StopDecision(RequestStatus.FINISHED_STOPPED)
    if count >= request.max_tokens:
        return StopDecision(RequestStatus.FINISHED_LENGTH_CAPPED)
    return None


def is_stop_token(request: Request, token: int) -> bool:
    """Stop tokens (EOS, stop_token_ids) stay in token_ids but never reach the text."""
    return token in request.eos_token_ids or token in request.sampling_params.stop_token_ids


def suppressed_token_ids(request: Request, num_output_tokens: int | None = None) -> list[int]:
    """Token ids the sampler must not pick as output token number `num_output_tokens` + 1
    (default: the next one): the stop tokens, while below min_tokens."""
    params = request.sampling_params
    if (request.num_output_tokens if num_output_tokens is None else num_output_tokens) >= params.min_tokens:
        return []
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
