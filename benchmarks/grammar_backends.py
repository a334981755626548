"""llguidance vs xgrammar: compile time of a 20-property JSON schema and the host time of
one batch-32 token bitmask, with the tiny model's tokenizer and a real 49k-vocab one.

    python benchmarks/grammar_backends.py [--batch 32] [--steps 64]

Each row of the batch runs its own matcher of the same schema, advanced by random allowed
tokens (so the rows sit at different places in the JSON); per step the whole [32, V/32]
mask is filled with the library's batch call (its thread pool), then every matcher
accepts one token. Prints a table; the choice and its reasons are in README.md.
xgrammar is not a servax dependency: `pip install xgrammar` to run this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import record, table  # noqa: E402

SCHEMA_20 = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"]},
        "phone": {"type": "string"},
        "created": {"type": "string"},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "count": {"type": "integer"},
        "notes": {"type": ["string", "null"]},
        "level": {"enum": [1, 2, 3]},
        "ratio": {"type": "number"},
        "verified": {"type": "boolean"},
        "country": {"type": "string"},
        "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "meta": {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}}},
    },
    "required": ["id", "name", "age", "active", "role", "address", "scores", "level"],
    "additionalProperties": False,
}


def tokenizers() -> dict[str, object]:
    from transformers import AutoTokenizer

    from registry.resolve import resolve

    out = {}
    for model in ("servax-tiny/llama", "servax-demo/smollm2-135m-instruct"):
        path = resolve(model).path
        out[model] = AutoTokenizer.from_pretrained(path)
    return out


def bits(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    unpacked = (mask_row[:, None] >> np.arange(32, dtype=np.int32)) & 1
    return np.flatnonzero(unpacked.reshape(-1)[:vocab])


def run_llguidance(tok, batch: int, steps: int, rng) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    tok_s = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA_20)
    first = llguidance.LLMatcher(lltok, grammar)
    assert not first.is_error(), first.get_error()
    first.compute_bitmask()
    compile_s = time.perf_counter() - t
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    executor = llguidance.LLExecutor()
    vocab = lltok.vocab_size
    mask = llguidance.numpy.allocate_token_bitmask(batch, vocab)
    times, accept = [], []
    for _ in range(steps):
        t = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        times.append(time.perf_counter() - t)
        picks = [int(rng.choice(bits(mask[i], vocab))) for i in range(batch)]
        t = time.perf_counter()
        for m, token in zip(matchers, picks):
            if m.is_stopped():
                m.reset()
            else:
                m.consume_token(token)
        accept.append((time.perf_counter() - t) / batch)
    return dict(tokenizer_s=tok_s, compile_s=compile_s, mask_ms=1e3 * statistics.median(times),
                mask_p90_ms=1e3 * float(np.percentile(times, 90)), accept_us=1e6 * statistics.median(accept))


def run_xgrammar(tok, batch: int, steps: int, rng) -> dict:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok)
    tok_s = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA_20), any_whitespace=True)
    compile_s = time.perf_counter() - t
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    batcher = xgr.BatchGrammarMatcher()
    vocab = info.vocab_size
    mask = xgr.allocate_token_bitmask(batch, vocab)
    times, accept = [], []
    for _ in range(steps):
        t = time.perf_counter()
        batcher.batch_fill_next_token_bitmask(matchers, mask)
        times.append(time.perf_counter() - t)
        np_mask = mask.numpy()
        picks = [int(rng.choice(bits(np_mask[i], vocab))) for i in range(batch)]
        t = time.perf_counter()
        for m, token in zip(matchers, picks):
            if m.is_terminated():
                m.reset()
            else:
                m.accept_token(token)
        accept.append((time.perf_counter() - t) / batch)
    return dict(tokenizer_s=tok_s, compile_s=compile_s, mask_ms=1e3 * statistics.median(times),
                mask_p90_ms=1e3 * float(np.percentile(times, 90)), accept_us=1e6 * statistics.median(accept))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    rows = []
    for name, tok in tokenizers().items():
        for lib, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
            r = fn(tok, args.batch, args.steps, np.random.default_rng(0))
            rows.append((lib, f"{name} (V={len(tok)})", r))
    header = ["library", "tokenizer", "tokenizer view s", "compile ms (20-property schema)",
              f"mask ms (batch {args.batch}, median)", "mask ms p90", "accept us/token"]
    body = table(header, [[lib, name, f"{r['tokenizer_s']:.3f}", f"{1e3 * r['compile_s']:.1f}", f"{r['mask_ms']:.3f}",
                           f"{r['mask_p90_ms']:.3f}", f"{r['accept_us']:.1f}"] for lib, name, r in rows])
    record(f"Grammar libraries: llguidance vs xgrammar (batch {args.batch}, {args.steps} steps)", body)


if __name__ == "__main__":
    main()
