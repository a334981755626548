"""KV transfer for prefill/decode disaggregation: a prompt's KV blocks out of one engine, into another.

A prefill engine runs a request's prompt with max_tokens=1 (the first token), and when the
request finishes its blocks are copied out before they are freed (`KVMover.export`, called
from Scheduler.finish_request); `take` hands them over as a `KVTransfer`: the arrays of every
block the request held, in every KV cache group and every layer (K, V and, on a quantized
cache, their scales; models with sliding-window layers are refused for now: their groups drop
blocks mid-prefill that a transfer could not carry), the prompt's token ids, the first token with its logprobs, and the
sampling seed, so that a seeded request continues exactly as it would have on one engine
(the sampler's key is (seed, tokens generated so far), runtime/engine/sampler.py).

A decode engine admits a request carrying a KVTransfer (`add_request`): the first token is
already its output (detokenized and, for a grammar, accepted), and when the scheduler admits
it (`KVMover.admit`) it gets blocks as any request does, the blocks its own prefix cache
already holds are reused, the others are written from the transfer, and the prompt counts as
computed; its next step decodes the first token. The written blocks are registered in the
decode engine's prefix cache like any computed block.

Copies run in jitted programs compiled once, at `KVMover` construction, for a few block-count
buckets (powers of two up to one sequence's blocks), so nothing compiles while serving.
Here the arrays travel as numpy through Ray's object store (app/pd.py `ray.put`s them on the
prefill replica; the decode replica reads the ObjectRef). On TPU / GPU the same seam would
move device buffers directly (jax.experimental.transfer's TransferServer, or a device-to-device
copy between meshes of one process) instead of staging through host memory.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.engine.errors import InvalidRequestError
from runtime.engine.input_processor import ProcessedRequest
from runtime.engine.request import Request
from runtime.engine.stop import check_stop

# The KVCache fields that hold blocks on axis 1 (rows, blocks, ...); any may be absent or blockless.
_BLOCK_FIELDS = ("k", "v", "k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class ExportKV:
    """kv_transfer setting of a prefill request: compute the prompt and the first token, then
    export its blocks (Engine.kv_transfer.take(request_id) once it has finished)."""


@dataclasses.dataclass
class KVTransfer:
    """A computed prompt's KV blocks and what a decode engine needs to continue the request.

    Attributes:
        prompt_token_ids: the prompt whose KV the blocks hold (checked against the decode
            engine's own tokenization of the request).
        first_token_id: the token the prefill sampled.
        sample_seed: the seed the request's rows are sampled with.
        num_cached_tokens: prompt tokens the prefill engine found in its prefix cache.
        block_size: tokens per block (the decode engine's must be equal).
        blocks: (KV cache group, index in the group's block table) of each exported block.
        arrays: per KVCache field, the blocks' contents [rows, len(blocks), ...] (numpy).
        first_logprobs: the first token's logprob entry (dict token id -> Logprob), if asked.
    """

    prompt_token_ids: list[int]
    first_token_id: int
    sample_seed: int
    num_cached_tokens: int
    block_size: int
    blocks: list[tuple[int, int]]
    arrays: dict[str, Any]
    first_logprobs: dict[int, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in self.arrays.values())


def _buckets(max_blocks: int) -> list[int]:
    out, b = [], 1
    while b < max_blocks:
        out.append(b)
        b *= 2
    return out + [max_blocks]


class KVMover:
    """Copies blocks between an engine's device cache and host arrays (Engine.enable_kv_transfer).

    Args:
        programs: the engine's ModelPrograms (owns `kv_cache`).
        kv: the engine's KVCacheManager.
        max_blocks: the most blocks one sequence holds over all groups (the largest bucket).
        compile_counter: the engine's CompileCounter (copies run inside its `track()`).

    Raises:
        ValueError: a multi-process engine, or a model with sliding-window layers.
    """

    def __init__(self, programs: Any, kv: Any, max_blocks: int, compile_counter: Any):
        if not hasattr(programs, "kv_cache"):
            raise ValueError("KV transfer (prefill/decode disaggregation) needs a one-process engine")
        if any(w is not None for w in kv.group_windows):
            # A sliding group drops the blocks before its window during a chunked prefill, so a
            # transfer cannot carry them, and the decode side's prefix cache would key blocks it
            # never wrote.
            raise ValueError("prefill/decode disaggregation supports models whose layers all use full "
                             f"attention; this one has sliding-window layers (windows {kv.group_windows})")
        self.programs, self.kv, self.counter = programs, kv, compile_counter
        self.block_size = kv.block_size
        cache = programs.kv_cache
        self.num_blocks = int(cache.k.shape[1])
        self.fields = [f for f in _BLOCK_FIELDS if getattr(cache, f, None) is not None
                       and getattr(cache, f).shape[1] == self.num_blocks]
        self.buckets = _buckets(max_blocks)
        shardings = jax.tree.map(lambda a: a.sharding, cache)
        ids = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
        self._gather, self._scatter = {}, {}
        for n in self.buckets:  # compiled here, ahead of serving (outside the counter's track: warmup)
            self._gather[n] = jax.jit(self._gather_fn).lower(cache, ids(n)).compile()
            data = {f: jax.ShapeDtypeStruct((getattr(cache, f).shape[0], n) + getattr(cache, f).shape[2:],
                                            getattr(cache, f).dtype) for f in self.fields}
            self._scatter[n] = jax.jit(self._scatter_fn, donate_argnums=(0,), out_shardings=shardings).lower(
                cache, ids(n), data).compile()
        self._exported: dict[str, tuple[KVTransfer, dict[str, jax.Array], int]] = {}
        self._lock = threading.Lock()
        self.num_exported = self.num_imported = 0  # requests
        self.blocks_exported = self.blocks_imported = 0

    def _gather_fn(self, cache: Any, ids: jax.Array) -> dict[str, jax.Array]:
        return {f: jnp.take(getattr(cache, f), ids, axis=1) for f in self.fields}

    def _scatter_fn(self, cache: Any, ids: jax.Array, data: dict[str, jax.Array]) -> Any:
        # Padding ids are num_blocks: out of range, dropped.
        return dataclasses.replace(cache, **{f: getattr(cache, f).at[:, ids].set(data[f], mode="drop")
                                             for f in self.fields})

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} blocks exceed one sequence's {self.buckets[-1]}")

    # -- prefill side --------------------------------------------------------------------
    def export(self, request: Request) -> None:
        """Copy the blocks of a finished request out of the device cache (enqueued; called by
        the scheduler just before it frees them). Engine thread."""
        null = self.kv.pool.null_block.block_id
        blocks, ids = [], []
        for g, table in enumerate(self.kv.block_tables(request.request_id)):
            for i, b in enumerate(table):
                if b != null:
                    blocks.append((g, i))
                    ids.append(b)
        n = len(ids)
        padded = np.zeros(self._bucket(max(n, 1)), np.int32)  # padding reads the null block
        padded[:n] = ids
        with self.counter.track():
            arrays = self._gather[len(padded)](self.programs.kv_cache, padded)
        transfer = KVTransfer(
            prompt_token_ids=list(request.prompt_token_ids), first_token_id=int(request.output_token_ids[0]),
            sample_seed=int(request.sample_seed), num_cached_tokens=max(0, request.num_cached_tokens),
            block_size=self.block_size, blocks=blocks, arrays={})
        with self._lock:
            self._exported[request.request_id] = (transfer, arrays, n)
        self.num_exported += 1
        self.blocks_exported += n

    def take(self, request_id: str) -> KVTransfer | None:
        """The exported transfer of a finished request, arrays on the host (any thread); None
        if the request exported nothing (it was aborted, or it is unknown)."""
        with self._lock:
            item = self._exported.pop(request_id, None)
        if item is None:
            return None
        transfer, arrays, n = item
        transfer.arrays = {f: np.asarray(jax.device_get(a))[:, :n] for f, a in arrays.items()}
        return transfer

    def discard(self, request_id: str) -> None:
        """Forget an export nobody will take (its reader went away; Engine.abort_request calls
        this too, for a request that finished before its abort came)."""
        with self._lock:
            self._exported.pop(request_id, None)

    @property
    def num_pending_exports(self) -> int:
        return len(self._exported)

    # -- decode side ---------------------------------------------------------------------
    def admit(self, request: Request) -> bool:
        """Give an imported request its blocks and write the transfer into them (scheduler,
        engine thread); False if there are too few free blocks now. Its prompt then counts
        as computed and the transfer is dropped (a preempted request recomputes)."""
        transfer: KVTransfer = request.kv_import
        hits, num_hit = self.kv.get_computed_blocks(request)
        if not self.kv.allocate_slots(request, request.num_tokens - num_hit, hits):
            return False
        tables = self.kv.block_tables(request.request_id)
        null = self.kv.pool.null_block.block_id
        hit_blocks = num_hit // self.block_size
        src, dst = [], []
        for j, (g, i) in enumerate(transfer.blocks):
            if i >= hit_blocks and i < len(tables[g]) and tables[g][i] != null:
                src.append(j)
                dst.append(tables[g][i])
        if dst:
            n = self._bucket(len(dst))
            ids = np.full(n, self.num_blocks, np.int32)
            ids[:len(dst)] = dst
            data = {}
            for f in self.fields:
                a = np.asarray(transfer.arrays[f])[:, src]
                pad = np.zeros((a.shape[0], n - len(src)) + a.shape[2:], a.dtype)
                data[f] = np.concatenate([a, pad], axis=1)
            with self.counter.track():
                self.programs.kv_cache = self._scatter[n](self.programs.kv_cache, ids, data)
        request.num_computed_tokens = len(transfer.prompt_token_ids)
        request.kv_import = None
        self.num_imported += 1
        self.blocks_imported += len(dst)
        return True

    def check(self, transfer: KVTransfer) -> None:
        """Raises InvalidRequestError if the transfer cannot go into this engine's cache."""
        cache = self.programs.kv_cache
        if transfer.block_size != self.block_size:
            raise InvalidRequestError(f"the KV transfer has blocks of {transfer.block_size} tokens, this engine "
                                      f"{self.block_size}: prefill and decode need one block_size", param="kv_transfer")
        for f in self.fields:
            a = transfer.arrays.get(f)
            want = (getattr(cache, f).shape[0],) + tuple(getattr(cache, f).shape[2:])
            if a is None or (a.shape[0],) + tuple(a.shape[2:]) != want or a.dtype != getattr(cache, f).dtype:
                raise InvalidRequestError(f"the KV transfer's {f} blocks do not fit this engine's cache "
                                          f"({want}, {getattr(cache, f).dtype}): prefill and decode must serve one "
                                          "model with the same KV settings", param="kv_transfer")


def add_request(engine: Any, req: ProcessedRequest) -> None:
    """Engine.add_processed for a request with a kv_transfer: ExportKV (prefill side) or a
    KVTransfer (decode side). One sequence (n=1), no LoRA adapter, no prompt logprobs.

    Raises:
        InvalidRequestError: what P/D cannot move, or a transfer that does not fit.
    """
    mover: KVMover | None = engine.kv_transfer
    params, transfer = req.params, req.kv_transfer
    if mover is None:
        raise InvalidRequestError("this engine moves no KV (Engine.enable_kv_transfer)", param="kv_transfer")
    if params.n != 1 or req.lora_request is not None or params.prompt_logprobs is not None:
        raise InvalidRequestError("a KV transfer moves one sequence without a LoRA adapter or prompt logprobs",
                                  param="kv_transfer")
    importing = isinstance(transfer, KVTransfer)
    if importing:
        mover.check(transfer)
    state = engine.outputs.add_request(req.request_id, req.prompt, req.prompt_token_ids, params)
    if importing:
        seed = transfer.sample_seed
    elif params.seed is not None:
        seed = params.seed % 2**32
    else:
        seed = int(engine._rng.integers(2**32))
    request = Request(
        req.request_id, req.prompt_token_ids, params, eos_token_ids=tuple(engine.model.eos_token_ids),
        block_size=engine.block_size, max_model_len=engine.max_model_len, sample_seed=seed,
        arrival_time=req.arrival_time,
        token_constraints=req.constraints.start() if req.constraints is not None else None,
    )
    state.child_ids.append(req.request_id)
    if not importing:
        request.kv_export = True
    elif transfer.prompt_token_ids == list(req.prompt_token_ids) and _continues(request, transfer.first_token_id):
        request.num_cached_tokens = transfer.num_cached_tokens
        request.append_output_token(transfer.first_token_id)
        state.add_token(request, transfer.first_token_id, None, engine.outputs.texts)
        comp = state.completions[0]
        if comp.logprobs is not None and transfer.first_logprobs:
            comp.logprobs.append(transfer.first_logprobs)
            comp.cumulative_logprob += transfer.first_logprobs[transfer.first_token_id].logprob
        request.kv_import = transfer
    # else: the prompt differs, or the first token alone ends it: computed here from the start.
    engine.scheduler.add_request(request)
    engine._prompt_tokens += len(req.prompt_token_ids)


def _continues(request: Request, first: int) -> bool:
    """Whether the request goes on after `first` (the one stop decision, asked on a copy)."""
    probe = Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                    eos_token_ids=request.eos_token_ids, block_size=request.block_size,
                    max_model_len=request.max_tokens + request.num_prompt_tokens, sample_seed=0)
    probe.output_token_ids.append(first)
    probe.all_token_ids.append(first)
    return check_stop(probe, first) is None
