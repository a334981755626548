"""Compilation: the persistent XLA cache, the programs of every bucket, and a counter of compilations.

Every step is padded to a (tokens, sequences) bucket (the execution plan's, runtime/engine/plan.py)
so that serving only ever runs programs compiled at warmup. `CompileCounter` proves it: it counts XLA backend
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
    runs in the smallest ready bucket it fits in (`step_ready`, asked by the plan's
    `compiled_bucket`): the largest bucket is compiled before the engine serves, so every
    step has one.
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
        self.num_programs = 0  # programs lowered and handed to a pool to compile

    def submit(self, keys: list[tuple], pool: ThreadPoolExecutor, show_progress: bool = False) -> list[Future]:
        """Lower the programs of `keys` here, in order, each handed to `pool` to compile as soon
        as it is lowered; the futures of every program."""
        futures: list[Future] = []
        for key in tqdm(keys, desc="servax: tracing buckets", disable=not show_progress):
            programs = self._lower(key, self._seen)
            self.num_programs += len(programs)
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

    def step_ready(self, bucket: tuple[int, int], penalties: bool) -> bool:
        """Whether a step of `bucket` can run now: its programs and its sampler variant are compiled."""
        ready = self.ready
        return ("step", *bucket) in ready and ("sampler", bucket[1], penalties) in ready

    def wait_for_sampler(self, seqs: int, penalties: bool) -> None:
        """Wait until the sampler variant of `seqs` sequences is compiled (the background
        thread compiles the largest bucket's first). Raises RuntimeError if it cannot be."""
        key = ("sampler", seqs, penalties)
        while key not in self.ready:
            if self._done.wait(0.005) and key not in self.ready:
                raise RuntimeError(f"the sampler program {key} did not compile: {self.error!r}")
