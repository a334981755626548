"""Shared pieces of the benchmarks: the machine, the reference model, tables, RESULTS.md."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).with_name("RESULTS.md")
BENCH_DIR = Path(os.environ.get("SERVAX_BENCH_DIR", Path.home() / ".cache" / "servax" / "bench"))

# ~100M-parameter Llama: 12 layers, hidden 768, MLP 3072, vocab of the tiny tokenizer (512),
# so nearly all bytes are in the transformer layers, as in a real model.
BENCH_LLAMA = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=12, max_position_embeddings=2048, initializer_range=0.05,
)


# Random checkpoints the benchmarks write themselves, by the name `--model` takes:
# a small Qwen3-MoE (32 experts, 4 active per token, experts 256 wide), shaped like the
# released Qwen3-MoE models at a size that runs here (experts hold ~80% of the weights).
BENCH_MODELS = {
    # Llama-3.2-1B's body (16 layers of 2048, GQA 32/8 heads of 64, a tied 128k vocabulary): the
    # 1B dense size people deploy, random weights (~5 GB in float32).
    "bench/llama-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0,
        initializer_range=0.02,
    )),
    # Llama-3.2-3B's body (28 layers of 3072, GQA 24/8 heads of 128, the tied 128k vocabulary), in
    # bfloat16 (~6.4 GB; 12.8 GB in float32, which writing and loading it would hold twice).
    "bench/llama-3b": ("llama", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0,
        initializer_range=0.02, dtype="bfloat16",
    )),
    "bench/qwen3-moe": ("qwen3_moe", dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
        max_position_embeddings=2048, initializer_range=0.05,
    )),
    # Gemma 3 shaped like the released 270M (4 heads of 256, 1 KV head, five sliding layers to one
    # global) at 8 layers, with 128-token windows that the workload's prompts outgrow.
    "bench/gemma3": ("gemma3", dict(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=128, query_pre_attn_scalar=256, max_position_embeddings=2048,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
        initializer_range=0.05,
    )),
    # Gemma 4 shaped like the released E2B (4 heads, 1 KV head of 256 on sliding layers, 512 on
    # global ones, per-layer inputs of 256, the last layers reading earlier layers' K/V with a
    # double-wide MLP) at 8 layers, with 128-token windows that the workload's prompts outgrow.
    "bench/gemma4": ("gemma4", dict(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=None, attention_k_eq_v=False,
        sliding_window=128, hidden_size_per_layer_input=256, num_kv_shared_layers=2, use_double_wide_mlp=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0, max_position_embeddings=2048, initializer_range=0.05,
    )),
    # DeepSeek-V2-Lite shaped (latent attention, plain q projection, 2 shared experts) at 6 layers, with
    # V2-Lite's own attention dims: a 512 + 64 latent (vLLM's MLA backends take 320, 512 or 576 only).
    "bench/deepseek-v2-lite": ("deepseek_v2", dict(
        hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=32, num_experts_per_tok=4, n_group=1,
        topk_group=1, topk_method="greedy", kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=2048, initializer_range=0.05,
    )),
}


def bench_model_path(model: str) -> Path | None:
    """The folder of a BENCH_MODELS checkpoint (written on first use), or None for any other name."""
    if model not in BENCH_MODELS:
        return None
    from registry.tiny import make_tiny_checkpoint

    arch, config = BENCH_MODELS[model]
    out = BENCH_DIR / model.replace("/", "-")
    if not (out / "servax_tiny.json").exists():
        make_tiny_checkpoint(arch, out, **config)
    return out


def bench_checkpoint(name: str = "llama", **overrides) -> Path:
    """A ~100M-parameter random Llama checkpoint, made once under BENCH_DIR."""
    from registry.tiny import make_tiny_checkpoint

    config = dict(BENCH_LLAMA, **overrides)
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items())) or "default"
    out = BENCH_DIR / f"{name}-100m-{tag}"
    if not (out / "servax_tiny.json").exists():
        make_tiny_checkpoint(name, out, **config)
    return out


def cpu_model() -> str:
    """lscpu's model name (what RESULTS.md puts beside every figure), else the platform's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    import jax
    import torch

    return (
        f"{cpu_model()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}, torch {torch.__version__}"
    )


def weights_read(params) -> int:
    """Bytes of weights a decode step reads: every matrix, but an untied embedding only in the rows
    it gathers (counted as none)."""
    from runtime.ops.quantization import param_bytes

    total = param_bytes(params)
    return total - param_bytes(params["embed"]) if "lm_head" in params else total


def matmul_flops_per_s(size: int = 2048, repeats: int = 5) -> float:
    """Float32 multiply-adds per second (x2: flops) of the machine's best general matrix product
    on all its cores (NumPy's BLAS on two square [size, size] matrices), best of N: the compute
    ceiling a decode step's products can reach."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
    a @ a  # warm
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def generation_flops(folder: str | Path, prompts: list[list[int]], max_tokens: list[int]) -> float | None:
    """Floating-point operations greedy generation of `max_tokens[i]` tokens after `prompts[i]`
    takes on the dense checkpoint in `folder` (config.json and safetensors): 2 a weight of the
    layers for each token through them (the prompt's and every generated one but the last), 2 a
    weight of the LM head for each generated token, and attention's 4 a head dim for each query
    head, layer and position a token attends to (itself and the earlier ones). None for a mixture
    of experts (its tokens use a share of the weights)."""
    import json

    from safetensors import safe_open

    config = json.loads((Path(folder) / "config.json").read_text())
    if any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    layer_weights = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(file, "np") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2 and "embed_tokens" not in name and "lm_head" not in name:
                    layer_weights += shape[0] * shape[1]
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    attention = 4 * heads * (config.get("head_dim") or hidden // heads) * layers
    flops = 0.0
    for prompt, new in zip(prompts, max_tokens):
        fed = len(prompt) + new - 1
        flops += 2 * layer_weights * fed + 2 * config["vocab_size"] * hidden * new + attention * fed * (fed + 1) / 2
    return flops


def memory_read_bandwidth(size_mb: int = 512, repeats: int = 5) -> float:
    """Bytes per second of streaming reads, best of N of two readers: XLA (a sum over a large
    array) and NumPy sums of its parts on every core at once (XLA's one reduction may not keep
    every core's loads in flight; the faster of the two is the machine's floor)."""
    import concurrent.futures
    import os

    import jax
    import jax.numpy as jnp

    x = jnp.ones((size_mb * (1 << 20) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    parts = np.array_split(np.ones(x.shape, np.float32), os.cpu_count() or 1)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            total(x).block_until_ready()
            best = min(best, time.perf_counter() - t)
            t = time.perf_counter()
            list(pool.map(np.sum, parts))  # NumPy's sums release the GIL
            best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def workload(num_requests: int = 64, seed: int = 0, vocab: int = 512):
    """64 greedy requests: prompt lengths spread over 16-256 tokens, 64-128 output tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, vocab, size=int(n)).tolist() for n in rng.integers(16, 257, num_requests)]
    max_tokens = [int(m) for m in rng.integers(64, 129, num_requests)]
    return prompts, max_tokens


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured Markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def record(title: str, body: str) -> None:
    """Print a result and append it, with the command and the machine, to RESULTS.md."""
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"\n## {title}\n\n`{command}` ({stamp}; {machine()})\n\n{body}\n"
    print(text)
    with RESULTS.open("a") as f:
        f.write(text)


def decode_step_ms(llm, loras: list, prompt_len: int, new_tokens: int, tag: str) -> float:
    """Mean pure-decode step time (ms) of len(loras) requests (request i under LoRA adapter
    loras[i], None: the base), timed once every request has its first token; no compilation."""
    import numpy as np

    from app import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([rng.integers(4, 500, 8).tolist()], SamplingParams(max_tokens=4), use_tqdm=False)  # settle
    for i, lora in enumerate(loras):
        engine.add_request(f"{tag}-{i}", rng.integers(4, 500, prompt_len).tolist(), sp, lora_request=lora)
    started: set[str] = set()
    while len(started) < len(loras):
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    steps = new_tokens // 2
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - t0) / steps
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().compilations_since_warmup == 0
    return step_s * 1e3


def running_replicas(deployment_prefix: str = "LLMServer") -> int:
    """Replicas of the first deployment whose name starts with `deployment_prefix` that Serve reports RUNNING
    (joins the cluster `serve run` started on this machine, once)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)
    for app in serve.status().applications.values():
        for name, deployment in app.deployments.items():
            if name.startswith(deployment_prefix):
                return deployment.replica_states.get("RUNNING", 0)
    return 0


@contextlib.contextmanager
def _served(cmd: list[str], config: Path, ready: Callable[[], bool], timeout_s: float, poll_s: float
            ) -> Iterator[float]:
    """Run `cmd` (a `serve run` of `config`) from the repository in its own process group until
    `ready()` holds (asked every `poll_s`); yields the seconds that took, then stops it."""
    import httpx

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, RAY_SERVE_LOG_TO_STDERR="0", PYTHONPATH=str(root))
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {proc.returncode}")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{config.name}: not ready in {timeout_s:.0f} s")
            try:
                if ready():
                    break
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        yield time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def serve_app(config: Path, ready: Callable[[], bool], timeout_s: float = 900.0,
              poll_s: float = 1.0) -> Iterator[float]:
    """`serve run <config>` from the repository (its own local cluster), until `ready()` holds
    (asked every `poll_s`); yields the seconds that took, then stops the app and the cluster."""
    try:
        with _served(["serve", "run", str(config)], config, ready, timeout_s, poll_s) as seconds:
            yield seconds
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True)


@contextlib.contextmanager
def serve_app_on_own_cluster(config: Path, ready: Callable[[], bool], timeout_s: float = 900.0,
                             num_cpus: int = 2) -> Iterator[float]:
    """As `serve_app`, on a Ray cluster this process starts (ray.init) and stops (ray.shutdown),
    so that nothing else on the machine is touched (serve_app ends with `ray stop --force`).
    Yields the seconds until `ready()`; the driver stays connected (ray actors can be asked)."""
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=300 * 1024**2, log_to_driver=False)
    cmd = [sys.executable, "-m", "ray.serve.scripts", "run", "--address", ray.get_runtime_context().gcs_address,
           str(config)]
    try:
        with _served(cmd, config, ready, timeout_s, 1.0) as seconds:
            yield seconds
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
