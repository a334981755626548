"""Structured outputs: tokens/s with a JSON schema vs without, batch 32.

    python benchmarks/structured.py [--model servax-demo/smollm2-135m-instruct] [--batch 32] [--new-tokens 64]

Three kinds of run of the same batch of chat prompts through the engine (offline
`LLM.chat`), after a warm-up run of each (grammars compiled, programs loaded), then
`--rounds` rounds of all three interleaved; the best round of each is reported (other
work on a shared machine only ever slows a run down):

- free: no constraint, `ignore_eos`, exactly `new_tokens` tokens per request;
- json (long schema): an array of at least 1000 {name, age, city} objects, so every request
  stays under the grammar for all its `new_tokens` tokens: the same token count as free,
  the per-token cost of the mask compared head to head;
- json (extraction): a {name, age, city} object; requests stop when it is complete (fewer
  tokens and a shrinking batch; shown for what a user sees).

Also reported: the host time spent filling masks per step (llguidance, batched), and the
one-off costs: llguidance's tokenizer view and one grammar compilation.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, table  # noqa: E402

PEOPLE = [("Maria Lopez", 34, "Madrid"), ("John Smith", 51, "Boston"), ("Aiko Tanaka", 27, "Osaka"),
          ("Pierre Dubois", 45, "Lyon"), ("Olga Ivanova", 38, "Kazan"), ("Ken Adams", 62, "Denver"),
          ("Lena Berg", 29, "Oslo"), ("Ravi Patel", 41, "Pune")]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
LONG = {"type": "array", "items": PERSON, "minItems": 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="servax-demo/smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import runtime.engine.runner as model_runner
    from app import LLM, SamplingParams
    from runtime.engine.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, max_model_len=512, max_num_seqs=args.batch, max_num_batched_tokens=512,
              show_progress=False, enable_prefix_caching=False)
    compiler = llm.engine.processor.token_masks
    t = time.perf_counter()
    compiler._grammar_tokenizer()
    tokenizer_s = time.perf_counter() - t
    t = time.perf_counter()
    compiler.grammar(StructuredOutputsParams(json=PERSON))
    compile_ms = 1e3 * (time.perf_counter() - t)

    fill_times: list[float] = []
    fill = model_runner.fill_token_masks

    def timed_fill(mask, rows):
        t0 = time.perf_counter()
        fill(mask, rows)
        if rows:
            fill_times.append(time.perf_counter() - t0)

    model_runner.fill_token_masks = timed_fill
    prompts = [[{"role": "user", "content": f"Extract name, age and city as JSON.\nText: {n} is {a} years old and "
                                            f"lives in {c}."}] for n, a, c in PEOPLE * (args.batch // len(PEOPLE) + 1)]
    prompts = prompts[:args.batch]
    runs = {
        "free": SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True),
        "json (long schema)": SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                             structured_outputs={"json": LONG}),
        "json (extraction)": SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                            structured_outputs={"json": PERSON}),
    }
    for params in runs.values():
        llm.chat(prompts, params, use_tqdm=False)  # warm-up
    best: dict[str, tuple[float, int, float]] = {}  # name -> (seconds, tokens, mask fill ms per step)
    for _ in range(args.rounds):
        for name, params in runs.items():
            fill_times.clear()
            t = time.perf_counter()
            outs = llm.chat(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            fill_ms = 1e3 * sum(fill_times) / len(fill_times) if fill_times else 0.0
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, tokens, fill_ms)
    rows, rate = [], {}
    for name, (seconds, tokens, fill_ms) in best.items():
        rate[name] = tokens / seconds
        rows.append([name, tokens, f"{seconds:.2f}", f"{rate[name]:.1f}", f"{rate[name] / rate['free']:.2f}x",
                     f"{fill_ms:.2f}" if name != "free" else "-"])
    assert llm.engine.stats().compilations_since_warmup == 0
    body = table(["run", "output tokens", "seconds", "tokens/s", "vs free", "mask fill ms/step"], rows)
    body += (f"\n\n- model {args.model}, batch {args.batch}, {args.new_tokens} new tokens, greedy; one-off costs: "
             f"llguidance tokenizer view {tokenizer_s:.2f} s (once per engine), a {len(PERSON['properties'])}-"
             f"property schema compiles in {compile_ms:.1f} ms (then cached)\n"
             f"- json (long schema) vs free: {rate['json (long schema)'] / rate['free']:.2f}x tokens/s "
             f"(target >= 0.85x)")
    record(f"Structured outputs: JSON schema vs free, batch {args.batch}", body)


if __name__ == "__main__":
    main()
