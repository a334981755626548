"""Autoscaling on ongoing requests: Serve adds a replica under load and removes it after.

`serve run` of the tiny model with `deployment_config.autoscaling_config` (min 1, max 2
replicas, target_ongoing_requests 2, short delays). Clients keep `--concurrency` requests in
flight for `--load-s` seconds, then stop. Printed: when Serve ran two replicas (read from
Serve's status each second), tokens/s with one and with two replicas, and when it went back
to one replica after the load ended.

    python benchmarks/autoscale.py [--concurrency 8] [--load-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, running_replicas, serve_app, table  # noqa: E402

PORT = 8126
MODEL = "servax-tiny/llama"
CONFIG = f"""
http_options: {{host: 127.0.0.1, port: {PORT}}}
applications:
- name: autoscale
  route_prefix: /
  import_path: app.builder:build_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: {MODEL}}}
      engine_kwargs: {{model_impl: jax, max_model_len: 256, max_num_seqs: 4, max_num_batched_tokens: 64,
                      num_kv_blocks: 256, show_progress: false}}
      deployment_config:
        max_ongoing_requests: 8
        ray_actor_options: {{num_cpus: 0.5}}
        autoscaling_config: {{min_replicas: 1, max_replicas: 2, target_ongoing_requests: 2,
                             upscale_delay_s: 2, downscale_delay_s: 10, metrics_interval_s: 1,
                             look_back_period_s: 2}}
"""
BODY = dict(model=MODEL, prompt="Hello world", max_tokens=64, temperature=0, ignore_eos=True)


async def run(concurrency: int, load_s: float, settle_s: float) -> dict:
    import httpx

    done: list[tuple[float, int]] = []
    replicas: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def client(http) -> None:
        while not stop.is_set():
            r = await http.post("/v1/completions", json=BODY, timeout=120)
            done.append((time.perf_counter(), r.status_code))

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}") as http:
        clients = [asyncio.create_task(client(http)) for _ in range(concurrency)]
        while time.perf_counter() - start < load_s:
            replicas.append((time.perf_counter() - start, await asyncio.to_thread(running_replicas)))
            await asyncio.sleep(1)
        stop.set()
        await asyncio.gather(*clients)
    load_end = time.perf_counter() - start
    while time.perf_counter() - start < load_end + settle_s:
        n = await asyncio.to_thread(running_replicas)
        replicas.append((time.perf_counter() - start, n))
        if n == 1:
            break
        await asyncio.sleep(1)
    return dict(start=start, load_end=load_end, done=done, replicas=replicas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--load-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=120.0)
    args = parser.parse_args()
    import httpx
    import ray

    def ready() -> bool:
        return httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=BODY, timeout=30).status_code == 200

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "autoscale.yaml"
        config.write_text(CONFIG)
        with serve_app(config, ready):
            out = asyncio.run(run(args.concurrency, args.load_s, args.settle_s))
            ray.shutdown()
    up = next((t for t, n in out["replicas"] if n == 2), None)
    down = next((t for t, n in out["replicas"] if t > out["load_end"] and n == 1), None)
    statuses = sorted({s for _, s in out["done"]})

    def rate(lo: float, hi: float) -> str:
        n = sum(1 for t, s in out["done"] if s == 200 and lo <= t - out["start"] < hi)
        return f"{n * BODY['max_tokens'] / max(hi - lo, 1e-9):.0f}" if hi > lo else "-"

    rows = [["1 replica (load starts)", "0.0", rate(0, up or out["load_end"])],
            ["2 replicas running", f"{up:.1f}" if up else "never", rate(up, out["load_end"]) if up else "-"],
            ["load ends", f"{out['load_end']:.1f}", ""],
            ["back to 1 replica", f"{down:.1f}" if down else "not within the limit", ""]]
    body = table(["phase", "at (s from load start)", "generated tokens/s"], rows)
    body += (f"\n\n{MODEL}, {args.concurrency} clients in a closed loop of 64-token completions; autoscaling_config "
             f"min 1 / max 2 replicas, target_ongoing_requests 2, upscale_delay_s 2, downscale_delay_s 10. "
             f"Statuses seen: {statuses}. On 2 cores both replicas share the same cores, so a second replica adds "
             f"batch slots, not compute.")
    record("Autoscaling on ongoing requests (Serve autoscaling_config)", body)


if __name__ == "__main__":
    main()
