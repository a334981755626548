"""Run servax engines on fake CPU devices and print what test_spmd.py asserts on, as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/spmd_worker.py SPEC_JSON

XLA_FLAGS must be set before jax is imported, which is why this runs in its own process
(the test process has one device). SPEC_JSON:

    {"model_impl": "jax", "prompts": [[ids...], ...], "max_tokens": 24,
     "engine": {EngineConfig fields},
     "runs": [{"model": "servax-tiny/llama", "tp": [1, 2, 4], "params": {"q": "layers.q", ...},
               "engine": {EngineConfig fields of this run only}},
              {"model": "servax-tiny/llama", "tp": [8], "expect_error": true}]}

For every (model, tp) the output holds the greedy tokens of all prompts batched, of each
prompt alone and of a batch of two, the compilations counted after warmup (counted before
the step program is compiled once more to list its collective ops, where the spec sets
"collectives" and tp > 1), the KV cache's
sharding and per-device shard shape, and, for each named param, its spec, global shape,
shard shape and device count; or, with expect_error, the startup error's type and message.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _find(params, path: str):
    """A leaf of a params tree by dotted path ("layers.q"), or by its full key (torchax dicts).

    Layers served one per call (runtime/ops/layered.py) hold a list of per-layer trees: "layers.q"
    then names layer 0's q.
    """
    node, parts = params, path.split(".")
    while parts:
        if isinstance(node, (list, tuple)):
            node = node[int(parts.pop(0))] if parts[0].isdigit() else node[0]
            continue
        rest = ".".join(parts)
        if rest in node:  # a flat name (the torchax path's weights are named by their dotted HF paths)
            return node[rest]
        node = node[parts.pop(0)]
    return node


def _describe(arr) -> dict:
    return dict(
        spec=str(arr.sharding.spec), shape=list(arr.shape),
        shard_shape=list(arr.addressable_shards[0].data.shape), num_devices=len(arr.sharding.device_set),
    )


_COLLECTIVE = re.compile(r"=.*\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def step_collectives(programs) -> dict[str, int]:
    """Collective ops in the compiled programs a step of the smallest bucket runs (one step
    program, or prologue + one call's layers + epilogue when layers run a few per call)."""
    batch = programs.inputs.padding_step(programs.plan.token_buckets[0], programs.plan.seq_buckets[0])
    found = []
    for lowered in programs.lower_step(batch):
        text = lowered.compile().as_text()
        found += [m.group(1) for line in text.splitlines() if (m := _COLLECTIVE.search(line))]
    return dict(collections.Counter(found))


def run_one(spec: dict, run: dict, tp: int) -> dict:
    from app import LLM, SamplingParams
    from runtime.ops.stacked import StackedLayers

    greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    t0 = time.perf_counter()
    try:
        llm = LLM(run["model"], model_impl=run.get("model_impl", spec["model_impl"]), tensor_parallel_size=tp,
                  **{**spec["engine"], **run.get("engine", {})})
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        if run.get("expect_error"):
            return dict(error_type=type(e).__name__, error=str(e))
        raise
    startup = time.perf_counter() - t0
    prompts = spec["prompts"]
    tokens = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    batched = tokens(llm.generate(prompts, greedy))
    alone = [tokens(llm.generate([p], greedy))[0] for p in prompts]
    short = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"] // 2, ignore_eos=True)
    pair = tokens(llm.generate(prompts[-2:], [greedy, short]))
    engine = llm.engine
    k_cache = engine.programs.kv_cache.k  # stacked over layers
    layers = engine.model.params.get("layers")
    # q/k/v as one matrix (whole on every device; the layers then stacked for the kernels: runtime/ops/stacked.py)
    joined = isinstance(layers, (list, StackedLayers)) and "qkv" in layers[0]
    return dict(
        batched=batched, alone=alone, pair=pair,
        compilations_since_warmup=engine.stats().compilations_since_warmup,
        mesh=dict(engine.mesh.shape),
        kv=dict(_describe(k_cache), partition_spec=str(engine.model.kv_partition_spec)),
        kv_heads=engine.model.kv_spec.num_kv_heads,
        # the split weights, as tensor parallelism lays them out (one device serves them joined)
        params={name: _describe(_find(engine.model.params, path))
                for name, path in (run.get("params", {}) if tp > 1 else {}).items()},
        joined=joined,
        # (another compile of the step programs: only where a test counts them)
        collectives=step_collectives(engine.programs) if spec.get("collectives") and tp > 1 else None,
        layers_per_call=engine.programs.layered.per_call if engine.programs.layered else None,
        startup_seconds=round(startup, 2), warmup_seconds=round(engine.warmup_seconds, 2),
    )


def main() -> None:
    import jax

    spec = json.loads(sys.argv[1])
    out = dict(num_devices=len(jax.devices()), results=[])
    for run in spec["runs"]:
        for tp in run["tp"]:
            result = run_one(spec, run, tp)
            out["results"].append(dict(name=run.get("name", run["model"]), tp=tp, **result))
            print(f"{run.get('name', run['model'])} tp={tp}: done", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    assert "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""), "set XLA_FLAGS first"
    main()
