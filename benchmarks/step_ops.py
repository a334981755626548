"""Where one decode step's program spends its time, op by op: the packed products, the attention
kernel and the small XLA programs between them.

Brings `--batch` requests of `--context`-token prompts to decoding, then runs that decode step's
programs (step and sampler, as the engine dispatches them, no host work between) `--steps` times
under JAX's profiler, with XLA:CPU's per-op trace events, and prints per kind of op (a custom
call by its kernel target, an XLA fusion by its kind) the calls and microseconds a step, beside
the step's wall time. The weights' bytes over the products' time says how close the products
run to the machine's read bandwidth (benchmarks/common.py memory_read_bandwidth, measured here
before the trace); what the rest takes is what keeps the step above its bandwidth floor.

The profiler's events cost a little each (a few tenths of a microsecond): the small XLA programs
read somewhat slower than they run untraced; the step's wall time is that of the traced run.
Prints only; nothing is recorded.

    python benchmarks/step_ops.py                                            # the demo GGUF, batch 1
    python benchmarks/step_ops.py --quantization none                        # its float32 weights
    python benchmarks/step_ops.py --batch 32 --kv-cache-dtype float16
    python benchmarks/step_ops.py --model path/to/model.gguf --quantization gguf --context 512
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import memory_read_bandwidth, table, weights_read  # noqa: E402

DEMO = "servax-demo/smollm2-135m-instruct"  # with quantization gguf: its GGUF file as stored


def decode_step(llm, batch: int, context: int):
    """A decode step of `batch` requests at about `context` tokens, as the engine would run it
    next: (run, programs' optimized HLO texts). `run()` runs the step and its sampler once."""
    import jax
    import numpy as np

    from app import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    programs, seen = runner.programs, {}
    dispatch = runner.dispatch

    def recording(sched, block_ids, prev=None):
        seen.update(sched=sched, block_ids=block_ids)
        return dispatch(sched, block_ids, prev)

    runner.dispatch = recording
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"ops-{i}", rng.integers(4, 500, context).tolist(), sp)
    while "sched" not in seen or seen["sched"].num_scheduled_tokens != batch:
        seen.clear()
        engine.step()
    sched, block_ids = seen["sched"], seen["block_ids"]
    runner.dispatch = dispatch
    t_pad, s_pad = programs.runnable_bucket(*engine.plan.step_bucket(sched.num_scheduled_tokens, sched.num_slots),
                                            False)
    inputs = programs.inputs.build(sched, block_ids, t_pad, s_pad, False, None)
    while engine.has_unfinished_requests():
        engine.step()

    def run():
        out = programs.run_sample(programs.run_step(inputs.batch), inputs.sampling, use_penalties=False)
        jax.block_until_ready(out.next_ids)

    texts = [p.compile().as_text() for p in programs.lower_step(inputs.batch)]
    return run, texts


def op_kinds(texts: list[str]) -> dict[str, str]:
    """Each instruction name of the programs' HLO: its custom call target, or its name less the
    numeric suffix (fusion kinds: "select_dynamic-update-slice_fusion", ...)."""
    kinds = {}
    for text in texts:
        for name, target in re.findall(r'%([\w.\-]+) = [^\n]*?custom_call_target="([^"]+)"', text):
            kinds[name] = target
    return kinds


def traced_ops(run, steps: int) -> tuple[list[float], list[dict]]:
    """Wall times (us) and the ops' trace events of `steps` traced runs."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 3  # XLA:CPU's per-op events
    with tempfile.TemporaryDirectory() as out:
        jax.profiler.start_trace(out, create_perfetto_trace=True, profiler_options=options)
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            run()
            walls.append((time.perf_counter() - t) * 1e6)
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(f"{out}/plugins/profile/*/perfetto_trace.json.gz")[0]) as f:
            trace = json.load(f)
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("ph") == "X"]
    return walls, [e for e in events if "hlo_op" in e.get("args", {})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEMO, help="a model ID (default the demo model)")
    parser.add_argument("--quantization", default=None, help="default gguf for the demo model and .gguf files; "
                        "none: the weights as the checkpoint holds them")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding in the step")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=20, help="traced runs of the step")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's (default its own; benchmarks/quantization.py runs with it at the batch)")
    args = parser.parse_args()

    from app import LLM

    quantization = args.quantization or ("gguf" if args.model == DEMO or args.model.endswith(".gguf") else None)
    seqs = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    llm = LLM(model=args.model, quantization=None if quantization == "none" else quantization, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False, show_progress=False, **seqs)
    if args.batch > llm.engine.config.max_num_seqs:
        parser.error(f"--batch {args.batch} exceeds the engine's max_num_seqs {llm.engine.config.max_num_seqs}")
    run, texts = decode_step(llm, args.batch, args.context)
    kinds = op_kinds(texts)
    for _ in range(10):
        run()
    bandwidth = memory_read_bandwidth(repeats=3)
    walls, ops = traced_ops(run, args.steps)
    step_us = statistics.median(walls)
    per_kind, calls = collections.defaultdict(float), collections.Counter()
    for e in ops:
        name = e["args"]["hlo_op"]
        kind = kinds.get(name, re.sub(r"\.\d+$", "", name))
        per_kind[kind] += e["dur"] / args.steps
        calls[kind] += 1
    rows = [[kind, calls[kind] // args.steps, f"{us:.1f}", f"{us / step_us:.2f}"]
            for kind, us in sorted(per_kind.items(), key=lambda kv: -kv[1])]
    busy = sum(per_kind.values())  # more than the wall time where ops ran side by side on the pool's threads
    if busy < step_us:
        rows.append(["(between ops)", "", f"{step_us - busy:.1f}", f"{(step_us - busy) / step_us:.2f}"])
    weights = weights_read(llm.engine.model.params)
    products = sum(us for kind, us in per_kind.items() if "matmul" in kind or "mlp_block" in kind)
    print(table(["op", "calls a step", "us a step", "share"], rows))
    read = f"read by the products at {weights / products / 1e3:.1f} GB/s" if products else "no packed products"
    print(f"\n{args.model}, batch {args.batch} (max_num_seqs {llm.engine.config.max_num_seqs}), ~{args.context} "
          f"tokens of context: the step's programs "
          f"{step_us:.0f} us a run (the median; step and sampler, dispatched from Python), the ops' {busy:.0f} us; "
          f"weights {weights / 1e6:.0f} MB, {read} (the machine: {bandwidth / 1e9:.1f} GB/s); "
          f"the bandwidth floor {weights / bandwidth * 1e6:.0f} us")


if __name__ == "__main__":
    main()
