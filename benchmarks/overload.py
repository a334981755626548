"""Overload: past the engine's queue, 429 at once, and admitted requests keep their latency.

`serve run` of the demo model with room for `--max-num-seqs` running and `--max-queue-size`
waiting requests. First a baseline wave that fits (as many requests as can run at once), then
a flood of `--flood` concurrent requests. Per wave: how many were answered 200 and 429, the
latency of the 429s (they must come back at once, not after a wait), and the end-to-end
latency of the admitted requests against the baseline's. Last, with the server full (running
and queue), `--probes` requests one after another: how long one refusal takes when it does
not queue behind a burst of others; then a flood of `--flood` requests naming a model that does
not exist, answered 404 by the ingress without reaching a replica: what the HTTP proxy and the
ingress alone take for such a burst on this machine (the floor under the flood's 429s).

    python benchmarks/overload.py [--flood 128]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, serve_app, table  # noqa: E402

PORT = 8124
CONFIG = """
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
- name: overload
  route_prefix: /
  import_path: app.builder:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: demo, model_source: servax-demo/smollm2-135m-instruct}}
      engine_kwargs: {{max_model_len: 1024, max_num_seqs: {seqs}, max_num_batched_tokens: 256,
                      max_queue_size: {queue}, show_progress: false}}
      deployment_config: {deployment}
"""


async def wave(n: int, max_tokens: int) -> list[tuple[int, float]]:
    """n concurrent completions: (status, seconds) each."""
    import httpx

    async def one(client, i):
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json={"model": "demo", "prompt": f"Story number {i}:",
                                                       "max_tokens": max_tokens, "ignore_eos": True})
        return r.status_code, time.perf_counter() - t0

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=600,
                                 limits=httpx.Limits(max_connections=n + 8)) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


async def probes(running: int, queued: int, fill_tokens: int, n: int, flood: int
                 ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """`running` then `queued` long requests to fill the server, then, while they run, `n`
    requests one at a time and a flood of `flood` requests for an unknown model."""
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=600,
                                 limits=httpx.Limits(max_connections=running + queued + flood + 8)) as client:
        body = {"model": "demo", "prompt": "Fill:", "max_tokens": fill_tokens, "ignore_eos": True}
        filling = []
        for count in (running, queued):  # the first ones start running before the others queue
            filling += [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(count)]
            await asyncio.sleep(2.0)
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json={"model": "demo", "prompt": f"Probe {i}:", "max_tokens": 4})
            out.append((r.status_code, time.perf_counter() - t0))
            await asyncio.sleep(0.05)

        async def unknown(i):
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json={"model": "nope", "prompt": f"Story {i}:", "max_tokens": 4})
            return r.status_code, time.perf_counter() - t0

        floor = await asyncio.gather(*(unknown(i) for i in range(flood)))
        assert not any(t.done() for t in filling), "a fill request ended before the probes (refused, or too short)"
        assert all(r.status_code == 200 for r in await asyncio.gather(*filling))
        return out, floor


def ready() -> bool:
    import httpx

    return httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=30,
                      json={"model": "demo", "prompt": "hi", "max_tokens": 1}).status_code == 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queue-size", type=int, default=8)
    parser.add_argument("--flood", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--serve-queue", type=int, default=None,
                        help="max_queued_requests of the deployment, with max_ongoing_requests = max_num_seqs")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "overload.yaml"
        # With --serve-queue, Serve's router (in the ingress) holds what the engine would queue and
        # refuses beyond it, before the request reaches the replica.
        deployment = ("{}" if args.serve_queue is None else
                      f"{{max_ongoing_requests: {args.max_num_seqs}, max_queued_requests: {args.serve_queue}}}")
        config.write_text(CONFIG.format(port=PORT, seqs=args.max_num_seqs, queue=args.max_queue_size,
                                        deployment=deployment))
        with serve_app(config, ready) as ready_s:
            asyncio.run(wave(args.max_num_seqs, 4))  # settle
            waves = {"baseline (fits)": asyncio.run(wave(args.max_num_seqs, args.max_tokens)),
                     f"flood of {args.flood}": asyncio.run(wave(args.flood, args.max_tokens))}
            queued = args.max_queue_size if args.serve_queue is None else args.serve_queue
            one_by_one, floor = asyncio.run(probes(args.max_num_seqs, queued, 300, args.probes, args.flood))
            waves[f"{args.probes} one at a time, server full"] = one_by_one
            waves[f"flood of {args.flood}, unknown model (404), server full"] = floor

    rows = []
    for name, results in waves.items():
        ok = sorted(s for status, s in results if status == 200)
        refused = sorted(s for status, s in results if status in (429, 404))
        other = [status for status, _ in results if status not in (200, 429, 404)]
        pct = lambda xs, q: f"{xs[int(q * (len(xs) - 1))] * 1e3:.0f}" if xs else "-"  # noqa: E731
        rows.append([name, len(results), len(ok), len(refused), len(other), pct(refused, 0.5), pct(refused, 0.99),
                     f"{statistics.median(ok) * 1e3:.0f}" if ok else "-", pct(ok, 0.99)])
    limits = (f"max_queue_size={args.max_queue_size}" if args.serve_queue is None else
              f"deployment max_ongoing_requests={args.max_num_seqs}, max_queued_requests={args.serve_queue}")
    body = (f"`serve run` to ready: {ready_s:.0f} s; SmolLM2-135M-Instruct, max_num_seqs={args.max_num_seqs}, "
            f"{limits}, {args.max_tokens} tokens per request, all sent at once\n\n"
            + table(["wave", "requests", "200", "429 (404)", "other", "refusal ms p50", "refusal ms p99",
                     "200 e2e ms p50",
                     "200 e2e ms p99"], rows))
    record("Overload: 429 at once past the queue, admitted latency held (demo model)", body)


if __name__ == "__main__":
    main()
