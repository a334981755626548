"""Where an engine run spends its time: workload 1 step by step, grouped by bucket.

Drives `LLMEngine.step()` over the throughput workload (64 greedy requests on the ~100M
Llama) and prints, per (tokens, sequences) bucket, how many steps ran and how long they
took (host work included). Prints only; nothing is recorded.

    python benchmarks/engine_profile.py
    python benchmarks/engine_profile.py --impl torchax --max-num-seqs 16
    python benchmarks/engine_profile.py --model servax-demo/smollm2-135m-instruct   # peers.py's workload
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_checkpoint, table, workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="jax")
    parser.add_argument("--model", default=None, help="default: the ~100M benchmark Llama and workload 1; "
                        "a model ID runs peers.py's realistic workload on it")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 (the weights' and KV cache's dtype)")
    parser.add_argument("--no-async-scheduling", action="store_true", help="step synchronously")
    args = parser.parse_args()

    from app import LLM, SamplingParams

    llm = LLM(
        model=args.model or str(bench_checkpoint()), model_impl=args.impl, dtype=args.dtype,
        max_model_len=1024 if args.model else 512,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        show_progress=False, async_scheduling=False if args.no_async_scheduling else None,
    )
    engine, runner = llm.engine, llm.engine.runner
    buckets: list[tuple[int, int]] = []
    dispatch = runner.dispatch

    def recording_dispatch(sched, block_ids, prev=None):
        buckets.append(engine.plan.step_bucket(sched.num_scheduled_tokens, sched.num_slots))
        return dispatch(sched, block_ids, prev)

    runner.dispatch = recording_dispatch
    if args.model:
        from benchmarks.peers import realistic_workload

        prompts, max_tokens = realistic_workload(engine.model.vocab_size)
    else:
        prompts, max_tokens = workload(64)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    times = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    # The engine is pipelined: call k waits for step k (dispatched by the call before it, or
    # by itself the first time), then dispatches step k+1; so call k's time is step k's.
    per = collections.defaultdict(lambda: [0, 0.0])
    for bucket, dt in zip(buckets, times):
        per[bucket][0] += 1
        per[bucket][1] += dt
    rows = [[f"{b}", n, f"{s:.1f}", f"{s / n * 1e3:.0f}"]
            for b, (n, s) in sorted(per.items(), key=lambda kv: -kv[1][1])]
    print(f"{sum(max_tokens)} output tokens in {total:.1f} s ({sum(max_tokens) / total:.1f} tok/s), "
          f"{len(times)} steps, impl={args.impl}\n")
    print(table(["bucket (tokens, seqs)", "steps", "seconds", "ms/step"], rows))


if __name__ == "__main__":
    main()
