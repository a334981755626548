"""Prefix-aware request routing: requests that share a prompt prefix go to the replica that
has it in its prefix cache.

    deployment_config:
      num_replicas: 2
      request_router_config:
        request_router_class: app.routing:PrefixCacheAffinityRouter

Serve's custom request router API (the choice Ray Serve LLM's PrefixCacheAffinityRouter
makes, written for servax): each routed request's prompt text (the completion prompt, or
the chat messages' text in order) is cut into chunks of `chunk_chars` characters whose
hashes chain (a chunk's key covers everything before it, as the engine's block hashes do),
and each key remembers the replicas it was sent to. A new request goes to the replicas
holding its longest chain when at least `match_rate_threshold` of its text matched; with
less, to the replicas that hold the least text; and whenever the replicas' queues differ by
more than `imbalanced_threshold` requests, to the power-of-two-choices pick, so that
affinity never piles load on one replica. The index is the router's own (each handle, so
each ingress replica, keeps one; Ray Serve LLM shares one through an actor) and forgets the
least recently used keys beyond `max_keys`.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter
from ray.serve.request_router import RunningReplica

logger = logging.getLogger("ray.serve")


def prompt_text(pending_request: PendingRequest | None) -> str:
    """The text a request's prefix is made of: its prompt, or its messages' text in order
    ("" when the request carries neither: it is routed by load alone)."""
    if pending_request is None:
        return ""
    for arg in pending_request.args or ():
        prompt = getattr(arg, "prompt", None)
        if prompt is not None:
            return prompt if isinstance(prompt, str) else repr(prompt)
        messages = getattr(arg, "messages", None)
        if messages is not None:
            return "".join(_message_text(m) for m in messages)
    return ""


def _message_text(message: Any) -> str:
    content = getattr(message, "content", None) if not isinstance(message, dict) else message.get("content")
    role = getattr(message, "role", None) if not isinstance(message, dict) else message.get("role")
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content)
    return f"<{role}>{content or ''}"


class PrefixIndex:
    """Chained chunk keys of routed prompts -> the replicas each was sent to (LRU-bounded)."""

    def __init__(self, chunk_chars: int = 64, max_keys: int = 200_000):
        self.chunk_chars = chunk_chars
        self.max_keys = max_keys
        self._owners: collections.OrderedDict[int, set[ReplicaID]] = collections.OrderedDict()
        self._chars: collections.Counter[ReplicaID] = collections.Counter()  # text held per replica

    def keys(self, text: str) -> list[int]:
        out, parent = [], None
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            parent = hash((parent, text[start:start + self.chunk_chars]))
            out.append(parent)
        return out

    def match(self, text: str, candidates: set[ReplicaID]) -> tuple[int, set[ReplicaID]]:
        """(characters of the longest matched prefix, the candidates holding it)."""
        best: set[ReplicaID] = set()
        depth = 0
        for key in self.keys(text):
            owners = self._owners.get(key, set()) & candidates
            if not owners:
                break
            best, depth = owners, depth + 1
            self._owners.move_to_end(key)
        return depth * self.chunk_chars, best

    def insert(self, text: str, replica: ReplicaID) -> None:
        for key in self.keys(text):
            owners = self._owners.setdefault(key, set())
            if replica not in owners:
                owners.add(replica)
                self._chars[replica] += self.chunk_chars
            self._owners.move_to_end(key)
        while len(self._owners) > self.max_keys:
            _, owners = self._owners.popitem(last=False)
            for r in owners:
                self._chars[r] -= self.chunk_chars

    def remove(self, replica: ReplicaID) -> None:
        for owners in self._owners.values():
            owners.discard(replica)
        self._chars.pop(replica, None)

    def least_loaded(self, candidates: set[ReplicaID]) -> set[ReplicaID]:
        """The candidates holding the least text."""
        fewest = min(self._chars.get(r, 0) for r in candidates)
        return {r for r in candidates if self._chars.get(r, 0) == fewest}


class PrefixCacheAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes a request to the replica that served its longest prompt prefix (see the module).

    request_router_kwargs: imbalanced_threshold (queue-length gap beyond which load wins,
    default 8), match_rate_threshold (share of the prompt that must match, default 0.1),
    chunk_chars (64), max_keys (200000).
    """

    def initialize_state(self, imbalanced_threshold: float = 8, match_rate_threshold: float = 0.1,
                         chunk_chars: int = 64, max_keys: int = 200_000, **_: Any) -> None:
        self._imbalanced_threshold = imbalanced_threshold
        self._match_rate_threshold = match_rate_threshold
        self._index = PrefixIndex(chunk_chars, max_keys)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        text = prompt_text(pending_request)
        if not text or not fallback or not fallback[0] or (pending_request is not None
                                                          and pending_request.metadata.multiplexed_model_id):
            return fallback
        by_id = {r.replica_id: r for r in candidate_replicas}
        if await self._imbalanced(candidate_replicas):
            return fallback
        matched, owners = self._index.match(text, set(by_id))
        chosen = owners if matched >= self._match_rate_threshold * len(text) else self._index.least_loaded(set(by_id))
        return [[by_id[r] for r in chosen]]

    async def _imbalanced(self, replicas: list[RunningReplica]) -> bool:
        lengths = []
        unknown = []
        for r in replicas:
            cached = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            (unknown.append(r) if cached is None else lengths.append(cached))
        if unknown:
            lengths += [n for _, n in await self._probe_queue_lens(unknown, 0) if n is not None]
        return bool(lengths) and max(lengths) - min(lengths) > self._imbalanced_threshold

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        text = prompt_text(pending_request)
        if text:
            self._index.insert(text, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.remove(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._index.remove(replica_id)
