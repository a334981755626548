"""Compilation: shape buckets, the persistent XLA cache, and a counter of compilations.

Every step is padded to a (tokens, sequences) bucket so that serving only ever runs
programs compiled at warmup. `CompileCounter` proves it: it counts XLA backend
compilations (the `/jax/core/compile/backend_compile_duration` event, which fires for
jitted functions and for eager jnp ops on new shapes alike) made while the engine's own
thread is inside `counter.track()`, so other threads' work is not blamed on the engine.
The event wraps `compile_or_get_cached`, so programs loaded from the persistent cache
count as well: the guard does not depend on the state of the on-disk cache.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import jax
from tqdm.auto import tqdm

logger = logging.getLogger("servax.engine")

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_local = threading.local()
_listener_lock = threading.Lock()
_listener_installed = False


def _pow2_range(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return sorted(set(out))


# Steps of at most this many tokens (small decode batches) get their own exact power-of-two
# buckets: on XLA:CPU a 1-token step of a 100M model takes ~26 ms against ~88 ms padded to 16,
# because small matmuls are far from the bandwidth floor once M grows past a few rows
# (XLA's own matmuls; not on packed weights, see packed_weight_buckets).
SMALL_STEP_TOKENS = 8


# From this many tokens up, a bucket halfway (1.5x) between powers of two as well: a step of
# 32 decodes and one ~100-token prompt (what serving under load runs between pure decode steps)
# then pays for 192 tokens, not 256.
MID_BUCKETS_FROM = 128


def token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    """Padded token counts: 1, 2, 4, 8, then powers of two from `smallest` up to the budget,
    with 1.5x steps between them from MID_BUCKETS_FROM (192, 384, ...)."""
    small = [b for b in (1, 2, 4, 8) if b <= min(SMALL_STEP_TOKENS, max_num_batched_tokens)]
    pow2 = _pow2_range(min(smallest, max_num_batched_tokens), max_num_batched_tokens)
    mid = [b * 3 // 2 for b in pow2 if b >= MID_BUCKETS_FROM and b * 3 // 2 < max_num_batched_tokens]
    return sorted(set(small + pow2 + mid))


def packed_weight_buckets(tokens: list[int], seqs: list[int]) -> tuple[list[int], list[int]]:
    """(token buckets, sequence buckets) for steps whose products run on packed weights
    (runtime/ops/matmul.py). That kernel multiplies only a step's real rows, so padding 2-8
    tokens to 16 costs little and the small-step buckets 2, 4 and 8 would only be programs
    to compile (the default app's warmup, demo model, cold: 6.9 -> 4.1 s without them). The bucket
    of 1 token stays, with a sequence bucket of 1 beside the others: a lone sequence's decode
    step (demo model, 96 steps in one process) takes 22.3-22.7 ms at (1, 1), 23.2-23.4 at
    (16, 1) (the elementwise work of the padding rows) and 23.5-24.6 at (16, 8) (the
    sampler's work grows with its rows). The largest token bucket stays when the budget is
    that small."""
    kept = [b for b in tokens if b == 1 or b > SMALL_STEP_TOKENS]
    return (kept if len(kept) > 1 else sorted({1, tokens[-1]})), sorted({1, *seqs})


def seq_buckets(max_num_seqs: int, smallest: int = 8) -> list[int]:
    """Padded sequence counts: powers of two from `smallest` (cheap to pad) up to max_num_seqs."""
    return _pow2_range(min(smallest, max_num_seqs), max_num_seqs)


def step_bucket(num_tokens: int, num_rows: int, tokens: list[int], seqs: list[int]) -> tuple[int, int]:
    """The (tokens, sequences) bucket of a step: small steps pad rows to the token bucket
    (one program each), larger ones pick their sequence bucket independently."""
    t = bucket_for(num_tokens, tokens)
    if t <= SMALL_STEP_TOKENS:
        return t, min(t, seqs[-1])
    return t, bucket_for(num_rows, seqs)


def step_buckets(tokens: list[int], seqs: list[int]) -> list[tuple[int, int]]:
    """Every (tokens, sequences) bucket `step_bucket` can return (a row has at least one token)."""
    small = [(t, min(t, seqs[-1])) for t in tokens if t <= SMALL_STEP_TOKENS]
    return small + [(t, s) for t in tokens if t > SMALL_STEP_TOKENS for s in seqs if s <= t]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n. Raises ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "servax" / "xla")


def enable_persistent_cache(cache_dir: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache (None: the default dir; '': leave it off).

    Returns the directory in use, or None when disabled.
    """
    if cache_dir == "":
        return None
    cache_dir = os.path.expanduser(cache_dir or default_cache_dir())
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir


def _on_event(event: str, duration: float, **_: object) -> None:
    if event != _COMPILE_EVENT:
        return
    counter = getattr(_local, "counter", None)
    if counter is not None:
        counter._record(duration)


def _install_listener() -> None:
    global _listener_installed
    with _listener_lock:
        if not _listener_installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listener_installed = True


class CompileCounter:
    """Counts XLA compilations on threads while they are inside `track()`."""

    def __init__(self) -> None:
        _install_listener()
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self._baseline = 0

    def _record(self, duration: float) -> None:
        with self._lock:
            self.count += 1
            self.seconds += duration

    @contextmanager
    def track(self) -> Iterator[None]:
        previous = getattr(_local, "counter", None)
        _local.counter = self
        try:
            yield
        finally:
            _local.counter = previous

    def mark_warm(self) -> None:
        """Start counting 'since warmup' from now."""
        with self._lock:
            self._baseline = self.count

    @property
    def since_warmup(self) -> int:
        return self.count - self._baseline


BACKGROUND_NICENESS = 10  # of the threads that compile while the engine serves (Linux)


def lower_thread_priority() -> None:
    """Give the calling thread a lower CPU priority (Linux: a thread's own nice value; threads
    it starts inherit it), so that compiling in the background yields the cores to serving.
    Elsewhere (setpriority there would reach the whole process) nothing changes."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except OSError as e:  # e.g. a sandbox without the permission
        logger.debug("background compile thread keeps its priority: %s", e)


class BucketPrograms:
    """The compiled programs of a runner, by key: ("step", tokens, seqs) for a step bucket,
    ("sampler", seqs, penalties) for a sampler variant; and the background thread that
    compiles those left once the engine serves.

    `submit` lowers keys' programs on the calling thread and compiles each on a pool; a key
    is `ready` once all its programs (with those it shares with an earlier bucket of the
    same token count) have compiled. While programs are left (`all_ready` false), a step
    runs in the smallest ready bucket it fits in (`fitting_bucket`): the largest bucket is
    compiled before the engine serves, so every step has one.
    """

    def __init__(self, lower: Callable[[tuple, set], list]):
        self._lower = lower  # (key, shapes of shared programs lowered so far) -> lowered programs
        self._seen: set = set()
        self._shared: dict[int, list[Future]] = {}  # token bucket -> its shared programs (prologue, layers)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._done.set()
        self.ready: set[tuple] = set()
        self.all_ready = True  # nothing left to compile: steps take their own buckets
        self.error: BaseException | None = None
        self.pool: ThreadPoolExecutor | None = None  # the pool the programs left compile on

    def submit(self, keys: list[tuple], pool: ThreadPoolExecutor, show_progress: bool = False) -> list[Future]:
        """Lower the programs of `keys` here, in order, each handed to `pool` to compile as soon
        as it is lowered; the futures of every program."""
        futures: list[Future] = []
        for key in tqdm(keys, desc="servax: tracing buckets", disable=not show_progress):
            programs = self._lower(key, self._seen)
            own = [pool.submit(program.compile) for program in programs]
            needs = list(own)
            if key[0] == "step":
                if len(programs) > 1:  # the first bucket of its token count: its shared programs too
                    self._shared[key[1]] = own[:-1]
                else:
                    needs = self._shared.get(key[1], []) + own
            self._mark_ready_when_done(key, needs)
            futures += own
        return futures

    def _mark_ready_when_done(self, key: tuple, needs: list[Future]) -> None:
        left = [len(needs)]

        def done(_: Future) -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last and all(f.exception() is None for f in needs):
                self.ready.add(key)

        for future in needs:
            future.add_done_callback(done)

    def start(self, keys: list[tuple]) -> None:
        """Compile `keys` on a background thread (lowering there, compiling on `self.pool`);
        steps use the buckets ready meanwhile."""
        self.all_ready = False
        self._done.clear()
        thread = threading.Thread(target=self._compile_later, args=(keys,), name="servax-compile-background",
                                  daemon=True)
        thread.start()

    def _compile_later(self, keys: list[tuple]) -> None:
        start = time.perf_counter()
        pool = self.pool
        try:
            lower_thread_priority()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                for future in self.submit(keys, pool):
                    future.result()
            logger.info("compiled the %d programs left in %.1fs in the background: every bucket in use",
                        len(keys), time.perf_counter() - start)
            self.all_ready = True
        except BaseException as e:  # noqa: BLE001 - reported; steps keep the buckets that compiled
            self.error = e
            logger.exception("compiling in the background failed; steps keep to the buckets compiled")
        finally:
            pool.shutdown()
            self.pool = None
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation (if any); whether it has ended."""
        return self._done.wait(timeout)

    def fitting_bucket(self, t: int, s: int, penalties: bool, largest: tuple[int, int]) -> tuple[int, int]:
        """The smallest ready bucket that holds a step of bucket (t, s) and has its sampler
        variant; the largest bucket once its sampler variant is ready (waited for)."""
        ready = self.ready.copy()
        fits = [(k[1], k[2]) for k in ready
                if k[0] == "step" and k[1] >= t and k[2] >= s and ("sampler", k[2], penalties) in ready]
        if fits:
            return min(fits)
        key = ("sampler", largest[1], penalties)  # compiled first in the background
        while key not in self.ready:
            if self._done.wait(0.005) and key not in self.ready:
                raise RuntimeError(f"the sampler program {key} did not compile: {self.error!r}")
        return largest
