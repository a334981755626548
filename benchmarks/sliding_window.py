"""The KV blocks a long Gemma 3 sequence holds: sliding-window layers keep only their window.

A random Gemma 3 shaped as the released ones (every sixth layer global, the others sliding
over 512-token windows, as Gemma 3 1B) generates after an 8k-token prompt, prefilled in
512-token chunks. servax's KV cache groups (runtime/ops/step.py KVCacheGroups) give the global
layers and each set of sliding layers block tables of their own, and the scheduler frees the
blocks a sliding group's window has passed. The table: blocks held at the end and at the peak
of the prefill, against the blocks every layer keeping every block would take (the same
block size); then the blocks used once the request finished. Counts, not timings: any
machine gives the same table.

    python benchmarks/sliding_window.py
    python benchmarks/sliding_window.py --prompt 32768 --layers 24
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    from app import LLM, SamplingParams
    from registry.tiny import make_tiny_checkpoint

    kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(args.layers)]
    path = make_tiny_checkpoint("gemma3", Path(tempfile.mkdtemp()) / "gemma3-long", num_hidden_layers=args.layers,
                                layer_types=kinds, sliding_window=args.window,
                                max_position_embeddings=2 * (args.prompt + args.new_tokens))
    llm = LLM(str(path), max_model_len=args.prompt + args.new_tokens, max_num_seqs=1, show_progress=False,
              max_num_batched_tokens=args.chunk, block_size=args.block_size)
    engine = llm.engine
    groups, per_block = engine.kv_spec.groups, engine.kv_spec.bytes_per_block(args.block_size)
    prompt = [random.Random(0).randrange(4, 500) for _ in range(args.prompt)]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    peak, last = 0, None
    while engine.has_unfinished_requests():
        engine.step()
        if "long" in engine.kv.req_to_blocks:
            held, context = engine.kv.num_held_blocks("long"), len(engine.kv.block_ids("long", 0))
            peak, last = max(peak, held), (held, context, engine.scheduler.requests["long"].num_computed_tokens)
    held, context, computed = last
    every_layer = groups.num_groups * context  # as many blocks of this size if every layer kept every block
    stats = engine.stats()
    mib = lambda blocks: f"{blocks * per_block / 2**20:.2f}"  # noqa: E731
    rows = [
        ["held at the end", held, mib(held), f"{held / every_layer:.3f}"],
        ["held at the prefill's peak", peak, mib(peak), f"{peak / every_layer:.3f}"],
        ["every layer keeping every block", every_layer, mib(every_layer), "1.000"],
    ]
    body = (
        f"{args.layers} layers ({kinds.count('full_attention')} global, {kinds.count('sliding_attention')} sliding, "
        f"window {args.window}), block size {args.block_size} ({groups.num_rows} layers a block: {per_block} bytes), "
        f"{args.prompt}-token prompt in {args.chunk}-token chunks + {args.new_tokens} new tokens "
        f"({computed} computed at the end); KV cache groups: {groups.num_groups} (windows {groups.windows})\n\n"
        + table(["blocks", "count", "MiB", "vs every layer"], rows)
        + f"\n\n- at the end: {context} blocks of the global layers' full context + {held - context} in the "
        f"{groups.num_groups - 1} sliding groups' windows\n"
        f"- after the request finished: {stats.kv_blocks_used} blocks used, "
        f"{stats.kv_blocks_free}/{stats.kv_blocks_total} free"
    )
    record("KV blocks of a long Gemma 3 sequence (sliding-window layers keep their window)", body)
    llm.shutdown()


if __name__ == "__main__":
    main()
