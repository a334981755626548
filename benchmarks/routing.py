"""Prefix-aware routing against Serve's default router: multi-turn chats on two replicas.

One `serve run` app serves the demo model twice, two replicas each: `affinity` behind
app.routing:PrefixCacheAffinityRouter, `default` behind Serve's power-of-two-choices router.
The workload: concurrent conversations, each opening with its own document (~300 tokens)
and asking questions about it turn after turn, every turn resending the conversation so far
(as chat clients do). Per router: the share of prompt tokens found in the prefix cache
(turns 2+, from the responses' cached_tokens), time to first token (streamed) and the
wall time of the whole workload.

    python benchmarks/routing.py [--chats 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, serve_app, table  # noqa: E402

PORT = 8123
CONFIG = """
proxy_location: EveryNode
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
- name: routing
  route_prefix: /
  import_path: app.builder:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: affinity, model_source: servax-demo/smollm2-135m-instruct}}
      engine_kwargs: &engine {{max_model_len: 2048, max_num_seqs: 16, max_num_batched_tokens: 256,
                              show_progress: false}}
      deployment_config:
        num_replicas: 2
        ray_actor_options: {{num_cpus: 0.25}}
        request_router_config: {{request_router_class: "app.routing:PrefixCacheAffinityRouter"}}
    - model_loading_config: {{model_id: default, model_source: servax-demo/smollm2-135m-instruct}}
      engine_kwargs: *engine
      deployment_config: {{num_replicas: 2, ray_actor_options: {{num_cpus: 0.25}}}}
"""
WORDS = ("river stone cloud forest paper window garden silver market harbor engine letter bridge valley "
         "winter summer lantern mirror orchard castle meadow signal thunder canvas").split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(220)) for _ in range(n)]


async def chat(client, model: str, document: str, turns: int, samples: list) -> None:
    """One conversation: `turns` questions, each resending the history; (turn, ttft, prompt, cached)."""
    messages = [{"role": "system", "content": f"Answer questions about this text:\n{document}"}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn + 1}: which words appear most often?"})
        t0 = time.perf_counter()
        ttft, reply, usage = None, "", None
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.choices:
                reply += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        messages.append({"role": "assistant", "content": reply})
        samples.append((turn, ttft or time.perf_counter() - t0, usage.prompt_tokens,
                        usage.prompt_tokens_details.cached_tokens))


async def workload(model: str, docs: list[str], turns: int) -> tuple[list, float]:
    from openai import AsyncOpenAI

    samples: list = []
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(chat(client, model, d, turns, samples) for d in docs))
        return samples, time.perf_counter() - t0


def ready() -> bool:
    import httpx

    return all(httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=30,
                          json={"model": m, "prompt": "hi", "max_tokens": 1}).status_code == 200
               for m in ("affinity", "default"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=8, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "routing.yaml"
        config.write_text(CONFIG.format(port=PORT))
        with serve_app(config, ready) as ready_s:
            for model in ("affinity", "default"):  # a settling round each, on other documents
                asyncio.run(workload(model, documents(2, seed=99), 2))
            for i, model in enumerate(("affinity", "default")):
                results[model] = asyncio.run(workload(model, documents(args.chats, seed=i), args.turns))

    rows = []
    for model, (samples, wall) in results.items():
        later = [s for s in samples if s[0] > 0]
        hit = sum(s[3] for s in later) / sum(s[2] for s in later)
        ttft_later = sorted(s[1] * 1e3 for s in later)
        rows.append([{"affinity": "prefix-aware (servax)", "default": "Serve default (pow-2)"}[model],
                     f"{hit:.2f}", f"{statistics.median(ttft_later):.0f}",
                     f"{ttft_later[int(0.9 * (len(ttft_later) - 1))]:.0f}", f"{wall:.1f}"])
    body = (f"`serve run` to ready: {ready_s:.0f} s; SmolLM2-135M-Instruct, 2 replicas per router; {args.chats} "
            f"concurrent chats x {args.turns} turns, each opening with its own ~300-token document and resending "
            "the conversation every turn; 16 new tokens per turn\n\n"
            + table(["router", "prefix hit rate (turns 2+)", "TTFT ms p50 (turns 2+)", "TTFT ms p90 (turns 2+)",
                     "workload s"], rows))
    record("Prefix-aware routing vs Serve's default router (multi-turn chat, 2 replicas)", body)


if __name__ == "__main__":
    main()
