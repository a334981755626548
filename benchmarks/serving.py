"""Serving overhead: streaming over HTTP (`serve run`) against the engine called directly.

The same requests (greedy, EOS ignored) at concurrency 1, 8 and 32, first through the
OpenAI-compatible endpoint of `serve run <config>` with streaming, then through
`AsyncLLMEngine.generate` in this process (after the server is stopped, so the two
never share the CPU). Reports throughput, time to first token and time per output
token (median and p99) for both, and HTTP/direct throughput.

    python benchmarks/serving.py                       # ~100M benchmark Llama
    python benchmarks/serving.py --model servax-tiny/llama --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_checkpoint, record, serve_app, table, workload  # noqa: E402

PORT = 8123


def engine_kwargs(args) -> dict:
    return dict(
        model_impl=args.impl, dtype="float32", max_model_len=512, max_num_seqs=32,
        max_num_batched_tokens=512, show_progress=False,
    )


def write_config(model: str, args, folder: str) -> Path:
    config = {
        "http_options": {"host": "127.0.0.1", "port": PORT},
        "applications": [{
            "name": "bench", "route_prefix": "/", "import_path": "app.builder:build_app",
            "args": {"llm_configs": [{
                "model_loading_config": {"model_id": "bench", "model_source": model},
                "engine_kwargs": engine_kwargs(args),
                "deployment_config": {"max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 1}},
            }]},
        }],
    }
    path = Path(folder) / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def summarize(samples: list[tuple[float, float, int]], wall: float) -> dict:
    """samples: (ttft s, tpot s, output tokens) per request."""
    ttft = np.array([s[0] for s in samples])
    tpot = np.array([s[1] for s in samples])
    tokens = sum(s[2] for s in samples)
    return dict(
        tok_s=tokens / wall, ttft_med=np.median(ttft) * 1e3, ttft_p99=np.percentile(ttft, 99) * 1e3,
        tpot_med=np.median(tpot) * 1e3, tpot_p99=np.percentile(tpot, 99) * 1e3,
    )


async def run_http(prompts, max_tokens, concurrency) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def one(client, prompt, n):
        async with sem:
            t0 = time.perf_counter()
            first, count = None, 0
            body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                    "stream": True, "ignore_eos": True}
            async with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        first = first or time.perf_counter()
                        count += 1
            end = time.perf_counter()
            assert count > 0, "the stream carried no tokens"
            # ignore_eos makes every request produce exactly n tokens, however they are chunked.
            return first - t0, (end - first) / max(n - 1, 1), n

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, max_tokens)))
        return summarize(samples, time.perf_counter() - t0)


async def run_direct(engine, prompts, max_tokens, concurrency) -> dict:
    from runtime import SamplingParams

    sem = asyncio.Semaphore(concurrency)

    async def one(i, prompt, n):
        async with sem:
            t0 = time.perf_counter()
            first = None
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            async for out in engine.generate(prompt, sp, request_id=f"direct-{concurrency}-{i}"):
                if out.outputs[0].token_ids:
                    first = first or time.perf_counter()
            end = time.perf_counter()
            return first - t0, (end - first) / max(n - 1, 1), n

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))))
    return summarize(samples, time.perf_counter() - t0)


def ready() -> bool:
    import httpx

    return httpx.get(f"http://127.0.0.1:{PORT}/v1/models", timeout=2).status_code == 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the ~100M benchmark Llama")
    parser.add_argument("--impl", default="jax")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(bench_checkpoint())
    levels = [int(c) for c in args.concurrency.split(",")]
    all_prompts, _ = workload(64)

    def requests_for(c):
        n = max(8, 2 * c)
        return [p[:128] for p in all_prompts[:n]], [args.max_tokens] * n

    http, direct = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        config = write_config(model, args, folder)
        with serve_app(config, ready, timeout_s=600) as ready_s:
            asyncio.run(run_http(*requests_for(1), 1))  # first request settles the server
            for c in levels:
                http[c] = asyncio.run(run_http(*requests_for(c), c))

    from app.llm import load_model
    from runtime import AsyncLLMEngine, EngineConfig

    async def direct_all():
        config = EngineConfig(model=model, **engine_kwargs(args))
        engine = AsyncLLMEngine(config, load_model(config))
        try:
            await run_direct(engine, *requests_for(1), 1)
            for c in levels:
                direct[c] = await run_direct(engine, *requests_for(c), c)
        finally:
            engine.shutdown()

    asyncio.run(direct_all())

    rows = []
    for c in levels:
        for name, r in (("HTTP stream", http[c]), ("direct", direct[c])):
            rows.append([c, name, f"{r['tok_s']:.1f}", f"{r['ttft_med']:.0f}", f"{r['ttft_p99']:.0f}",
                         f"{r['tpot_med']:.1f}", f"{r['tpot_p99']:.1f}"])
        rows.append([c, "HTTP / direct", f"{http[c]['tok_s'] / direct[c]['tok_s']:.2f}", "", "", "", ""])
    body = (
        f"`serve run` to ready: {ready_s:.1f} s; {args.max_tokens} tokens per request, "
        f"max(8, 2 x concurrency) requests per level\n\n"
        + table(["concurrency", "path", "tokens/s", "TTFT ms p50", "TTFT ms p99", "TPOT ms p50", "TPOT ms p99"], rows)
    )
    record(f"Serving overhead: HTTP streaming vs direct engine ({Path(model).name})", body)


if __name__ == "__main__":
    main()
