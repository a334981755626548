"""KV-cache-aware routing: each request goes to the replica whose prefix cache holds the longest
prefix of its prompt, traded against load.

    deployment_config:
      num_replicas: 2
      request_router_config:
        request_router_class: app.kv_routing:KVAwareRouter
        request_router_kwargs: {imbalanced_threshold: 4}   # optional, see KVAwareRouter
        request_routing_stats_period_s: 1                  # how fresh the replicas' published caches are

On a P/D app (app/pd.py) the same lines under `prefill_config.deployment_config` route the
decode replicas' `prefill(kind, body)` calls by the body's prompt.

How the index is fed: every replica answers Serve's `record_routing_stats` (LLMServer, every
`request_routing_stats_period_s`) with its engine's prefix-cache keys (the block hashes it
holds, mirrored from the engine's block-hash event feed, `Engine.block_hash_events`), its
queue and KV usage, its block size, its tokenizer's folder and its adapters' ids. Serve's
controller hands them to every router with the replica list, so there is no index actor to
keep alive, and a replica that dies or is added is in or out of the index with Serve's own
view. Between two publications the router also remembers where it sent each prompt's blocks
for `pending_ttl_s` (the replica caches them as it prefills), so that a burst of follow-ups
does not wait for the next publication.

How a request is matched: the router turns it into prompt token ids with the model's own
InputProcessor (chat template included; the tokenizer is read once from the folder a replica
publishes), and hashes its full blocks exactly as the engine does
(runtime.engine.request.prefix_block_hashes, an adapter's blocks chained from its id, so
adapters key apart). Each candidate's score is its number of leading blocks cached. Load wins
over affinity for a replica whose queue (Serve's ongoing requests there) is more than
`imbalanced_threshold` longer than the shortest, or whose KV cache is fuller than
`max_kv_usage`: it is not chosen for its cache. Among the replicas with the longest
match, the least loaded; with no match (or one under `min_match_ratio` of the prompt, such as
a shared system prompt), the least loaded of all.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter
from ray.serve.request_router import RunningReplica

from runtime.engine.request import prefix_block_hashes

logger = logging.getLogger("ray.serve")

STATS_KEY = "servax_kv"  # the key of LLMServer.record_routing_stats' answer this router reads


class PromptHasher:
    """Request -> the engine's block hashes of its prompt, with the model's InputProcessor
    (read from the tokenizer folder a replica publishes; loaded once, off the event loop)."""

    def __init__(self) -> None:
        self._processor: Any = None
        self._loading: str | None = None
        self._lock = threading.Lock()

    def ready(self, tokenizer_path: str | None) -> bool:
        """True once the processor is loaded; else starts loading it (False until done)."""
        if self._processor is not None:
            return True
        with self._lock:
            if self._loading is None and tokenizer_path:
                self._loading = tokenizer_path
                threading.Thread(target=self._load, args=(tokenizer_path,), daemon=True,
                                 name="servax-router-tokenizer").start()
        return False

    def _load(self, path: str) -> None:
        from registry.model_info import load_tokenizer
        from runtime.engine.input_processor import InputProcessor

        try:
            tokenizer = load_tokenizer(path, required=True)
            self._processor = InputProcessor(tokenizer, vocab_size=2**31 - 1, max_model_len=2**31 - 1,
                                             max_logprobs=0, max_num_seqs=1)
            logger.info("KVAwareRouter: tokenizer read from %s", path)
        except Exception as e:  # noqa: BLE001 - the router then routes by load alone
            logger.warning("KVAwareRouter: cannot read the tokenizer at %s (%r); routing by load only", path, e)

    def hashes(self, pending_request: PendingRequest, block_size: int,
               adapter_ids: dict[str, int]) -> list[int] | None:
        """The prompt's block hashes, or None when the request has no prompt this router knows
        (it is then routed by load)."""
        prompt, lora_int_id = _prompt_and_adapter(pending_request, adapter_ids)
        if prompt is None or self._processor is None:
            return None
        try:
            _, token_ids = self._processor.tokenize(prompt)
        except Exception:  # noqa: BLE001 - an invalid prompt gets its error from the replica
            return None
        return prefix_block_hashes(token_ids, block_size, lora_int_id)


def _prompt_and_adapter(pending_request: PendingRequest, adapter_ids: dict[str, int]) -> tuple[Any, int | None]:
    """(the engine prompt of the request's first prompt, its adapter's lora_int_id): from an
    OpenAI body (completion / chat; the adapter is the ingress' `lora` argument), a P/D
    prefill call (app.pd's `prefill(kind, body)`: the body, no adapter) or a handle call
    (generate / stream: prompt, sampling, lora_request); a multiplexed model id names the
    adapter by the ids replicas publish."""
    args, kwargs = list(pending_request.args or ()), dict(pending_request.kwargs or {})
    if len(args) > 1 and isinstance(args[0], str) and hasattr(args[1], "generation_request"):
        args = args[1:]  # (kind, body): a generate call's second argument is its sampling, never a body
    if not args:
        return None, None
    first, lora = args[0], None
    if hasattr(first, "generation_request"):
        try:
            prompts = first.generation_request("route").prompts
        except Exception:  # noqa: BLE001
            return None, None
        prompt = prompts[0] if len(prompts) else None
        lora = args[1] if len(args) > 1 else kwargs.get("lora")
    elif isinstance(first, (str, list, dict)):
        prompt = first
        lora = args[2] if len(args) > 2 else kwargs.get("lora_request")
    else:
        return None, None
    lora_int_id = lora.get("lora_int_id") if isinstance(lora, dict) else getattr(lora, "lora_int_id", None)
    multiplexed = pending_request.metadata.multiplexed_model_id
    if lora_int_id is None and multiplexed:
        lora_int_id = adapter_ids.get(multiplexed)
        if lora_int_id is None:
            return None, None  # not read anywhere yet: no replica can hold its blocks
    return prompt, lora_int_id


class ReplicaCache:
    """What the router knows one replica's prefix cache holds: the hashes it last published,
    and the ones routed to it since (each until its deadline)."""

    def __init__(self) -> None:
        self.published: frozenset[int] = frozenset()
        self.version: Any = None
        self.pending: dict[int, float] = {}

    def publish(self, version: Any, hashes: list[int]) -> None:
        if version != self.version:
            self.version, self.published = version, frozenset(hashes)
            now = time.monotonic()
            self.pending = {h: t for h, t in self.pending.items() if t > now and h not in self.published}

    def add_pending(self, hashes: list[int], deadline: float) -> None:
        for h in hashes:
            if h not in self.published:
                self.pending[h] = deadline

    def matched_blocks(self, hashes: list[int], now: float) -> int:
        """Leading blocks of `hashes` this replica holds."""
        n = 0
        for h in hashes:
            if h in self.published or self.pending.get(h, 0.0) > now:
                n += 1
            else:
                break
        return n


class KVAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes a request to the replica holding the longest cached prefix of its prompt (see the module).

    request_router_kwargs:
        imbalanced_threshold: how many more ongoing requests than the least loaded replica a
            replica may have and still be chosen for its cached prefix (default 4).
        max_kv_usage: a replica whose KV cache is fuller than this is not chosen for affinity
            (default 0.95).
        min_match_blocks, min_match_ratio: a match shorter than this many blocks, or than this
            share of the prompt's full blocks, counts as none (defaults 1 and 0.1: a system prompt
            that every conversation shares must not pull them all onto the replicas that saw it first).
        pending_ttl_s: how long a routed prompt's blocks count as cached on its replica before
            the replica publishes them (default 10 s; keep it above request_routing_stats_period_s).
    """

    def initialize_state(self, imbalanced_threshold: float = 4, max_kv_usage: float = 0.95,
                         min_match_blocks: int = 1, min_match_ratio: float = 0.1, pending_ttl_s: float = 10.0,
                         **_: Any) -> None:
        self._imbalanced_threshold = imbalanced_threshold
        self._max_kv_usage = max_kv_usage
        self._min_match_blocks = max(1, int(min_match_blocks))
        self._min_match_ratio = min_match_ratio
        self._pending_ttl_s = pending_ttl_s
        self._caches: dict[ReplicaID, ReplicaCache] = {}
        self._hasher = PromptHasher()
        self._routed: collections.OrderedDict[str, list[int]] = collections.OrderedDict()  # request -> its hashes
        self.decisions: collections.Counter[str] = collections.Counter()  # how requests were routed

    # ---- the published stats ---------------------------------------------------------------

    def _stats(self, replica: RunningReplica) -> dict[str, Any]:
        stats = (replica.routing_stats or {}).get(STATS_KEY) or {}
        cache = self._caches.setdefault(replica.replica_id, ReplicaCache())
        if stats:
            cache.publish(stats.get("version"), stats.get("block_hashes") or [])
        return stats

    # ---- routing -----------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return await self._by_load(candidate_replicas, pending_request)
        stats = {r.replica_id: self._stats(r) for r in candidate_replicas}
        published = [s for s in stats.values() if s]
        if not published or not self._hasher.ready(published[0].get("tokenizer")):
            self._decided("load: no index yet")
            return await self._by_load(candidate_replicas, pending_request)
        adapters: dict[str, int] = {}
        for s in published:
            adapters.update(s.get("adapters") or {})
        hashes = self._hasher.hashes(pending_request, int(published[0]["block_size"]), adapters)
        if not hashes:
            self._decided("load: no full block")
            return await self._by_load(candidate_replicas, pending_request)
        self._remember(pending_request, hashes)
        candidates = candidate_replicas
        multiplexed = pending_request.metadata.multiplexed_model_id
        if multiplexed:  # only where the adapter is resident (else Serve's multiplexing decides)
            candidates = [r for r in candidates if multiplexed in r.multiplexed_model_ids]
            if not candidates:
                return await self._by_load(candidate_replicas, pending_request)
        queues = await self._queue_lengths(candidates)
        least_queue = min(queues.values(), default=0)
        now = time.monotonic()
        # Affinity only to replicas whose queue is within imbalanced_threshold of the shortest,
        # and whose KV cache has room.
        eligible = [r for r in candidates
                    if queues.get(r.replica_id, 0) - least_queue <= self._imbalanced_threshold
                    and float(stats.get(r.replica_id, {}).get("kv_cache_usage", 0.0)) <= self._max_kv_usage]
        matched = {r.replica_id: self._caches[r.replica_id].matched_blocks(hashes, now) for r in eligible}
        best = max(matched.values(), default=0)
        if best >= max(self._min_match_blocks, self._min_match_ratio * len(hashes)):
            pool = [r for r in eligible if matched[r.replica_id] == best]
            self._decided("affinity")
        else:
            pool = list(candidates)
            held = any(self._caches[r.replica_id].matched_blocks(hashes, now) > best
                       for r in candidates if r not in eligible)
            self._decided("load: holder too loaded" if held else "load: no cached prefix")
        load = {r.replica_id: (queues.get(r.replica_id, 0), float(stats.get(r.replica_id, {}).get(
            "num_waiting", 0))) for r in pool}
        least = min(load.values())
        chosen = [r for r in pool if load[r.replica_id] == least]
        rest = [r for r in candidate_replicas if r not in chosen]
        return [chosen] + ([rest] if rest else [])

    async def _by_load(self, candidate_replicas: list[RunningReplica],
                       pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Serve's power-of-two choice (multiplexing and locality included)."""
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)

    def _decided(self, kind: str) -> None:
        self.decisions[kind] += 1
        if sum(self.decisions.values()) % 500 == 0:
            logger.info("KVAwareRouter decisions so far: %s", dict(self.decisions))

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Serve's ongoing requests per replica (its cache, probing the replicas it lacks)."""
        lengths: dict[ReplicaID, int] = {}
        unknown = []
        for r in replicas:
            cached = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if cached is None:
                unknown.append(r)
            else:
                lengths[r.replica_id] = cached
        if unknown:
            for r, n in await self._probe_queue_lens(unknown, 0):
                if n is not None:
                    lengths[r.replica_id] = n
        return lengths

    def _remember(self, pending_request: PendingRequest, hashes: list[int]) -> None:
        self._routed[pending_request.metadata.internal_request_id] = hashes
        while len(self._routed) > 10_000:  # requests that were never routed (cancelled)
            self._routed.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = self._routed.pop(pending_request.metadata.internal_request_id, None)
        if hashes:
            deadline = time.monotonic() + self._pending_ttl_s
            self._caches.setdefault(replica_id, ReplicaCache()).add_pending(hashes, deadline)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._caches.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._caches.pop(replica_id, None)
        for replica in replicas:
            stats = self._stats(replica)
            if stats:  # read the tokenizer before the first request needs it
                self._hasher.ready(stats.get("tokenizer"))
