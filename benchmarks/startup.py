"""Startup: time from process start to a ready engine, cold and warm compilation cache.

Each start runs in a fresh Python process. Cold: an empty persistent compilation cache.
Warm: the same cache directory, filled by the cold start.

    python benchmarks/startup.py                  # the ~100M benchmark Llama
    python benchmarks/startup.py --model servax-tiny/llama
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_checkpoint, record, table  # noqa: E402

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from app import LLM, SamplingParams
llm = LLM(model=sys.argv[1], model_impl=sys.argv[2], max_model_len=512, compilation_cache_dir=sys.argv[3],
          show_progress=False)
ready = time.perf_counter() - t0
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
print(json.dumps({"ready_s": ready, "warmup_s": llm.engine.warmup_seconds,
                  "programs": len(llm.engine.runner.bucket_pairs()),
                  "after_warmup": llm.engine.stats().compilations_since_warmup}))
"""


def start(model: str, impl: str, cache_dir: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model, impl, cache_dir], cwd=ROOT, capture_output=True, text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the ~100M benchmark Llama")
    parser.add_argument("--impl", default="jax")
    args = parser.parse_args()
    model = args.model or str(bench_checkpoint())

    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = start(model, args.impl, cache_dir)
        warm = start(model, args.impl, cache_dir)
    for name, r in (("cold", cold), ("warm", warm)):
        rows.append([name, f"{r['process_s']:.1f}", f"{r['ready_s']:.1f}", f"{r['warmup_s']:.1f}",
                     r["programs"], r["after_warmup"]])
    body = (
        table(["cache", "process s", "ready s", "warmup s", "bucket programs", "compiles after warmup"], rows)
        + f"\n\nwarm/cold (process): {warm['process_s'] / cold['process_s']:.2f}"
    )
    record(f"Startup, cold and warm compilation cache ({Path(model).name}, impl={args.impl})", body)


if __name__ == "__main__":
    main()
