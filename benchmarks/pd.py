"""Prefill/decode disaggregation (#44) against colocated serving, and a model of when P/D pays.

Part 1 (serving): the same streaming requests (greedy, EOS ignored) at 8 and 32 concurrent
streams, first against one colocated replica (`serve run`, one LLMServer answering HTTP), then
against a P/D app of 1 prefill + 1 decode replica (app/pd.py), each on its own Ray cluster so
the two never share the CPU. Reports throughput, TTFT and TPOT (median, p99).

On a 2-core machine this cannot show P/D's benefit: the prefill and the decode replica share
the same two cores, so a prefill still slows the decode steps running beside it (what P/D
removes is exactly that interference, which needs separate hardware), and the KV moves through
the object store on top. Part 2 therefore measures the parts here and scales them:

Part 2 (model): in-process engines measure a prefill step of a prompt of P tokens t_pre(P),
a decode step of B streams t_dec(B), and moving one request's KV (export + host copy + import,
without Ray's object store) t_move(P). With each stream replaced after O output tokens, a
colocated replica of B streams computes B prefills per O decode steps, so

    TPOT_colocated ~ t_dec(B) + B * t_pre(P) / O         TTFT ~ t_pre(P)
    TPOT_pd        ~ t_dec(B * N / N_d)                   TTFT ~ t_pre(P) + t_move(P) + t_dec

for N replicas split into N_p prefill + N_d decode replicas holding the same streams, each on
hardware of its own; the prefill side must keep up: N * B / O * t_pre(P) <= N_p (busy share).

    python benchmarks/pd.py                                  # tiny Llama, both parts
    python benchmarks/pd.py --model bench --skip-serving     # the model part on the ~100M Llama
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

from benchmarks.common import bench_checkpoint, machine, serve_app_on_own_cluster, table  # noqa: E402

PORT = 8127


def engine_kwargs(args) -> dict:
    return dict(dtype="float32", max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=256,
                num_kv_blocks=2048, show_progress=False)


def write_config(args, folder: str, pd: bool) -> Path:
    block = lambda: {"model_loading_config": {"model_id": "bench", "model_source": args.model},  # noqa: E731
                     "engine_kwargs": engine_kwargs(args),
                     "deployment_config": {"max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 1}}}
    app = ({"name": "bench", "route_prefix": "/", "import_path": "app.builder:build_pd_openai_app",
            "args": {"prefill_config": block(), "decode_config": block()}} if pd else
           {"name": "bench", "route_prefix": "/", "import_path": "app.builder:build_app",
            "args": {"llm_configs": [block()], "ingress_config": {"colocate": True}}})
    path = Path(folder) / ("pd.yaml" if pd else "colocated.yaml")
    path.write_text(yaml.safe_dump({"http_options": {"host": "127.0.0.1", "port": PORT}, "applications": [app]}))
    return path


def workload(n: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 500, size=prompt_len).tolist() for _ in range(n)]


async def run_http(prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def one(client, prompt):
        async with sem:
            t0 = time.perf_counter()
            first = None
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "stream": True, "ignore_eos": True}
            async with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                        first = first or time.perf_counter()
            end = time.perf_counter()
            return first - t0, (end - first) / max(max_tokens - 1, 1)

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - t0
    ttft, tpot = np.array([s[0] for s in samples]), np.array([s[1] for s in samples])
    return dict(tok_s=len(prompts) * max_tokens / wall, ttft_med=np.median(ttft) * 1e3,
                ttft_p99=np.percentile(ttft, 99) * 1e3, tpot_med=np.median(tpot) * 1e3,
                tpot_p99=np.percentile(tpot, 99) * 1e3)


def ready() -> bool:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions",
                   json={"model": "bench", "prompt": "hi", "max_tokens": 2}, timeout=30)
    return r.status_code == 200


def serving(args) -> str:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for pd in (False, True):
            with serve_app_on_own_cluster(write_config(args, folder, pd), ready):
                asyncio.run(run_http(workload(4, args.prompt_len, 4), 4, 4))  # warm the HTTP path
                for streams in (8, 32):
                    prompts = workload(args.requests_per_stream * streams, args.prompt_len, args.max_tokens, seed=streams)
                    r = asyncio.run(run_http(prompts, args.max_tokens, streams))
                    rows.append(["P/D 1+1" if pd else "colocated 1", streams, f"{r['tok_s']:.0f}",
                                 f"{r['ttft_med']:.0f}", f"{r['ttft_p99']:.0f}", f"{r['tpot_med']:.1f}",
                                 f"{r['tpot_p99']:.1f}"])
                    print(rows[-1], flush=True)
    return table(["deployment", "streams", "tok/s", "TTFT med ms", "TTFT p99 ms", "TPOT med ms", "TPOT p99 ms"],
                 rows)


def step_times(args) -> tuple[dict, dict, dict]:
    """In-process: t_pre(P) for each P, t_dec(B) for each B, t_move(P) (s)."""
    import jax

    from app import LLM
    from runtime import SamplingParams
    from runtime.engine.kv_transfer import ExportKV

    kw = dict(engine_kwargs(args), max_num_seqs=64, max_num_batched_tokens=1024, enable_prefix_caching=False)
    a = LLM(args.model, **kw)
    b = LLM(args.model, loaded_model=a.engine.model, **kw)
    src, dst = a.engine, b.engine
    src.enable_kv_transfer(), dst.enable_kv_transfer()
    rng = np.random.default_rng(1)

    def run(engine, rid, prompt, params, kv=None):
        processed = engine.process_inputs(rid, {"prompt_token_ids": prompt}, params)
        processed.kv_transfer = kv
        engine.add_processed(processed)
        while engine.has_unfinished_requests():
            engine.step()

    one = SamplingParams(max_tokens=1, temperature=0.0)
    t_pre, t_move = {}, {}
    for p in args.model_prompt_lens:
        times, moves = [], []
        for i in range(4):
            prompt = rng.integers(4, 500, size=p).tolist()
            t0 = time.perf_counter()
            run(src, f"pre{p}-{i}", prompt, one, ExportKV())
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            transfer = src.kv_transfer.take(f"pre{p}-{i}")
            processed = dst.process_inputs(f"dec{p}-{i}", {"prompt_token_ids": prompt}, one)
            processed.kv_transfer = transfer
            dst.add_processed(processed)
            dst.scheduler.schedule()  # admits it: the blocks are written
            jax.block_until_ready(dst.programs.kv_cache.k)
            moves.append(time.perf_counter() - t0)
            dst.abort_request(f"dec{p}-{i}")
        t_pre[p], t_move[p] = float(np.median(times[1:])), float(np.median(moves[1:]))
    t_dec = {}
    for batch in args.model_batches:
        prompts = [rng.integers(4, 500, size=64).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            src.add_request(f"dec-{batch}-{i}", {"prompt_token_ids": prompt}, params)
        steps = []
        while src.has_unfinished_requests():
            t0 = time.perf_counter()
            src.step()
            if src.scheduler.num_running == batch and all(r.num_output_tokens > 2 for r in src.scheduler.running):
                steps.append(time.perf_counter() - t0)
        t_dec[batch] = float(np.median(steps))
    a.shutdown(), b.shutdown()
    return t_pre, t_dec, t_move


def model_table(args, t_pre: dict, t_dec: dict, t_move: dict) -> str:
    """Predicted TPOT / TTFT with 32 streams per replica (the measured step times, each replica
    on hardware of its own): colocated against the P/D split of the same N replicas with the
    lowest TPOT whose prefill replicas keep up (busy < 90%), or the least busy split if none does."""
    rows = []
    b = 32
    batches = sorted(t_dec)
    dec = lambda n: float(np.interp(n, batches, [t_dec[k] for k in batches]))  # noqa: E731 (flat past the largest)
    for p in sorted(t_pre):
        for out in args.model_outputs:
            for n in (2, 8):
                colo_tpot = dec(b) + b * t_pre[p] / out
                splits = []
                for n_p in range(1, n):
                    tpot = dec(b * n / (n - n_p))
                    busy = n * b / (out * tpot) * t_pre[p] / n_p  # streams end every out * tpot s
                    splits.append((busy >= 0.9, tpot if busy < 0.9 else busy, n_p, tpot, busy))
                _, _, n_p, tpot, busy = min(splits)
                verdict = ("prefill cannot keep up" if busy >= 0.9 else
                           "P/D pays" if tpot < 0.9 * colo_tpot else "no gain")
                rows.append([p, out, n, f"{colo_tpot * 1e3:.0f}", f"{t_pre[p] * 1e3:.0f}", f"{n_p}+{n - n_p}",
                             f"{tpot * 1e3:.0f}", f"{(t_pre[p] + t_move[p] + tpot) * 1e3:.0f}", f"{busy:.0%}", verdict])
    return table(["prompt", "output", "replicas", "colocated TPOT ms", "colocated TTFT ms", "P/D split",
                  "P/D TPOT ms", "P/D TTFT ms", "prefill busy", "verdict"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="servax-tiny/llama", help="a model id or folder; 'bench': the ~100M "
                        "benchmark Llama (benchmarks/common.py)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--model-prompt-lens", type=int, nargs="+", default=[256, 768])
    parser.add_argument("--model-batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--model-outputs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--skip-serving", action="store_true")
    args = parser.parse_args()
    if args.model == "bench":
        args.model = str(bench_checkpoint())
    print(f"machine: {machine()}")
    if not args.skip_serving:
        print("\n## Serving, streaming, greedy (prompt %d tokens, %d out)\n" % (args.prompt_len, args.max_tokens))
        print(serving(args))
    t_pre, t_dec, t_move = step_times(args)
    print("\n## Measured here (in-process, one engine at a time)\n")
    print(table(["quantity", "value ms"],
                [[f"t_pre({p})", f"{v * 1e3:.1f}"] for p, v in t_pre.items()]
                + [[f"t_dec({b})", f"{v * 1e3:.2f}"] for b, v in t_dec.items()]
                + [[f"t_move({p})", f"{v * 1e3:.2f}"] for p, v in t_move.items()]))
    print("\n## Model: 32 streams per replica\n")
    print(model_table(args, t_pre, t_dec, t_move))


if __name__ == "__main__":
    main()
