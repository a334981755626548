"""Weight formats on CPU: decode speed against float32 and against each format's own
bandwidth floor, and how closely each follows float32's choices.

The demo model (SmolLM2-135M-Instruct, from its GGUF file) served these ways: float32,
`dtype="bfloat16"`, `quantization="int8"`, and `quantization="gguf"` (its Q8_0 embedding and
Q4_1 layers as stored), each multiplied by the packed C++ matmul in its own format, the
quantized ones with int8 activations (the default) and with `int8_activations=False`. For
each: the pure-decode engine step at batch 1 and 32 (host work included; min over
alternating rounds), the bytes of weights a step reads (every matrix; an untied embedding
is only gathered), the floor those bytes set at the read bandwidth (measured before each round:
it drifts on a shared machine; step/floor is the median of the rounds' own ratios),
and teacher-forced top-1 agreement with float32: float32's greedy continuations of a few
prompts are fed back as prompts, and at each position the format's most likely next token
is compared with float32's (the continuation's token). `--kv-cache` also times an int8 KV
cache against float32 at a long context on the ~100M benchmark Llama.

    python benchmarks/quantization.py
    python benchmarks/quantization.py --batches 1 --rounds 5
    python benchmarks/quantization.py --formats bfloat16 int8 "gguf (Q8_0 embed, Q4_1 layers)"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    bench_checkpoint, decode_step_ms, memory_read_bandwidth, record, table, weights_read,
)

DEMO = "servax-demo/smollm2-135m-instruct"
FORMATS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int8, float activations": {"dtype": "float32", "quantization": "int8", "int8_activations": False},
    "gguf (Q8_0 embed, Q4_1 layers)": {"dtype": "float32", "quantization": "gguf"},
    "gguf, float activations": {"dtype": "float32", "quantization": "gguf", "int8_activations": False},
}
PROMPTS = ["The history of the Roman Empire began", "def fibonacci(n):", "Explain photosynthesis to a child.",
           "Once upon a time, in a small village,"]


def agreement(llm, continuations: list[list[int]], prompts: list[list[int]]) -> float:
    """Teacher-forced top-1 agreement of `llm` with the float32 greedy `continuations`."""
    from app import SamplingParams

    same = total = 0
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    inputs = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)]
    for out, prompt, cont in zip(llm.generate(inputs, params, use_tqdm=False), prompts, continuations):
        for pos, token in enumerate(cont):
            ranked = out.prompt_logprobs[len(prompt) + pos]
            top = min(ranked.items(), key=lambda kv: kv[1].rank)[0]
            same += top == token
            total += 1
    return same / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--agreement-tokens", type=int, default=128)
    parser.add_argument("--kv-cache", action="store_true", help="also time an int8 KV cache at a long context")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS),
                        help="rows of the table to run, each quoted whole (float32 always runs: the reference)")
    args = parser.parse_args()
    chosen = {"float32", *args.formats}
    if unknown := chosen - set(FORMATS):
        parser.error(f"unknown formats {sorted(unknown)}; choose from {list(FORMATS)}")

    import numpy as np

    from app import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    engines = {name: LLM(model=DEMO, max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=256,
                         show_progress=False, enable_prefix_caching=False, **extra)
               for name, extra in FORMATS.items() if name in chosen}
    # This machine's bandwidth drifts (other tenants of a virtual machine's host): it is read
    # again before each round, and each step is compared with its own round's floor.
    reads = {name: weights_read(llm.engine.model.params) for name, llm in engines.items()}  # bytes a step
    times: dict[tuple[str, int], float] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    bandwidths = []
    for r in range(args.rounds):
        bandwidths.append(memory_read_bandwidth(repeats=3))
        for batch in batches:
            for name, llm in engines.items():
                ms = decode_step_ms(llm, [None] * batch, 64, args.new_tokens, f"{r}-{name}-{batch}")
                times[(name, batch)] = min(times.get((name, batch), ms), ms)
                ratios.setdefault((name, batch), []).append(ms / (reads[name] / bandwidths[-1] * 1e3))
    bandwidth = float(np.median(bandwidths))
    tokenizer = engines["float32"].get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.agreement_tokens, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in engines["float32"].generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    rows = []
    for name, llm in engines.items():
        read = reads[name]
        agree = agreement(llm, continuations, prompts)
        for batch in batches:
            ms, floor = times[(name, batch)], read / bandwidth * 1e3
            rows.append([name, batch, f"{read / 1e6:.0f}", f"{floor:.2f}", f"{ms:.2f}",
                         f"{np.median(ratios[(name, batch)]):.2f}",
                         f"{batch / ms * 1e3:.1f}", f"{times[('float32', batch)] / ms:.2f}", f"{agree:.3f}"])
    body = (
        f"{DEMO}; read bandwidth measured before each round {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} "
        f"GB/s (floor ms: at the median); decode steps at a 64-token prompt, min of {args.rounds} alternating "
        "rounds; step/floor: the median over rounds of each round's step against that round's floor; agreement "
        f"over {len(prompts)} x {args.agreement_tokens} teacher-forced positions\n\n"
        + table(["weights", "batch", "weights read MB", "floor ms", "step ms", "step/floor", "tokens/s",
                 "speed vs float32", "top-1 agreement"], rows)
    )
    del engines
    if args.kv_cache:
        body += "\n\n" + kv_cache_rows(args)
    record("Weight formats: decode against float32 and each format's bandwidth floor", body)


def kv_cache_rows(args) -> str:
    """An int8 KV cache against float32 on the ~100M Llama at a 1536-token context."""
    from app import LLM

    base = dict(model=str(bench_checkpoint()), dtype="float32", max_model_len=2048, max_num_seqs=4,
                max_num_batched_tokens=512, show_progress=False, enable_prefix_caching=False)
    engines = {"float32 KV": LLM(**base), "int8 KV": LLM(**base, kv_cache_dtype="int8")}
    rows = []
    for batch in (1, 4):
        t = {name: min(decode_step_ms(llm, [None] * batch, 1536, args.new_tokens, f"kv{r}-{name}-{batch}")
                       for r in range(args.rounds)) for name, llm in engines.items()}
        rows += [[name, batch, f"{ms:.1f}", f"{t['float32 KV'] / ms:.2f}"] for name, ms in t.items()]
    return "~100M Llama, 1536-token context\n\n" + table(["KV cache", "batch", "decode step ms", "speed vs float32"],
                                                          rows)


if __name__ == "__main__":
    main()
