"""The packed-weight C++ products alone: time per matrix, arithmetic rate and bytes read.

Multiplies x [rows, in] by enough distinct packed matrices of each shape (the demo model's and
the 1B Llama's layer shapes) that they do not fit the caches, chained in one program, as a
decode or prefill step meets them; best of N runs. Formats: float32 (runtime/ops/kernels/
matmul.cc), bfloat16 (matmul_formats.cc), and int8 or 4-bit weights with int8 activations
(matmul_dot.cc, GGUF's Q8_0, Q4_1, Q4_K, Q5_1 and Q6_K as servax serves them). Beside each rate, the
machine's float32 peak: NumPy's BLAS on a large square product (benchmarks/common.py matmul_flops_per_s).

    python benchmarks/matmul.py                      # float32 at 1, 8 and 32 rows
    python benchmarks/matmul.py --formats float32,q4_1,q8_0 --rows 1,32
    python benchmarks/matmul.py --formats q8_0,q4_1,q5_1,q6_k --rows 1,8,32 --shapes 2048x16384,8192x2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import matmul_flops_per_s, record, table  # noqa: E402

# (in, out) of the layer products: the demo model's qkv, gate_up, down and LM head; the 1B's
# qkv, gate_up and down.
SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152), (2048, 3072), (2048, 16384), (8192, 2048)]
WORKING_SET = 200e6  # bytes of distinct matrices a shape multiplies per run (past the 16-32 MiB L3 caches)


def packed(fmt: str, d_in: int, d_out: int, rng):
    """A random matrix [d_in, d_out] packed as servax packs `fmt`."""
    import jax.numpy as jnp
    import numpy as np

    from runtime.ops.matmul import PackedWeight

    if fmt in ("float32", "bfloat16"):
        w = jnp.asarray(rng.standard_normal((d_in, d_out), dtype=np.float32))
        return PackedWeight.pack(w.astype(fmt))
    scales = jnp.asarray(rng.random((d_in // 32, d_out), dtype=np.float32) * 0.01)
    if fmt == "q8_0":
        q = jnp.asarray(rng.integers(-127, 128, (d_in, d_out)), jnp.int8)
        return PackedWeight.pack_int8(q, scales).for_int8_activations()
    if fmt in ("q4_k", "q6_k"):  # scales (offsets) as codes under a float16 super-scale per 256 inputs
        per = 8 if fmt == "q4_k" else 16
        d = jnp.asarray(rng.random((d_in // 256, d_out), dtype=np.float32) * 1e-3, jnp.float16).astype(jnp.float32)
        codes = lambda low: jnp.asarray(rng.integers(low, 64, (d_in * per // 256, d_out)), jnp.float32)  # noqa: E731
        if fmt == "q6_k":
            q = jnp.asarray(rng.integers(-32, 32, (d_in, d_out)), jnp.int8)
            return PackedWeight.pack_uint6(q, jnp.repeat(d, per, axis=0) * codes(-64), d).for_int8_activations()
        q = jnp.asarray(rng.integers(0, 16, (d_in, d_out)), jnp.uint8)
        return PackedWeight.pack_uint4(q, jnp.repeat(d, per, axis=0) * codes(0), -jnp.repeat(d, per, axis=0) * codes(0),
                                       d, -d).for_int8_activations()
    if fmt == "q5_1":
        q = jnp.asarray(rng.integers(0, 32, (d_in, d_out)), jnp.uint8)
        return PackedWeight.pack_uint5(q, scales, -16 * scales).for_int8_activations()
    q = jnp.asarray(rng.integers(0, 16, (d_in, d_out)), jnp.uint8)
    return PackedWeight.pack_uint4(q, scales, -8 * scales).for_int8_activations()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="float32",
                        help="comma-separated: float32, bfloat16, q8_0, q4_1, q4_k, q5_1, q6_k")
    parser.add_argument("--rows", default="1,8,32", help="comma-separated rows of x (sequences of a decode step)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="", help="comma-separated INxOUT (default: the demo's and the 1B's layers)")
    args = parser.parse_args()

    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    peak = matmul_flops_per_s()
    rows_out = []
    for fmt in args.formats.split(","):
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
        for d_in, d_out in shapes:
            ws = []
            while not ws or sum(a.nbytes for w in ws for a in jax.tree.leaves(w)) < WORKING_SET:
                ws.append(packed(fmt, d_in, d_out, rng))
            nbytes = sum(a.nbytes for w in ws for a in jax.tree.leaves(w))
            for m in (int(r) for r in args.rows.split(",")):
                x = jax.numpy.asarray(rng.standard_normal((m, d_in), dtype=np.float32))
                chained = jax.jit(lambda x, ws: sum(w.matmul(x)[:, :1].sum() for w in ws))
                chained(x, ws).block_until_ready()
                best = float("inf")
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    chained(x, ws).block_until_ready()
                    best = min(best, time.perf_counter() - t)
                ops = 2 * m * d_in * d_out * len(ws)
                rows_out.append([fmt, f"{d_in} x {d_out}", m, f"{best / len(ws) * 1e6:.1f}", f"{ops / best / 1e9:.1f}",
                                 f"{ops / best / peak:.2f}", f"{nbytes / best / 1e9:.1f}"])
    body = (f"packed products chained over distinct matrices ({WORKING_SET / 1e6:.0f} MB a shape), best of "
            f"{args.repeats}; float32 peak (NumPy BLAS, 2048^3) {peak / 1e9:.0f} GFLOP/s\n\n"
            + table(["weights", "in x out", "rows", "us per matrix", "GFLOP/s (GOP/s)", "of peak", "weights GB/s"],
                    rows_out))
    record("Packed-weight products alone", body)


if __name__ == "__main__":
    main()
