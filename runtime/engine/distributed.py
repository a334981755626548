"""One engine over the devices of several processes: JAX multi-controller, placed by Ray.

When `tensor_parallel_size` exceeds the devices of one process, the engine's mesh spans
several processes, one per host on a real cluster. JAX runs such a mesh multi-controller:
every process joins `jax.distributed`, holds the shards of the weights and of the KV cache
on its own devices, and runs the same compiled programs in the same order on the same
inputs. Here the process that builds the engine (a Serve replica, or the script that made
`LLM(...)`) is the leader, process 0: it alone schedules. The others are `EngineWorker`
Ray actors that load their shards and then repeat what the leader's programs
(runtime/engine/programs.py) do on the device: the leader's `MirroredPrograms` sends each
call's small host inputs (token ids, positions, block tables, sampling arrays) to every
worker before running it itself (`ProcessGroup.call`); the workers' results are never read,
the leader reads its own (the step's outputs are replicated).

    group = distributed.connect(config, load_model)    # None: the mesh fits this process
    ...
    MirroredPrograms(group, model, mesh, plan, ...)   # every device call is repeated on the workers

A process joins `jax.distributed` at most once, before JAX first touches its devices, so a
process leads at most one group (`current_group`). The JAX coordination service ends every
process of the group when one of them stops heartbeating (three times `distributed_timeout_s`),
so a worker that dies takes its replica down with it even when nothing reports it, and Serve
starts a new group.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from runtime.engine.programs import ModelPrograms, as_arrays

logger = logging.getLogger("servax.engine")

_FORCED_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
# Environment a worker must share with its leader to see the same devices and programs.
_SHARED_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64", "SERVAX_CACHE", "HF_HOME", "HF_HUB_OFFLINE")

_group: "ProcessGroup | None" = None
_is_worker = False


class DistributedError(RuntimeError):
    """The process group cannot form, or a member of it failed."""


def local_device_count() -> int:
    """Devices that one process of this host gets, without initializing JAX's backend here
    (that would make joining jax.distributed impossible).

    On CPU it is what XLA_FLAGS' --xla_force_host_platform_device_count says (1 without
    it); otherwise a short-lived subprocess asks JAX.
    """
    if _platform() == "cpu":
        match = _FORCED_DEVICES.search(os.environ.get("XLA_FLAGS", ""))
        return int(match.group(1)) if match else 1
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.local_device_count())"],
                         capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _platform() -> str:
    """The platform JAX uses (or will use) here: cpu, gpu/cuda or tpu, without starting its
    backend where it has not started: JAX_PLATFORMS' first entry, else the accelerator plugin
    installed (libtpu: tpu; a jax CUDA plugin: gpu), else cpu."""
    import importlib.util

    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        import jax

        return jax.devices()[0].platform
    platform = os.environ.get("JAX_PLATFORMS", "").split(",")[0]
    if platform:
        return platform
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin")
    return "gpu" if any(importlib.util.find_spec(m) is not None for m in plugins) else "cpu"


def num_processes(tensor_parallel_size: int, data_parallel_size: int = 1, local_devices: int | None = None) -> int:
    """How many processes the mesh needs: 1 when it fits this process's devices.

    Raises:
        ValueError: the mesh is larger than one process but not a whole number of them.
    """
    local = local_device_count() if local_devices is None else local_devices
    needed = tensor_parallel_size * data_parallel_size
    if needed <= local:
        return 1
    if needed % local:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {needed} devices, more than the {local} of one "
            f"process, but is not a multiple of {local}: every process contributes all its devices, so use a "
            f"multiple of {local} (or change the devices per process)"
        )
    return needed // local


def current_group() -> "ProcessGroup | None":
    """The group this process leads (None: a single-process engine, or this is a worker)."""
    return _group


def connect(config: Any, loader: Callable[[Any], Any]) -> "ProcessGroup | None":
    """Form this engine's process group if its mesh needs more than this process.

    Starts one EngineWorker actor per further process, joins jax.distributed with them
    (this process is process 0, the coordinator) and has each start loading its shards
    with `loader(config)` while the caller loads its own. Returns None when one process
    suffices, and in a worker (whose loader call lands here too).

    Raises:
        ValueError: distributed_executor_backend="uni" with a mesh larger than one process,
            JAX already initialized in this process, or a placement group too small.
        DistributedError: the workers could not join in time.
    """
    global _group
    if _is_worker:
        return None
    local = local_device_count()
    processes = num_processes(config.tensor_parallel_size, config.data_parallel_size, local)
    if processes == 1:
        return None
    needs = (f"tensor_parallel_size={config.tensor_parallel_size} needs {config.tensor_parallel_size} devices, "
             f"but {local} {_platform()} device(s) are available in this process")
    if config.distributed_executor_backend == "uni":
        raise ValueError(f"{needs}, and distributed_executor_backend='uni' keeps the engine in one process; "
                         f"use 'ray' (the default) to run it over {processes} processes")
    from jax._src import xla_bridge

    if _group is None and xla_bridge.backends_are_initialized():
        raise ValueError(
            f"{needs}; a multi-process engine over {processes} processes must be created before JAX uses the "
            "devices in this process (jax.distributed joins first): create the LLM before other JAX work, in a "
            "fresh process, or lower tensor_parallel_size (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "before importing jax gives one process N devices)"
        )
    if _group is not None:
        if _group.config_key != _config_key(config):
            raise ValueError("this process already leads a multi-process engine (jax.distributed joins once per "
                             "process); run the second one in another process, e.g. another Serve replica")
        return _group
    _group = ProcessGroup(config, processes, loader)
    return _group


def _config_key(config: Any) -> tuple:
    return (config.model, config.tensor_parallel_size, config.data_parallel_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _join(coordinator: str, processes: int, process_id: int, timeout_s: float) -> None:
    import jax

    if _platform() == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The heartbeat limit is three times the step limit, so that a hung step is reported (and Serve
    # replaces the replica) well before JAX's coordination service ends the processes itself.
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id,
                               initialization_timeout=int(timeout_s), heartbeat_timeout_seconds=int(3 * timeout_s))


def _accelerator_request(devices: int) -> dict[str, Any]:
    """What a worker asks Ray for beyond its CPU, so that Ray gives it (and makes visible) its own
    accelerators: GPUs through num_gpus, TPU chips through the TPU resource; nothing on CPU."""
    platform = _platform()
    if platform == "cpu":
        return {}
    return {"resources": {"TPU": devices}} if platform == "tpu" else {"num_gpus": devices}


def _payload_bytes(args: Any) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(args) if isinstance(x, np.ndarray))


class ProcessGroup:
    """The leader's view of a multi-process engine: its worker actors and the calls they repeat.

    Args:
        config: the EngineConfig (workers load the same model the same way).
        processes: the processes of the mesh, this one included.
        loader: `loader(config)` loads the model on the global mesh (app.llm.load_model).
    """

    def __init__(self, config: Any, processes: int, loader: Callable[[Any], Any]):
        import ray

        self.config_key = _config_key(config)
        self.num_processes = processes
        self.local_devices = config.tensor_parallel_size * config.data_parallel_size // processes
        self.timeout_s = float(config.distributed_timeout_s)
        self.bytes_sent = 0  # host inputs sent to each worker so far (NumPy payload)
        self.calls = 0
        self._pending: list[Any] = []  # refs of calls whose outcome is not known yet
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        host = ray.util.get_node_ip_address()
        coordinator = f"{host}:{_free_port()}"
        env = {k: os.environ[k] for k in _SHARED_ENV if k in os.environ}
        self.workers = [
            _remote_worker().options(**self._placement(i), runtime_env={"env_vars": env}).remote(loader)
            for i in range(1, processes)
        ]
        logger.info("servax: joining %d processes over jax.distributed at %s (tensor_parallel_size=%d)",
                    processes, coordinator, config.tensor_parallel_size)
        t0 = time.perf_counter()
        joined = [w.join.remote(coordinator, processes, i, self.timeout_s) for i, w in enumerate(self.workers, 1)]
        try:
            _join(coordinator, processes, 0, self.timeout_s)
            ray.get(joined, timeout=self.timeout_s)
        except BaseException:
            self.shutdown(join=False)
            raise
        logger.info("servax: %d processes joined in %.1fs", processes, time.perf_counter() - t0)
        atexit.register(self.shutdown)  # before jax's own exit hook: all processes leave together
        self.call("load", config)

    def _placement(self, process_id: int) -> dict[str, Any]:
        """Worker `process_id` takes bundle `process_id` of the replica's placement group (bundle 0
        is the replica's own), so Serve reserves, kills and replaces the group as one; without a
        placement group it asks for one CPU (and the devices of its platform)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        if pg is None:
            return dict(num_cpus=1, **_accelerator_request(self.local_devices))
        bundles = pg.bundle_specs
        if len(bundles) < self.num_processes:
            raise ValueError(
                f"the placement group has {len(bundles)} bundle(s) but the engine runs {self.num_processes} "
                "processes (one bundle each, the first for the replica); list that many bundles in "
                "placement_group_config"
            )
        bundle = bundles[process_id]
        return dict(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=process_id),
        )

    def call(self, method: str, *args: Any) -> None:
        """Have every worker run `method(*args)` (in order with earlier calls); does not wait.

        Raises:
            DistributedError: a worker failed an earlier call.
        """
        self.check()
        self.calls += 1
        self.bytes_sent += _payload_bytes(args)
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        with self._lock:
            self._pending.extend(refs)

    def gather(self, method: str, *args: Any) -> list[Any]:
        """Run `method(*args)` on every worker and return their results (waits)."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers], timeout=self.timeout_s)

    def check(self) -> None:
        """Raise DistributedError if a worker has failed a call or died (any thread)."""
        import ray

        if self._error is not None:
            raise DistributedError(f"a worker of the {self.num_processes}-process engine failed: {self._error!r}")
        with self._lock:  # one checker at a time (the engine thread and Serve's health check)
            if not self._pending:
                return
            done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - any failure of a worker fails the group
                    self._error = e
                    raise DistributedError(
                        f"a worker of the {self.num_processes}-process engine failed: {e!r}") from e

    def shutdown(self, join: bool = True) -> None:
        """Leave jax.distributed together and stop the workers."""
        global _group
        import ray

        atexit.unregister(self.shutdown)
        if not self.workers:
            return
        if join and self._error is None:  # a failed group cannot meet at the shutdown barrier
            try:
                refs = [w.leave.remote() for w in self.workers]
                import jax

                jax.distributed.shutdown()
                ray.get(refs, timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - the workers are killed below either way
                logger.warning("servax: leaving jax.distributed: %r", e)
        else:
            for w in self.workers:
                ray.kill(w)
        # Wait until the actors have exited, so that nothing of the group outlives shutdown.
        ends = [w.__ray_terminate__.remote() for w in self.workers]
        ray.wait(ends, num_returns=len(ends), timeout=30)
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if _group is self:
            _group = None


class MirroredPrograms(ModelPrograms):
    """The leader's programs of a multi-process engine: every device call (each step and
    sampler run, warmup's compilation) is sent to the workers first, in order, and they run
    the same on their shards; the rest is ModelPrograms'.

    Args:
        peers: the ProcessGroup of the workers.
        build: the keyword arguments the workers build their ModelPrograms with.
        *args, **kwargs: ModelPrograms' own.
    """

    def __init__(self, peers: ProcessGroup, *args: Any, build: dict[str, Any], **kwargs: Any):
        self.peers = peers
        peers.call("build_programs", build)
        super().__init__(*args, **kwargs)

    def run_step(self, batch: Any) -> Any:
        self.peers.call("run_step", batch)
        return super().run_step(batch)

    def run_sample(self, logits: Any, sb: Any, *, use_penalties: bool) -> Any:
        arrays = sb if isinstance(sb, dict) else as_arrays(sb)
        self.peers.call("sample", arrays, use_penalties)
        return super().run_sample(logits, arrays, use_penalties=use_penalties)

    def warmup(self, show_progress: bool = True) -> float:
        """The workers compile every bucket (the plan compiles nothing in the background across
        processes), then the leader warms up and the workers count compilations from there."""
        self.peers.call("compile")
        seconds = super().warmup(show_progress)
        self.peers.call("mark_warm")
        return seconds


class EngineWorker:
    """One further process of a multi-process engine (a Ray actor): it loads its shards and
    repeats the leader's device calls (MirroredPrograms) in order."""

    def __init__(self, loader: Callable[[Any], Any]):
        global _is_worker
        _is_worker = True
        from runtime.engine.compilation import CompileCounter

        self.loader = loader
        self.model = None
        self.programs = None
        self._logits = None
        self.compile_counter = CompileCounter()

    def join(self, coordinator: str, processes: int, process_id: int, timeout_s: float) -> None:
        # Not a device query here: the backends of all processes start together, in `load`.
        _join(coordinator, processes, process_id, timeout_s)

    def load(self, config: Any) -> None:
        from runtime.engine.compilation import enable_persistent_cache

        enable_persistent_cache(config.compilation_cache_dir)  # the leader's engine does the same
        self.model = self.loader(config)

    def build_programs(self, kwargs: dict[str, Any]) -> None:
        from runtime.ops.mesh import make_mesh

        kwargs = dict(kwargs)
        mesh = make_mesh(kwargs.pop("tensor_parallel_size"), kwargs.pop("data_parallel_size"))
        self.programs = ModelPrograms(self.model, mesh, **kwargs)

    def compile(self) -> None:
        self.programs.compile_programs(show_progress=False)

    def run_step(self, batch: Any) -> None:
        with self.compile_counter.track():
            self._logits = self.programs.run_step(batch)

    def sample(self, sb: dict[str, np.ndarray], use_penalties: bool) -> None:
        with self.compile_counter.track():
            self.programs.run_sample(self._logits, sb, use_penalties=use_penalties)
        self._logits = None

    def mark_warm(self) -> None:
        self.compile_counter.mark_warm()

    def compilations_since_warmup(self) -> int:
        return self.compile_counter.since_warmup

    def param_bytes(self) -> int:
        """Bytes of the weights this process holds (its addressable shards)."""
        return param_bytes(self.model.params)

    def leave(self) -> None:
        import jax

        jax.distributed.shutdown()


def param_bytes(params: Any) -> int:
    """Bytes of `params` held by this process's devices."""
    import jax

    return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)


@functools.cache
def _remote_worker():
    """EngineWorker as a Ray actor class (its processes are titled ray::EngineWorker)."""
    import ray

    return ray.remote(EngineWorker)
