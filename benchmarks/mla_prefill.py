"""Multi-head latent attention's prefill forms, absorbed against expanded, per attention backend
(#41): one layer's attention (query absorption, paged attention, W_UV) of a prefill chunk of P
tokens after C cached context tokens, at DeepSeek-V2-Lite's dims (16 heads, kv_lora_rank 512,
rope 64, nope 128, v 128), through models_jax.mla.latent_attention with the cache's
mla_prefill forced either way (on the cpu backend with W_UK and W_UV packed head-major, as the
model's packed layers keep them). Times are the best of a few repetitions; on a shared machine
compare the two forms within one run.

    python benchmarks/mla_prefill.py [--backends cpu xla] [--chunks 128 256 512] [--contexts 512 1024 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models_jax.mla import latent_attention  # noqa: E402
from runtime.ops.matmul import PackedExperts, packed_matmul_available  # noqa: E402
from runtime.ops.step import KVCacheSpec, allocate_kv_cache, make_step_input  # noqa: E402

HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128
BLOCK = 16


def prefill_chunk(chunk: int, context: int, seqs: int = 8):
    """A step of one prefill chunk (positions context .. context + chunk - 1) in sequence slot 0,
    the other slots empty, its block table 1, 2, ..."""
    blocks = -(-(context + chunk) // BLOCK)
    table = np.zeros((seqs, blocks), np.int32)
    table[0] = np.arange(1, blocks + 1)
    pos = np.arange(context, context + chunk)
    return make_step_input(
        input_ids=np.zeros(chunk), positions=pos, slot_mapping=table[0][pos // BLOCK] * BLOCK + pos % BLOCK,
        block_tables=table, seq_lens=np.array([context + chunk] + [0] * (seqs - 1)),
        query_start_loc=np.array([0] + [chunk] * seqs), logits_indices=np.zeros(seqs), num_seqs=1,
        num_tokens=chunk), blocks


def time_forms(backend: str, chunk: int, context: int, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    batch, blocks = prefill_chunk(chunk, context)
    cache = allocate_kv_cache(KVCacheSpec(1, 1, RANK + ROPE, jnp.float32, value_dims=RANK), blocks + 1, BLOCK,
                              attention_backend=backend)
    cache = dataclasses.replace(cache, k=jnp.asarray(rng.standard_normal(cache.k.shape, np.float32)))
    q_nope = jnp.asarray(rng.standard_normal((chunk, HEADS, NOPE), np.float32))
    q_rope = jnp.asarray(rng.standard_normal((chunk, HEADS, ROPE), np.float32))
    key = jnp.asarray(rng.standard_normal((chunk, 1, RANK + ROPE), np.float32))
    w_uk = jnp.asarray(rng.standard_normal((RANK, HEADS, NOPE), np.float32) * 0.05)
    w_uv = jnp.asarray(rng.standard_normal((RANK, HEADS, V), np.float32) * 0.05)
    # W_UK / W_UV head-major for the grouped kernel, as models_jax/deepseek.py's packed layers keep them
    heads_first = ((PackedExperts.pack(w_uk.transpose(1, 2, 0)), PackedExperts.pack(w_uv.transpose(1, 0, 2)))
                   if backend == "cpu" and packed_matmul_available() else None)
    times, outs = {}, {}
    for form in ("absorbed", "expanded"):
        c = dataclasses.replace(cache, mla_prefill=form)
        fn = jax.jit(lambda c, b, heads_first, *x: latent_attention(*x[:3], c, jnp.int32(0), b, *x[3:], scale=0.07,
                                                                     heads_first=heads_first)[0])
        inputs = (c, batch, heads_first, q_nope, q_rope, key, w_uk, w_uv)
        outs[form] = np.asarray(fn(*inputs))
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            fn(*inputs).block_until_ready()
            best = min(best, time.perf_counter() - start)
        times[form] = best
    np.testing.assert_allclose(outs["expanded"], outs["absorbed"], rtol=2e-3, atol=2e-3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["cpu", "xla"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[128, 256, 512])
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 1024, 4096])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"{jax.devices()[0].platform}; heads {HEADS}, latent {RANK} + rope {ROPE}, nope {NOPE}, v {V}")
    print(f"{'backend':8} {'chunk':>6} {'context':>8} {'absorbed ms':>12} {'expanded ms':>12} {'abs/exp':>8}")
    for backend in args.backends:
        for context in args.contexts:
            for chunk in args.chunks:
                t = time_forms(backend, chunk, context, args.reps)
                print(f"{backend:8} {chunk:6d} {context:8d} {t['absorbed'] * 1e3:12.1f} {t['expanded'] * 1e3:12.1f} "
                      f"{t['absorbed'] / t['expanded']:8.2f}", flush=True)


if __name__ == "__main__":
    main()
