"""Decode step time against the memory-bandwidth floor.

A decode step must read every weight once and each sequence's KV cache once, so
    floor = (weight bytes + batch x context x KV bytes per token) / read bandwidth.
This measures the machine's read bandwidth in the same run, then the engine's own step
time (`LLMEngine.step()`, host work included) at batch 1 and 32, timed over steps in which
every request is decoding (after all prompts were prefilled).

    python benchmarks/decode_floor.py
    python benchmarks/decode_floor.py --attention-backends xla,cpu      # the C++ kernel against pure JAX (CPU)
    python benchmarks/decode_floor.py --attention-backends xla,pallas   # side by side (on a TPU)

On CPU the Pallas backend runs interpreted (a correctness mode): its times there mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_checkpoint, decode_step_ms, memory_read_bandwidth, record, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="jax")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--attention-backends", default="auto",
                        help="comma-separated attention_backend values (auto, xla, pallas, cpu), timed in turn")
    args = parser.parse_args()

    from app import LLM

    path = bench_checkpoint()
    batches = [int(b) for b in args.batches.split(",")]
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    bandwidth = memory_read_bandwidth()
    rows = []
    for backend in args.attention_backends.split(","):
        llm = LLM(
            model=str(path), model_impl=args.impl, dtype="float32", max_model_len=512,
            max_num_seqs=max(batches), max_num_batched_tokens=512, show_progress=False,
            enable_prefix_caching=False, attention_backend=backend,
        )
        rows += _decode_rows(llm, backend, batches, args, weight_bytes, bandwidth)
        assert llm.engine.stats().compilations_since_warmup == 0
        del llm
    body = (
        f"read bandwidth measured: {bandwidth / 1e9:.1f} GB/s; impl={args.impl}; prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens\n\n"
        + table(["attention", "batch", "weights MB", "KV read MB", "floor ms", "step ms", "step/floor", "tokens/s"],
                rows)
    )
    record("Decode step against the bandwidth floor (~100M Llama float32)", body)


def _decode_rows(llm, backend: str, batches: list[int], args, weight_bytes: int, bandwidth: float) -> list[list]:
    """One engine's table rows: its pure-decode step time at each batch size."""
    engine = llm.engine
    kv_bytes_per_token = engine.kv_spec.bytes_per_block(1)
    label = f"{engine.programs.kv_cache.attention_backend} ({backend})"
    rows = []
    for batch in batches:
        step_s = decode_step_ms(llm, [None] * batch, args.prompt_len, args.new_tokens, f"{backend}-b{batch}") / 1e3
        steps = args.new_tokens // 2
        context = args.prompt_len + steps  # mean context over the timed steps (about)
        kv_read = batch * context * kv_bytes_per_token
        floor = (weight_bytes + kv_read) / bandwidth
        rows.append([
            label, batch, f"{weight_bytes / 1e6:.0f}", f"{kv_read / 1e6:.1f}",
            f"{floor * 1e3:.1f}", f"{step_s * 1e3:.1f}", f"{step_s / floor:.2f}", f"{batch / step_s:.0f}",
        ])
    return rows


if __name__ == "__main__":
    main()
