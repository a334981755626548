"""One engine over two processes against one process with the same 8 devices.

The same ~100M-parameter random Llama (8 heads, so it splits 8 ways), tensor_parallel_size 8:
  * 1 process x 8 devices: one SPMD program, collectives inside the process;
  * 2 processes x 4 devices: runtime/engine/distributed.py, jax.distributed over gloo on 127.0.0.1,
    the leader sending each step's host inputs to the worker through Ray;
and, as the floor, 1 process x 1 device (no parallelism); also the time of one all-reduce of an
activation over the 8 devices in one and in two processes, the step's unit of communication. Each runs in a fresh process (the
device count is fixed when JAX starts). Per configuration: the median time of a compiled
decode step plus greedy sampling at 1 and 4 sequences (ModelRunner.step_seconds, dispatch to
tokens on the host), tokens/s of 4 requests x 64 greedy tokens, and the bytes the leader sent
per step. On fake CPU devices all 8 "devices" share this machine's cores: the figures show
the cost of the second process (Ray call, gloo over TCP), not a speed-up.

    python benchmarks/multiprocess.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_checkpoint, record, table  # noqa: E402

CONFIGS = [  # (label, devices per process, tensor_parallel_size)
    ("1 process x 1 device", 1, 1),
    ("1 process x 8 devices", 8, 8),
    ("2 processes x 4 devices", 4, 8),
]
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=128,
              show_progress=False)


def child(spec: dict) -> dict:
    import numpy as np
    import ray

    from app.llm import LLM
    from runtime import SamplingParams

    if spec["tp"] > spec["local"]:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    llm = LLM(spec["model"], tensor_parallel_size=spec["tp"], **ENGINE)
    startup = time.perf_counter() - t0
    programs = llm.engine.programs
    step_ms = {n: 1e3 * float(np.median([programs.step_seconds(n, repeats=1) for _ in range(spec["repeats"])]))
               for n in (1, 4)}
    prompts = [[(7 * i + j) % 500 + 4 for j in range(32)] for i in range(4)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.engine.stats()
    steps = (after.distributed_calls - before.distributed_calls) // 2  # a step and a sampler call each
    result = dict(startup_s=startup, step_ms=step_ms, tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
                  tokens=[o.outputs[0].token_ids for o in outs],
                  bytes_per_step=(after.distributed_bytes_sent - before.distributed_bytes_sent) / steps if steps else 0)
    llm.shutdown()
    return result


def allreduce_child(spec: dict) -> dict:
    """Median time of one all-reduce of a [8, 768] float32 activation over the 8 devices: what each
    row-parallel layer (attention output, MLP down) ends with, twice per decoder layer."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    if spec["processes"] > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{spec['port']}", num_processes=spec["processes"],
                                   process_id=spec["process_id"])
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = NamedSharding(mesh, P("model"))
    x = jax.make_array_from_callback((8, 768), sharded, lambda idx: np.ones((8, 768), np.float32)[idx])
    total = jax.jit(lambda x: jnp.broadcast_to(x.sum(0), x.shape), out_shardings=sharded)
    total(x).block_until_ready()
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return dict(ms=1e3 * float(np.median(times)))


def allreduce_ms(local: int) -> float:
    """all-reduce time with 8 devices in 8 // local processes (started here, joined directly)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = 8 // local
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={local}", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, "--allreduce", json.dumps(dict(
        processes=processes, process_id=i, port=port))], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True) for i in range(processes)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--allreduce", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.allreduce:
        print(json.dumps(allreduce_child(json.loads(args.allreduce))), flush=True)
        return
    model = bench_checkpoint("llama", num_attention_heads=8, num_key_value_heads=8)
    rows, results = [], []
    for label, local, tp in CONFIGS:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={local}", JAX_PLATFORMS="cpu",
                   PYTHONPATH=str(ROOT))
        spec = dict(model=str(model), local=local, tp=tp, repeats=args.repeats)
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            sys.exit(f"{label} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        reduce = f"{allreduce_ms(local):.2f}" if tp == 8 else "-"
        rows.append([label, reduce, f"{r['step_ms']['1']:.1f}", f"{r['step_ms']['4']:.1f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['bytes_per_step'] / 1024:.1f} KiB" if r["bytes_per_step"] else "-", f"{r['startup_s']:.0f}"])
        print(rows[-1], flush=True)
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    body = table(["engine (tensor_parallel_size 8 unless 1 device)", "one all-reduce (ms)", "decode step, 1 seq (ms)",
                  "decode step, 4 seqs (ms)", "tokens/s (4 x 64 greedy)", "sent per step by the leader",
                  "startup (s)"], rows)
    body += (f"\n\nModel: random Llama, hidden 768, 12 layers, 8 heads (~100M parameters), float32. "
             f"Greedy tokens identical across the three: {same}. The step and the sampler are two Ray calls "
             f"to the worker per step; their NumPy payload is the bytes column. A step has two all-reduces per decoder "
             f"layer (24 here) plus those of the embedding and the logits: between processes each goes over gloo/TCP, which is what the 2-process step time is "
             f"made of on CPU; on accelerators they go over ICI/NCCL.")
    record("One engine over two processes (jax.distributed) vs one process, same 8 devices", body)


if __name__ == "__main__":
    main()
