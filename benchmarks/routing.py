"""Routing multi-turn chats over replicas: Serve's default router, servax's text-prefix router and
the KV-cache-aware router, side by side (and one replica, the hit rate's ideal).

Per router, one `serve run` (on a Ray cluster of this process) serves the model with
`--replicas` replicas: `pow2` (Serve's power-of-two choices, by load alone), `text`
(app.routing:PrefixCacheAffinityRouter, prompt text chunks it sent where), `kv`
(app.kv_routing:KVAwareRouter, the block hashes each replica's prefix cache holds), and `ideal`
(one replica: every turn finds its history if the cache keeps it). The workload: concurrent
conversations, each opening with its own document and asking questions about it turn after
turn, every turn resending the conversation so far (as chat clients do). Per router: the share
of prompt tokens found in the prefix cache (turns 2+, from the responses' cached_tokens), time
to first token (streamed), the wall time, and how the requests spread over the replicas.

    python benchmarks/routing.py [--replicas 2] [--chats 8] [--turns 4] [--routers pow2,text,kv,ideal]
    python benchmarks/routing.py --model servax-tiny/llama --doc-words 100 --max-model-len 1024   # quick
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

from benchmarks.common import record, serve_app_on_own_cluster, table  # noqa: E402

PORT = 8123
ROUTERS = {"pow2": None, "text": "app.routing:PrefixCacheAffinityRouter", "kv": "app.kv_routing:KVAwareRouter",
           "ideal": None}
LABELS = {"pow2": "Serve default (pow-2)", "text": "text prefix (servax)", "kv": "KV-aware (servax)",
          "ideal": "1 replica (ideal hit rate)"}
CONFIG = """
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
- name: routing
  route_prefix: /
  import_path: app.builder:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: chat, model_source: {model}}}
      engine_kwargs: {{max_model_len: {max_model_len}, max_num_seqs: 16, max_num_batched_tokens: 256,
                      show_progress: false}}
      deployment_config:
        num_replicas: {replicas}
        ray_actor_options: {{num_cpus: 0.25}}
{router}"""
WORDS = ("river stone cloud forest paper window garden silver market harbor engine letter bridge valley "
         "winter summer lantern mirror orchard castle meadow signal thunder canvas").split()


def documents(n: int, seed: int = 0, words: int = 220) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


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


async def workload(docs: list[str], turns: int) -> tuple[list, float]:
    from openai import AsyncOpenAI

    samples: list = []
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(chat(client, "chat", d, turns, samples) for d in docs))
        return samples, time.perf_counter() - t0


def ready(replicas: int) -> bool:
    """A completion is answered and every replica answers its routing stats."""
    import httpx

    return httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=30,
                      json={"model": "chat", "prompt": "hi", "max_tokens": 1}).status_code == 200 and (
        len(requests_per_replica()) == replicas)


def requests_per_replica() -> list[int]:
    """Requests each replica finished (its published routing stats, asked from its actor)."""
    import ray

    counts = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if "SERVE_REPLICA" in entry["name"] and "LLMServer:chat" in entry["name"]:
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            try:
                stats = ray.get(actor.record_routing_stats.remote(), timeout=30)
            except (ray.exceptions.RayError, ValueError):
                continue  # still starting (or restarting)
            counts.append(stats["servax_kv"]["num_requests_finished"])
    return sorted(counts, reverse=True)


def run_router(name: str, args: argparse.Namespace, folder: Path) -> tuple[list, float, float, list[int]]:
    router = ROUTERS[name]
    config = Path(folder) / f"routing-{name}.yaml"
    config.write_text(CONFIG.format(
        port=PORT, model=args.model, max_model_len=args.max_model_len,
        replicas=1 if name == "ideal" else args.replicas,
        router="" if router is None else (
            "        request_router_config:\n"
            f"          request_router_class: \"{router}\"\n"
            + ("          request_routing_stats_period_s: 1\n" if name == "kv" else ""))))
    replicas = 1 if name == "ideal" else args.replicas
    with serve_app_on_own_cluster(config, lambda: ready(replicas)) as ready_s:
        asyncio.run(workload(documents(2, seed=99, words=args.doc_words), 2))  # a settling round
        time.sleep(args.settle_s)  # the KV-aware router reads its tokenizer once the replicas publish
        before = requests_per_replica()
        samples, wall = asyncio.run(workload(documents(args.chats, seed=1, words=args.doc_words), args.turns))
        after = requests_per_replica()
    return samples, wall, ready_s, [a - b for a, b in zip(after, before)] if len(after) == len(before) else after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="servax-demo/smollm2-135m-instruct")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--chats", type=int, default=8, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=220, help="words of each conversation's document")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--routers", default="pow2,text,kv,ideal")
    parser.add_argument("--settle-s", type=float, default=15.0, help="idle seconds after the settling round")
    parser.add_argument("--no-record", action="store_true", help="print only (RESULTS.md untouched)")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.routers.split(","):
            samples, wall, ready_s, spread = run_router(name, args, Path(folder))
            later = [s for s in samples if s[0] > 0]
            hit = sum(s[3] for s in later) / sum(s[2] for s in later)
            ttft_later = sorted(s[1] * 1e3 for s in later)
            rows.append([LABELS[name], f"{hit:.2f}", f"{statistics.median(ttft_later):.0f}",
                         f"{ttft_later[int(0.9 * (len(ttft_later) - 1))]:.0f}", f"{wall:.1f}",
                         "/".join(map(str, spread)), f"{ready_s:.0f}"])
    body = (f"{args.model}, {args.replicas} replicas per router (own `serve run` each); {args.chats} concurrent "
            f"chats x {args.turns} turns, each opening with its own {args.doc_words}-word document and resending "
            "the conversation every turn; 16 new tokens per turn\n\n"
            + table(["router", "prefix hit rate (turns 2+)", "TTFT ms p50 (turns 2+)", "TTFT ms p90 (turns 2+)",
                     "workload s", "requests per replica", "ready s"], rows))
    title = f"Routing multi-turn chats: Serve's default, text-prefix and KV-aware routers ({args.replicas} replicas)"
    if args.no_record:
        print(f"\n## {title}\n\n{body}")
    else:
        record(title, body)


if __name__ == "__main__":
    main()
