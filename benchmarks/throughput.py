"""Throughput: servax (native JAX and torchax paths) against Hugging Face generate().

Workload: 64 greedy requests, prompts of 16-256 tokens, 64-128 output tokens each, on a
~100M-parameter random Llama in float32. Every system produces exactly the requested
number of tokens per request (EOS ignored); output tokens/s counts only those.

    python benchmarks/throughput.py                       # jax, torchax and HF
    python benchmarks/throughput.py --systems jax,hf --hf-requests 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_checkpoint, record, table, workload  # noqa: E402


def run_servax(path: Path, impl: str, prompts, max_tokens, args) -> tuple[float, list[list[int]], float]:
    from app import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=str(path), model_impl=impl, dtype="float32", max_model_len=512,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        show_progress=False,
    )
    startup = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in tokens] == list(max_tokens), "servax must produce exactly max_tokens"
    assert llm.engine.stats().compilations_since_warmup == 0, "the engine compiled while serving"
    del llm
    return elapsed, tokens, startup


def run_hf(path: Path, prompts, max_tokens, batch_size: int) -> tuple[float, list[list[int]]]:
    """HF generate() as a careful user runs it: length-sorted, left-padded batches, KV cache on."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(max_tokens[i] for i in idx)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, use_cache=True, pad_token_id=pad,
            )
        for row, i in enumerate(idx):
            tokens[i] = out[row, width : width + max_tokens[i]].tolist()
    return time.perf_counter() - t0, [tokens[i] for i in sorted(tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="jax,torchax,hf")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=64, help="HF runs the first N requests only")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    systems = args.systems.split(",")

    path = bench_checkpoint()
    prompts, max_tokens = workload(args.requests)
    rows, results = [], {}
    for system in systems:
        if system == "hf":
            n = min(args.hf_requests, len(prompts))
            elapsed, tokens = run_hf(path, prompts[:n], max_tokens[:n], args.hf_batch_size)
            label, startup = f"transformers generate (batch {args.hf_batch_size}, {n} requests)", None
        else:
            elapsed, tokens, startup = run_servax(path, system, prompts, max_tokens, args)
            label = f"servax impl={system}"
        out_tokens = sum(len(t) for t in tokens)
        results[system] = (out_tokens / elapsed, tokens)
        rows.append([label, out_tokens, f"{elapsed:.1f}", f"{out_tokens / elapsed:.1f}",
                     "-" if startup is None else f"{startup:.1f}"])

    notes = []
    base = results.get("jax") or next(iter(results.values()))
    for system, (rate, tokens) in results.items():
        notes.append(f"- {system}: {rate / base[0]:.2f}x the tokens/s of servax impl=jax" if "jax" in results else "")
        same = sum(a == b for a, b in zip(base[1], tokens))
        notes.append(f"  identical greedy outputs vs the first system: {same}/{len(tokens)} requests")
    body = table(["system", "output tokens", "seconds", "tokens/s", "startup s"], rows) + "\n\n" + "\n".join(notes)
    record(f"Throughput: {args.requests} requests, ~100M Llama float32", body)


if __name__ == "__main__":
    main()
