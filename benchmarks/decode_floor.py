"""Decode step time against the memory-bandwidth floor.

A decode step must read every weight once and each sequence's KV cache once, so
    floor = (weight bytes + batch x context x KV bytes per token) / read bandwidth.
A mixture-of-experts model reads only the experts its tokens are routed to: of E experts with
k active per token, a batch of b tokens touches E (1 - (1 - k/E)^b) of them per layer on
average (uniform routing, as random weights route), so its floor counts the dense weights and
that share of the experts' bytes.
A step also multiplies every weight by every token (2 x batch flops a weight): the compute
floor, at the float32 rate of the machine's best general matrix product (NumPy's BLAS,
measured in the same run), which at batch 32 on a few cores can exceed the bandwidth floor;
the table's floor is the larger of the two.
This measures the engine's own step time (`LLMEngine.step()`, host work included) at batch 1
and 32, timed over steps in which every request is decoding (after all prompts were prefilled),
in a few rounds, reading the machine's bandwidth before each: it drifts on a shared machine, so
each round's step is set against its own floor, and step/floor is the median of those ratios.

    python benchmarks/decode_floor.py
    python benchmarks/decode_floor.py --attention-backends xla,cpu      # the C++ kernel against pure JAX (CPU)
    python benchmarks/decode_floor.py --dtype bfloat16 --kv-cache-dtypes float32,auto --prompt-len 1024
    python benchmarks/decode_floor.py --model bench/qwen3-moe           # MoE: the active-expert floor
    python benchmarks/decode_floor.py --model bench/llama-1b --dtype bfloat16   # a format's own floor
    python benchmarks/decode_floor.py --model bench/llama-1b --quantization int8
    python benchmarks/decode_floor.py --attention-backends xla,pallas   # side by side (on a TPU)

On CPU the Pallas backend runs interpreted (a correctness mode): its times there mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    bench_checkpoint, bench_model_path, decode_step_ms, matmul_flops_per_s, memory_read_bandwidth, record, table,
    weights_read,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="jax")
    parser.add_argument("--model", default=None, help="a benchmarks.common.BENCH_MODELS name (default the ~100M Llama)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timings per batch size, each with its own bandwidth")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None, help="int8 (or gguf for a .gguf model)")
    parser.add_argument("--attention-backends", default="auto",
                        help="comma-separated attention_backend values (auto, xla, pallas, cpu), timed in turn")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma-separated kv_cache_dtype values (auto, float32, bfloat16, ...), timed in turn")
    args = parser.parse_args()

    from app import LLM

    path = bench_model_path(args.model) if args.model else bench_checkpoint()
    batches = [int(b) for b in args.batches.split(",")]
    flops = matmul_flops_per_s()
    rows, bandwidths = [], []
    for backend, kv in [(b, kv) for b in args.attention_backends.split(",") for kv in args.kv_cache_dtypes.split(",")]:
        llm = LLM(
            model=str(path), model_impl=args.impl, dtype=args.dtype, quantization=args.quantization,
            max_model_len=max(512, args.prompt_len + args.new_tokens + 8), max_num_seqs=max(batches),
            max_num_batched_tokens=512, show_progress=False, enable_prefix_caching=False, attention_backend=backend,
            kv_cache_dtype=kv,
        )
        weight_bytes = _weights_read(path, llm.engine.model.params)
        rows += _decode_rows(llm, backend, batches, args, weight_bytes, bandwidths, flops)
        assert llm.engine.stats().compilations_since_warmup == 0
        del llm
    body = (
        f"read bandwidth measured before each round: {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} GB/s "
        f"(floor: at each row's median); float32 GEMM rate measured: {flops / 1e9:.0f} GFLOP/s; impl={args.impl}; "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens; step: the best of {args.rounds} rounds, "
        "step/floor: the median of the rounds' own ratios\n\n"
        + table(["attention", "batch", "weights MB", "KV read MB", "bandwidth floor ms", "compute floor ms",
                 "step ms", "step/floor", "tokens/s"], rows)
    )
    form = args.dtype + (f", quantization {args.quantization}" if args.quantization else "")
    record(f"Decode step against the bandwidth floor ({args.model or '~100M Llama'} {form})", body)


def _weights_read(path: Path, params):
    """batch -> bytes of weights a decode step of that many tokens reads (see the module docstring):
    a dense model's weights as the engine holds them (its format: bfloat16, int8, ...), an
    untied embedding only gathered; a MoE model's from the checkpoint, its experts' share."""
    import json

    from registry.weights import open_checkpoint

    config = json.loads((path / "config.json").read_text())
    sizes = {name: t.nbytes for name, t in open_checkpoint(path).items()}
    experts = sum(n for name, n in sizes.items() if ".experts." in name)
    dense = sum(sizes.values()) - experts
    count = config.get("num_local_experts") or config.get("num_experts") or 0
    k = config.get("num_experts_per_tok", 0)
    if not experts:
        held = weights_read(params)
        return lambda batch: held
    return lambda batch: dense + experts * (1 - (1 - k / count) ** batch)


def _decode_rows(llm, backend: str, batches: list[int], args, weight_bytes, bandwidths: list[float],
                 flops: float) -> list[list]:
    """One engine's table rows: its pure-decode step time at each batch size, in `args.rounds`
    rounds, the read bandwidth read before each (appended to `bandwidths`): on a shared machine
    it drifts, so each round's step is set against its own floor."""
    import jax
    import numpy as np

    engine = llm.engine
    held = engine.model.params
    # weights multiplied per token: those read, in elements (a MoE's active share as its bytes')
    elements = sum(x.size for x in jax.tree.leaves(held)) - (held["embed"].size if "lm_head" in held else 0)
    per_byte = elements / weights_read(held)
    kv_bytes_per_token = engine.kv_spec.bytes_per_block(1)
    cache = engine.programs.kv_cache
    label = f"{cache.attention_backend} ({backend}), {cache.half_bits or cache.k.dtype} KV"
    rows = []
    for batch in batches:
        steps = args.new_tokens // 2
        context = args.prompt_len + steps  # mean context over the timed steps (about)
        kv_read = batch * context * kv_bytes_per_token
        compute_floor = 2 * batch * weight_bytes(batch) * per_byte / flops
        times, ratios, read = [], [], []
        for r in range(args.rounds):
            bandwidths.append(memory_read_bandwidth(repeats=3))
            read.append((weight_bytes(batch) + kv_read) / bandwidths[-1])
            times.append(decode_step_ms(llm, [None] * batch, args.prompt_len, args.new_tokens,
                                        f"{backend}-b{batch}-{r}") / 1e3)
            ratios.append(times[-1] / max(read[-1], compute_floor))
        step_s, read_floor = min(times), float(np.median(read))
        rows.append([
            label, batch, f"{weight_bytes(batch) / 1e6:.0f}", f"{kv_read / 1e6:.1f}", f"{read_floor * 1e3:.1f}",
            f"{compute_floor * 1e3:.1f}", f"{step_s * 1e3:.1f}", f"{np.median(ratios):.2f}", f"{batch / step_s:.0f}",
        ])
    return rows


if __name__ == "__main__":
    main()
