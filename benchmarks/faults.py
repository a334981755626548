"""Faults under load: one of two replicas loses its engine (or its whole actor); what clients see.

`serve run` of two replicas of one model, each a two-process engine (tensor_parallel_size 8
over 2 processes of 4 fake CPU devices, as configs/multiprocess-cpu.yaml). Clients keep
`--concurrency` completion requests in flight; after `--warm-s` seconds one fault is injected:

  * worker:  SIGKILL of one replica's worker process. That replica's engine loop dies (its step
             fails), the actor lives on and reports unhealthy; Serve replaces it.
  * replica: SIGKILL of one replica actor's process (its worker goes down with it).

Per phase (before the fault, until Serve runs two replicas again, after): requests answered
200 and 503 (and anything else), latency percentiles, and the longest wait of any request
(none may hang); then the time from the fault to the replaced replica running.

    python benchmarks/faults.py --fault worker    (or replica; one fault per run)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, running_replicas, serve_app, table  # noqa: E402

PORT = 8125
MODEL = "servax-tiny/llama-8-heads"
CONFIG = f"""
http_options: {{host: 127.0.0.1, port: {PORT}}}
applications:
- name: faults
  route_prefix: /
  import_path: app.builder:build_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: {MODEL}}}
      engine_kwargs: {{model_impl: jax, max_model_len: 256, max_num_seqs: 4, max_num_batched_tokens: 32,
                      num_kv_blocks: 128, show_progress: false, tensor_parallel_size: 8,
                      distributed_timeout_s: 30}}
      runtime_env: {{env_vars: {{XLA_FLAGS: --xla_force_host_platform_device_count=4, JAX_PLATFORMS: cpu}}}}
      placement_group_config: {{bundles: [{{CPU: 0.5}}, {{CPU: 0.5}}], strategy: PACK}}
      deployment_config: {{num_replicas: 2, max_ongoing_requests: 16, health_check_period_s: 2,
                          ray_actor_options: {{num_cpus: 0.5}}}}
"""
BODY = dict(model=MODEL, prompt="Hello world", max_tokens=16, temperature=0, ignore_eos=True)


def pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


async def client(http, results: list, stop: asyncio.Event) -> None:
    import httpx

    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = await http.post("/v1/completions", json=BODY, timeout=120)
            status = r.status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        results.append((t0, time.perf_counter(), status))
        if status != 200:
            await asyncio.sleep(0.2)  # a client backs off after an error


async def scenario(fault: str, concurrency: int, warm_s: float, recover_timeout_s: float) -> dict:
    import httpx

    results: list = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}") as http:
        clients = [asyncio.create_task(client(http, results, stop)) for _ in range(concurrency)]
        await asyncio.sleep(warm_s)
        workers = pids("^ray::EngineWorker")
        replicas = pids("^ray::ServeReplica:faults:LLMServer")
        target = workers[0] if fault == "worker" else replicas[0]
        os.kill(target, signal.SIGKILL)
        fault_at = time.perf_counter()
        # Back when Serve reports two running replicas again, one of them with a new worker.
        back_at = None
        while time.perf_counter() - fault_at < recover_timeout_s:
            await asyncio.sleep(0.5)
            fresh = set(pids("^ray::EngineWorker")) - set(workers)
            if fresh and await asyncio.to_thread(running_replicas) == 2:
                back_at = time.perf_counter()
                break
        await asyncio.sleep(warm_s / 2)  # and after
        stop.set()
        await asyncio.gather(*clients)
    return dict(results=results, fault_at=fault_at, back_at=back_at, end=time.perf_counter())


def summarize(fault: str, run: dict) -> list[list]:
    rows = []
    fault_at, back_at = run["fault_at"], run["back_at"] or run["end"]
    phases = [("before the fault", None, fault_at), ("fault -> replica back", fault_at, back_at),
              ("after", back_at, None)]
    for name, lo, hi in phases:
        done = [(t0, t1, s) for t0, t1, s in run["results"] if (lo is None or t1 >= lo) and (hi is None or t1 < hi)]
        ok = [t1 - t0 for t0, t1, s in done if s == 200]
        n503 = sum(s == 503 for _, _, s in done)
        other = sum(s not in (200, 503) for _, _, s in done)
        p = lambda xs, q: f"{statistics.quantiles(xs, n=100)[q - 1] * 1e3:.0f}" if len(xs) >= 2 else "-"  # noqa: E731
        longest = max(done, key=lambda r: r[1] - r[0], default=None)
        wait = "-" if longest is None else (f"{longest[1] - longest[0]:.1f} ({longest[2]}, sent at "
                                              f"{longest[0] - fault_at:+.1f} s)")
        rows.append([fault, name, len(ok), n503, other, p(ok, 50), p(ok, 99), wait])
    recovered = f"{run['back_at'] - fault_at:.1f} s" if run["back_at"] else "not within the limit"
    errors = sorted(f"{t1 - fault_at:+.1f}" for t0, t1, s in run["results"] if s != 200)
    print(f"{fault}: non-200 answers at (s from the fault): {', '.join(errors)}", flush=True)
    rows.append([fault, f"replica back after {recovered}", "", "", "", "", "", ""])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=["worker", "replica"], default="worker")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warm-s", type=float, default=20.0)
    parser.add_argument("--recover-timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    import httpx

    def ready() -> bool:
        r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=BODY, timeout=30)
        return r.status_code == 200 and len(pids("^ray::EngineWorker")) == 2

    headers = ["fault", "phase", "200", "503", "other", "p50 ms", "p99 ms",
               "longest wait (s; status, sent at, from the fault)"]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "faults.yaml"
        config.write_text(CONFIG)
        with serve_app(config, ready) as startup_s:
            print(f"{args.fault}: two replicas ready in {startup_s:.0f} s", flush=True)
            run = asyncio.run(scenario(args.fault, args.concurrency, args.warm_s, args.recover_timeout_s))
        import ray

        ray.shutdown()  # this process joined the app's cluster to read Serve's status
    body = table(headers, summarize(args.fault, run))
    body += (f"\n\nTwo replicas of {MODEL}, each an engine over 2 processes x 4 fake CPU devices (distributed_timeout_s 30, "
             f"health_check_period_s 2), {args.concurrency} clients in a closed loop of 16-token completions "
             f"(after an error a client waits 0.2 s). 'other': transport errors. The replaced replica starts a new "
             f"two-process group (load and compile) while the other replica serves.")
    record("Faults under load: one of two replicas loses its engine or its actor", body)


if __name__ == "__main__":
    main()
