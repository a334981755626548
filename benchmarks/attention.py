"""The C++ paged attention alone (runtime/ops/attention_cpu.py) at decode: time per layer by cache dtype.

Decodes of `--batches` sequences, each over `--contexts` tokens of cached context, the demo
model's heads (9 query heads over 3 KV heads of 64 dims) in blocks of 16 laid over the cache
as `--layouts` says: shuffled; ascending (each sequence's blocks one after another, as a fresh
engine hands them out); descending (as blocks a finished request freed are handed out again).
Each program attends through every layer of a 30-layer stacked cache (so the context is read
from memory, not the caches of the CPU), best of 5 runs; beside each time, the context's bytes
read a layer and the rate they were read at.

    python benchmarks/attention.py
    python benchmarks/attention.py --dtypes float32,bfloat16,float16,int8 --contexts 256,2048 --batches 1,8
    python benchmarks/attention.py --layouts shuffled,ascending,descending --batches 8,32 --contexts 160,512
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks.common import record, table  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="cache dtypes: float32, bfloat16, float16, int8")
    parser.add_argument("--contexts", default="64,512,1024")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--layouts", default="shuffled", help="where each sequence's blocks lie: shuffled, "
                        "ascending, descending")
    args = parser.parse_args()
    unknown = set(args.layouts.split(",")) - {"shuffled", "ascending", "descending"}
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}: shuffled, ascending, descending")

    import jax.numpy as jnp

    from runtime.ops.cpu_kernels import kernel_status

    status = kernel_status("paged_attention")
    if status != "ok":
        raise SystemExit(f"the CPU attention kernel is not available: {status}")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for context in [int(c) for c in args.contexts.split(",")]:
            for layout in args.layouts.split(","):
                for dtype in args.dtypes.split(","):
                    seconds = _per_layer(batch, context, dtype, layout)
                    stored = jnp.dtype(jnp.int8 if dtype == "int8" else dtype).itemsize
                    read = 2 * batch * context * KV_HEADS * (HEAD_DIM * stored + (4 if dtype == "int8" else 0))
                    rows.append([batch, context, layout, dtype, f"{seconds * 1e6:.1f}", f"{read / 1e6:.3f}",
                                 f"{read / seconds / 1e9:.1f}"])
    body = (f"{HEADS} query heads over {KV_HEADS} KV heads of {HEAD_DIM}, blocks of {BLOCK}, {LAYERS} layers a "
            "program; best of 5\n\n"
            + table(["batch", "context", "blocks", "cache", "us a layer", "KV read MB a layer", "GB/s"], rows))
    record("CPU attention at decode, by cache dtype", body)


def _per_layer(batch: int, context: int, dtype: str, layout: str = "shuffled") -> float:
    """Seconds a layer of `batch` decodes over `context` cached tokens takes, cache in `dtype`,
    blocks laid out as `layout` says (shuffled, ascending, descending)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from runtime.ops.attention_common import quantize_kv
    from runtime.ops.attention_cpu import cpu_ragged_paged_attention
    from test_attention import build_batch

    rng = np.random.default_rng(0)
    blocks = batch * (context // BLOCK + 2) + 8
    step, _, _ = build_batch(rng, [(context - 1, 1)] * batch, block_size=BLOCK, num_blocks=blocks,
                             max_blocks=context // BLOCK + 2, pad_tokens=batch, pad_seqs=batch, layout=layout)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, HEAD_DIM)), jnp.float32)
    shape = (LAYERS, blocks, KV_HEADS, BLOCK, HEAD_DIM)
    scales = {}
    if dtype == "int8":
        (k, k_scale), (v, v_scale) = (quantize_kv(jnp.asarray(rng.standard_normal(shape), jnp.float32), jnp.int8)
                                      for _ in range(2))
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    else:
        k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))

    def attend(q, k, v, batch_input, scales):
        out = q
        for layer in range(LAYERS):
            out = cpu_ragged_paged_attention(out, k, v, layer, batch_input, scale=0.125, **scales)
        return out

    run = jax.jit(attend)
    run(q, k, v, step, scales).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            out = run(q, k, v, step, scales)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / 10)
    return best / LAYERS


if __name__ == "__main__":
    main()
