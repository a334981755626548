"""The leader of a multi-process engine, for tests/test_multiprocess.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multiprocess_leader.py SPEC_JSON

This process makes `LLM(model, tensor_parallel_size=8, distributed_executor_backend="ray")`
on a fresh local Ray cluster; with 4 devices per process that is 2 processes (this one and
one worker actor) joined by jax.distributed. It must be a fresh process: jax.distributed
joins before JAX first uses the devices. Writes one JSON object (tokens, bytes, counters) to
the file spec["result_path"]: not to stdout, where Ray may print after it. The
run ends with `finish`: "shutdown" (LLM.shutdown, then are the workers gone?) or "hang" (the
worker is stopped mid-request: how soon does the engine report it?).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import jax
import ray


def main(spec: dict) -> dict:
    from app.llm import LLM
    from runtime import SamplingParams
    from runtime.engine.distributed import param_bytes

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    llm = LLM(spec["model"], tensor_parallel_size=spec["tp"], distributed_executor_backend="ray",
              model_impl=spec["model_impl"], **spec["engine"])
    engine = llm.engine
    greedy = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=spec["max_tokens"], temperature=0.9, top_p=0.95, seed=100 + i,
                              ignore_eos=True) for i in range(len(spec["prompts"]))]
    before = engine.stats()
    out_greedy = llm.generate(spec["prompts"], greedy, use_tqdm=False)
    mid = engine.stats()
    out_sampled = llm.generate(spec["prompts"], sampled, use_tqdm=False)
    stats = engine.stats()
    result = dict(
        num_devices=len(jax.devices()), local_devices=jax.local_device_count(), process_count=jax.process_count(),
        mesh=dict(engine.mesh.shape), num_processes=stats.num_processes,
        greedy=[o.outputs[0].token_ids for o in out_greedy], sampled=[o.outputs[0].token_ids for o in out_sampled],
        total_param_bytes=sum(x.nbytes for x in jax.tree.leaves(engine.model.params)),
        leader_param_bytes=param_bytes(engine.model.params),
        worker_param_bytes=engine.peers.gather("param_bytes"),
        compilations_since_warmup=stats.compilations_since_warmup,
        worker_compilations_since_warmup=engine.peers.gather("compilations_since_warmup"),
        greedy_calls=mid.distributed_calls - before.distributed_calls,
        greedy_bytes=mid.distributed_bytes_sent - before.distributed_bytes_sent,
        kv_blocks_used_after=stats.kv_blocks_used,
    )
    if spec["finish"] == "hang":
        result["hang"] = hang_worker(llm)
        _write(spec, result)
        # The group is broken on purpose: stop this Ray cluster, then leave without the
        # jax.distributed shutdown barrier that a killed worker cannot meet.
        ray.shutdown()
        os._exit(0)
    workers = list(engine.peers.workers)
    llm.shutdown()
    result["workers_left"] = sum(_alive(w) for w in workers)
    deadline = time.time() + 30  # the actor is dead; give its process time to exit
    while _worker_pids() and time.time() < deadline:
        time.sleep(0.5)
    result["worker_processes_left"] = len(_worker_pids())
    return result


def _write(spec: dict, result: dict) -> None:
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)


def _worker_pids() -> list[int]:
    """This leader's EngineWorker processes (its cluster's workers: its descendants)."""
    from conftest import own_processes  # tests/, this script's folder

    return own_processes("^ray::EngineWorker")


def hang_worker(llm) -> dict:
    """Stop (SIGSTOP) the worker process while a request decodes: the engine must report
    itself unhealthy once a step has waited distributed_timeout_s."""
    from runtime import SamplingParams
    from runtime.engine.errors import EngineDeadError

    (pid,) = _worker_pids()
    thread = threading.Thread(target=lambda: _ignore_errors(llm.generate, [[5, 6, 7]], SamplingParams(
        max_tokens=120, temperature=0, ignore_eos=True), use_tqdm=False), daemon=True)
    thread.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.perf_counter()
    error = None
    while error is None and time.perf_counter() - stopped < 120:
        try:
            llm.engine.check_health()
            time.sleep(0.25)
        except EngineDeadError as e:
            error = str(e)
    seconds = time.perf_counter() - stopped
    os.kill(pid, signal.SIGKILL)
    return dict(seconds=seconds, error=error, timeout_s=llm.config.distributed_timeout_s)


def _ignore_errors(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the step fails once the stopped worker is killed
        pass


def _alive(actor) -> bool:
    try:
        ray.get(actor.param_bytes.remote(), timeout=30)
        return True
    except ray.exceptions.RayActorError:
        return False


if __name__ == "__main__":
    assert "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""), "set XLA_FLAGS first"
    spec = json.loads(sys.argv[1])
    _write(spec, main(spec))
