"""The sampler program alone: milliseconds per call on [rows, vocab] logits, per setting.

Greedy, temperature, temperature + top-p, temperature + top-k + top-p, on the demo model's
vocabulary (49152) at 32 rows, float32, compiled once each (compile seconds shown too); the
top-k / top-p cut both ways: the XLA bisection and the C++ kernel (XLA:CPU, one device: what
serving uses there), side by side.

    python benchmarks/sampler.py
    python benchmarks/sampler.py --rows 8 --vocab 151936
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, table  # noqa: E402

SETTINGS = {
    "greedy": {},
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50, top_p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "temperature 0.7, min_p 0.05": dict(temperature=0.7, min_p=0.05),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import jax

    from runtime.ops.cpu_kernels import kernel_status
    from runtime.engine.sampler import SamplingBatch, empty_sampling_batch, sample

    kernel = jax.default_backend() == "cpu" and kernel_status("truncation") == "ok"
    logits = np.random.default_rng(0).normal(size=(args.rows, args.vocab)).astype(np.float32) * 3
    jitted = jax.jit(sample, static_argnames=("num_logprobs", "use_penalties", "cpu_kernel"))

    def timed(batch, **static) -> tuple[float, float]:
        t0 = time.perf_counter()
        compiled = jitted.lower(logits, batch, **static).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(logits, batch))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(logits, batch))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3, compile_s

    rows = []
    for name, settings in SETTINGS.items():
        b = empty_sampling_batch(args.rows, 1)
        for key, value in settings.items():
            b[key][...] = value
        b["seeds"][...] = np.arange(args.rows)
        batch = SamplingBatch(**b)
        static = dict(num_logprobs=1, use_penalties=False)
        ms, compile_s = timed(batch, **static)
        row = [name, f"{ms:.1f}", f"{compile_s:.2f}"]
        if kernel:
            ms_k, _ = timed(batch, **static, cpu_kernel=True)
            row += [f"{ms_k:.1f}", f"{ms / ms_k:.1f}x"]
        else:
            row += ["-", "-"]
        rows.append(row)
    note = "" if kernel else f"\n\n- C++ kernel not measured: {kernel_status('truncation') if jax.default_backend() == 'cpu' else 'not XLA:CPU'}"
    record(f"Sampler program, [{args.rows}, {args.vocab}] float32 logits",
           table(["setting", "ms per call (median), XLA cut", "compile s", "ms, C++ kernel cut", "kernel speedup"],
                 rows) + note)


if __name__ == "__main__":
    main()
