"""Quantization: decode speed with int8 weights and with an int8 KV cache, against float32,
and how far the real demo model's greedy tokens stay with float.

Decode tokens/s at batch 1 and 32 (pure-decode engine steps, host work included) for
float32 weights, `quantization="int8"` and `kv_cache_dtype="int8"` (the latter at a long
context, where KV reads weigh), rounds alternating between engines, medians. Then the real
demo model (SmolLM2-135M-Instruct) generates 256 greedy tokens for 4 prompts with float32,
int8 weights and an int8 KV cache: the position of the first token that differs from float32.

    python benchmarks/quantization.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_checkpoint, decode_step_ms, record, table  # noqa: E402

PROMPTS = ["The history of the Roman Empire began", "def fibonacci(n):", "Explain photosynthesis to a child.",
           "Once upon a time, in a small village,"]


def agreement(new_tokens: int) -> list[list]:
    """The demo model's greedy tokens under each setting against float32's."""
    from app import LLM, SamplingParams
    from runtime.ops.quantization import param_bytes

    settings = {"float32": {}, "int8 weights": {"quantization": "int8"}, "int8 KV cache": {"kv_cache_dtype": "int8"}}
    tokens, sizes = {}, {}
    for name, extra in settings.items():
        llm = LLM(model="servax-demo/smollm2-135m-instruct", max_model_len=512, max_num_seqs=4,
                  max_num_batched_tokens=128, show_progress=False, **extra)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                            use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        sizes[name] = (param_bytes(llm.engine.model.params), llm.engine.kv_spec.bytes_per_block(1))
        del llm
    rows = []
    for name in settings:
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                 for x, y in zip(tokens["float32"], tokens[name])]
        rows.append([name, f"{sizes[name][0] / 1e6:.0f}", f"{sizes[name][1]}", " / ".join(map(str, first))])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--agreement-tokens", type=int, default=256)
    args = parser.parse_args()

    from app import LLM

    path = bench_checkpoint()
    base = dict(model=str(path), dtype="float32", max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512,
                show_progress=False, enable_prefix_caching=False)
    engines = {"float32": LLM(**base), "int8 weights": LLM(**base, quantization="int8"),
               "int8 KV cache": LLM(**base, kv_cache_dtype="int8")}
    cases = [(1, 128), (32, 128), (1, 1536), (4, 1536)]  # (batch, prompt length)
    times: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for batch, prompt in cases:
            for name, llm in engines.items():
                if name == "int8 KV cache" and prompt < 1024:
                    continue  # the KV cache matters at long context
                ms = decode_step_ms(llm, [None] * batch, prompt, args.new_tokens, f"{r}-{name}-{batch}-{prompt}")
                times.setdefault((name, batch, prompt), []).append(ms)
    rows = []
    for (name, batch, prompt), t in times.items():
        median = sorted(t)[len(t) // 2]
        ref = sorted(times[("float32", batch, prompt)])[len(t) // 2]
        rows.append([name, batch, prompt, f"{median:.1f}", f"{batch / median * 1e3:.0f}", f"{ref / median:.2f}"])
    del engines
    start = time.perf_counter()
    agree = agreement(args.agreement_tokens)
    body = (
        "~100M Llama float32 weights; decode steps only, medians of alternating rounds\n\n"
        + table(["engine", "batch", "context", "decode step ms", "tokens/s", "speed vs float32"], rows)
        + f"\n\nSmolLM2-135M-Instruct (the demo model), {args.agreement_tokens} greedy tokens per prompt "
          f"({time.perf_counter() - start:.0f} s)\n\n"
        + table(["setting", "params MB", "KV bytes per token", "first token differing from float32, per prompt"],
                agree)
    )
    record("Quantization: int8 weights and int8 KV cache against float32", body)


if __name__ == "__main__":
    main()
