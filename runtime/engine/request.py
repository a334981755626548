"""A request as the scheduler sees it: one sequence, its tokens, and an explicit status.

A user request with n > 1 becomes n of these (children sharing the prompt); the engine
regroups them into one RequestOutput.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from runtime.engine.sampling_params import SamplingParams
from runtime.engine.speculative import AcceptanceHistory

if TYPE_CHECKING:
    from runtime.engine.lora_request import LoRARequest
    from runtime.engine.pooling import PoolingParams
    from runtime.engine.structured_output import TokenConstraints


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


# The id standing for a sampled token not yet on the host (Request.append_pending_token).
PENDING_TOKEN = -1

_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
# The state machine. Finished states are terminal.
_TRANSITIONS: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED} | _FINISHED,
    # Preempted with a token still on the device (async scheduling): that token may end it.
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING} | _FINISHED,
}


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its tokens chained with the previous block's key.

    Built from ints only, so every process computes the same key (Python randomizes the hashes
    of strings per process, and before 3.12 that of None): a router elsewhere can hash a
    prompt and compare with the keys a replica publishes (Engine.block_hash_events)."""
    return hash((parent_hash, token_ids))


def hash_seed(lora_int_id: int | None) -> int:
    """The parent of a sequence's first block: 0, or one per LoRA adapter (blocks computed
    under an adapter hold other K/V, so their chain starts from the adapter)."""
    return 0 if lora_int_id is None else hash((-1, int(lora_int_id)))


def prefix_block_hashes(token_ids: list[int], block_size: int, lora_int_id: int | None = None) -> list[int]:
    """The prefix-cache keys of every full block of `token_ids`, as the engine computes them."""
    out: list[int] = []
    parent = hash_seed(lora_int_id)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start:start + block_size]))
        out.append(parent)
    return out


class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique id of this sequence (a child id when the user asked for n > 1).
        parent_id / index: the user's request id and this completion's index in it.
        num_computed_tokens: tokens whose K/V are in the cache (prefix hits included).
        block_hashes: prefix-cache keys of every full block of all_token_ids.
        sample_seed: the seed this sequence's rows are sampled with.
        token_constraints: the grammar / allowed ids / bad words of this sequence, advanced
            with every output token (None: unconstrained).
        lora_request: the LoRA adapter it generates with (None: the base model).
        pooling_params: set for a pooling request (an embedding or a score: its prompt is
            computed and pooled, nothing generated); None for generation.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...],
        block_size: int,
        max_model_len: int,
        sample_seed: int,
        parent_id: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        token_constraints: TokenConstraints | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.sample_seed = sample_seed
        self.arrival_time = arrival_time or time.time()
        self.first_scheduled_time: float | None = None  # when it first ran (time.time(); its queue time ends)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.token_constraints = token_constraints
        self.block_hashes: list[int] = []
        self.lora_request = lora_request
        # A pooling request (runtime/engine/pooling.py): prefill only, finished once its prompt is computed.
        self.pooling_params = pooling_params
        self.lora_slot = 0  # the adapter's device slot while running (runtime.engine.lora.LoRAManager)
        self.draft_history = AcceptanceHistory()  # n-gram speculation's record (runtime.engine.speculative)
        # Prefill/decode disaggregation (runtime/engine/kv_transfer.py): export the blocks when it
        # finishes (prefill side), or the prompt's KV to write in at admission (decode side).
        self.kv_export = False
        self.kv_import = None
        limit = max_model_len - len(prompt_token_ids)
        # Not a default (InputProcessor.sampling_params decides those): None's meaning, and the cap.
        self.max_tokens = min(sampling_params.max_tokens or limit, limit)
        # Prompt logprobs of prompt tokens 1..P-1 are computed while the prompt is prefilled;
        # this counts how many are done (the results go straight to the output processor).
        self.wants_prompt_logprobs = sampling_params.prompt_logprobs is not None
        self.num_prompt_logprobs = 0
        self._update_block_hashes()

    # -- state machine -------------------------------------------------------------------
    def set_status(self, status: RequestStatus) -> None:
        if status not in _TRANSITIONS.get(self.status, set()):
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status} -> {status}")
        if status is RequestStatus.RUNNING and self.first_scheduled_time is None:
            self.first_scheduled_time = time.time()
        self.status = status

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    # -- tokens --------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while some prompt-token logprobs are still to be computed."""
        return self.wants_prompt_logprobs and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A pooling request whose pooling needs every prompt token computed (MEAN, CLS)."""
        return self.pooling_params is not None and self.pooling_params.skip_reading_prefix_cache

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.token_constraints is not None:
            self.token_constraints.accept(token_id)
        self._update_block_hashes()

    # -- a token still on the device (async scheduling, runtime/engine/core.py) -----------
    @property
    def has_pending_token(self) -> bool:
        """Whether its newest output token is still on the device (PENDING_TOKEN stands in)."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    def append_pending_token(self) -> None:
        """Count the token a dispatched step will sample for it, before its value is known: the
        next step can then be scheduled (its input id is taken on the device). No block whose
        tokens include it is hashed until `settle_pending_token`."""
        self.output_token_ids.append(PENDING_TOKEN)
        self.all_token_ids.append(PENDING_TOKEN)

    def settle_pending_token(self, token_id: int) -> None:
        """The pending token's value, now on the host."""
        assert self.has_pending_token, f"request {self.request_id}: no pending token"
        self.output_token_ids[-1] = self.all_token_ids[-1] = token_id
        if self.token_constraints is not None:
            self.token_constraints.accept(token_id)
        self._update_block_hashes()

    @property
    def _hash_seed(self) -> int:
        return hash_seed(None if self.lora_request is None else self.lora_request.lora_int_id)

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else self._hash_seed
            self.block_hashes.append(hash_block(parent, tuple(self.all_token_ids[i * bs:(i + 1) * bs])))
