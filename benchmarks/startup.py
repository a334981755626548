"""Startup: time from process start to a ready engine, cold and warm compilation cache.

Each start runs in a fresh Python process. Cold: an empty persistent compilation cache.
Warm: the same cache directory, filled by the cold start.

    python benchmarks/startup.py                  # the ~100M benchmark Llama
    python benchmarks/startup.py --model servax-tiny/llama
    python benchmarks/startup.py --app configs/app.yaml --repeats 3

With `--app`, the time from `serve run CONFIG` (a fresh local Ray cluster each time) to its
first answered chat completion (polled every 0.25 s), cold and warm in turn `--repeats` times;
each model's compilation cache is a fresh directory of this run (the YAML is copied with
engine_kwargs.compilation_cache_dir set), so cold means no program compiled before.
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

import numpy as np  # noqa: E402

from benchmarks.common import bench_checkpoint, record, serve_app, table  # noqa: E402

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from app import LLM, SamplingParams
llm = LLM(model=sys.argv[1], model_impl=sys.argv[2], max_model_len=512, compilation_cache_dir=sys.argv[3],
          show_progress=False)
ready = time.perf_counter() - t0
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
print(json.dumps({"ready_s": ready, "warmup_s": llm.engine.warmup_seconds,
                  "programs": len(llm.engine.plan.bucket_pairs),
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


def app_first_answer(config: Path) -> tuple[float, str]:
    """Seconds from `serve run config` to the first answered chat completion of its first
    model, and that answer's text; the app and its cluster are stopped after."""
    import httpx
    import yaml

    app = yaml.safe_load(config.read_text())["applications"][0]
    model = app["args"]["llm_configs"][0]["model_loading_config"]["model_id"]
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    answers = []

    def answered() -> bool:
        r = httpx.post("http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=30)
        if r.status_code == 200:
            answers.append(r.json()["choices"][0]["message"]["content"])
        return bool(answers)

    subprocess.run(["ray", "stop", "--force"], capture_output=True)
    with serve_app(config, answered, timeout_s=600, poll_s=0.25) as seconds:
        return seconds, answers[0]


def app_startup(config: Path, repeats: int) -> None:
    """Cold and warm starts of the app `config`, alternating, `repeats` times each."""
    import yaml

    spec = yaml.safe_load(config.read_text())
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    answer = ""
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            cache = Path(tmp) / f"xla-{i}"  # fresh per round: its first start is cold
            for app in spec["applications"]:
                for llm in app["args"]["llm_configs"]:
                    llm.setdefault("engine_kwargs", {})["compilation_cache_dir"] = str(cache)
            copy = Path(tmp) / config.name
            copy.write_text(yaml.safe_dump(spec))
            for kind in ("cold", "warm"):
                seconds, answer = app_first_answer(copy)
                times[kind].append(seconds)
                print(f"{kind}: {seconds:.1f} s", flush=True)
    rows = [[kind, " / ".join(f"{t:.1f}" for t in ts), f"{min(ts):.1f}", f"{float(np.median(ts)):.1f}"]
            for kind, ts in times.items()]
    body = (table(["compilation cache", "seconds to the first answer, each start", "best", "median"], rows)
            + f"\n\n- `serve run {config}` on a fresh local Ray cluster to the first answered chat completion "
              f"(max_tokens 8, polled every 0.25 s); the answer: {answer!r}")
    record(f"App start: serve run {config} to its first answer", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the ~100M benchmark Llama")
    parser.add_argument("--impl", default="jax")
    parser.add_argument("--app", type=Path, default=None, help="time `serve run` of this YAML instead")
    parser.add_argument("--repeats", type=int, default=3, help="with --app: cold and warm starts each")
    args = parser.parse_args()
    if args.app is not None:
        app_startup(args.app, args.repeats)
        return
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
