"""N-gram speculative decoding against plain decoding, on the real demo model at batch 1.

Two workloads of chat requests to SmolLM2-135M-Instruct (greedy, one request at a time):
*repetitive* (code edits and quoting tasks, whose answers repeat their input, where prompt
lookup pays) and *open-ended* (stories and explanations, greedy and sampled at T=0.8, where
drafts are rarer and more often wrong, so speculation must cost next to nothing). Tokens/s over the whole workload for the
plain engine and for `speculative_config={"method": "ngram", ...}` at a few draft lengths
(engines share the weights; rounds alternate between them; medians), adaptive drafts
(servax's default) and drafting every time (vLLM's behaviour), with the acceptance figures
vLLM reports and a check that every output equals the plain engine's.

    python benchmarks/speculative.py [--rounds 3] [--max-tokens 192] [--draft-lengths 3,7,15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, table  # noqa: E402

MODEL = "servax-demo/smollm2-135m-instruct"

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
'''
CLASS = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
'''
TEXT = ("The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve "
        "dollars for adults and six dollars for children. Guided tours start every hour from the main hall. "
        "Photography is allowed in all galleries except the special exhibition on the second floor.")

REPETITIVE = [
    f"Rename the variable `total` to `running_sum` in this code and show the whole code:\n\n{CODE}",
    f"Add a docstring to every method of this class and return the full class:\n\n{CLASS}",
    f"Repeat this notice word for word, then add one sentence about parking:\n\n{TEXT}",
    f"Fix the indentation of this code if needed and print it again:\n\n{CLASS}",
]
OPEN_ENDED = [
    "Write a short story about a dragon who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a weekend trip in the mountains.",
    "What are the benefits of learning a second language?",
]


def run(llm, prompts: list[str], max_tokens: int, temperature: float = 0.0) -> tuple[float, list[list[int]], dict]:
    """Seconds for the prompts one at a time, their tokens, and the spec-decode counters moved
    (sampled requests are seeded, so every engine must draw the same tokens)."""
    from app import SamplingParams

    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature else None)
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = [llm.chat([{"role": "user", "content": p}], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    seconds = time.perf_counter() - t0
    after = llm.engine.stats()
    moved = {k: getattr(after, f"spec_decode_{k}") - getattr(before, f"spec_decode_{k}")
             for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return seconds, outs, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--draft-lengths", default="3,5,7", help="num_speculative_tokens values to compare")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--always-draft", type=int, default=7,
                        help="also an engine with adaptive_drafts=false at this length (vLLM's behaviour); 0: none")
    args = parser.parse_args()

    from app import LLM

    lo, hi = (int(x) for x in args.lookup.split(","))
    settings = dict(model=MODEL, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=256,
                    show_progress=False)
    engines = {"plain": LLM(**settings)}
    for k in (int(x) for x in args.draft_lengths.split(",")):
        engines[f"ngram k={k}"] = LLM(**settings, loaded_model=engines["plain"].engine.model, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi})
    if args.always_draft:  # vLLM's behaviour: every proposal found is verified, at full length
        k = args.always_draft
        engines[f"ngram k={k}, always"] = LLM(**settings, loaded_model=engines["plain"].engine.model,
                                              speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                                  "prompt_lookup_min": lo, "prompt_lookup_max": hi,
                                                                  "adaptive_drafts": False})
    workloads = {"repetitive": (REPETITIVE, 0.0), "open-ended": (OPEN_ENDED, 0.0),
                 "open-ended, T=0.8": (OPEN_ENDED, 0.8)}
    for llm in engines.values():  # settle: first calls, detokenizer caches
        run(llm, REPETITIVE[:1], 8)

    seconds = {(w, e): [] for w in workloads for e in engines}
    tokens, counters = {}, {}
    for _ in range(args.rounds):
        for w, (prompts, temperature) in workloads.items():
            for name, llm in engines.items():
                s, outs, moved = run(llm, prompts, args.max_tokens, temperature)
                seconds[(w, name)].append(s)
                tokens[(w, name)] = outs
                counters[(w, name)] = moved

    rows = []
    for w in workloads:
        plain_tps = None
        for name in engines:
            n = sum(len(t) for t in tokens[(w, name)])
            tps = n / statistics.median(seconds[(w, name)])
            plain_tps = plain_tps or tps
            c = counters[(w, name)]
            same = sum(a == b for a, b in zip(tokens[(w, name)], tokens[(w, "plain")]))
            accept = f"{c['num_accepted_tokens'] / c['num_draft_tokens']:.0%}" if c["num_draft_tokens"] else "-"
            mean_len = f"{1 + c['num_accepted_tokens'] / c['num_drafts']:.2f}" if c["num_drafts"] else "-"
            rows.append([w, name, n, f"{tps:.1f}", f"{tps / plain_tps:.2f}", c["num_drafts"], accept, mean_len,
                         f"{same}/{len(tokens[(w, name)])}"])
    body = (f"SmolLM2-135M-Instruct float32, batch 1 (one request at a time), greedy (sampled: seeded), up to {args.max_tokens} "
            f"tokens per request, {len(REPETITIVE)} + {len(OPEN_ENDED)} chat requests; prompt_lookup_min={lo}, "
            f"prompt_lookup_max={hi}; medians of {args.rounds} alternating rounds\n\n"
            + table(["workload", "engine", "tokens", "tokens/s", "vs plain", "verifications", "draft acceptance",
                     "tokens per verification", "outputs equal to plain"], rows))
    record("N-gram speculative decoding at batch 1 (demo model)", body)


if __name__ == "__main__":
    main()
