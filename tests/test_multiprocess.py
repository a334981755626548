"""One engine over two processes: tensor_parallel_size=8 from 2 processes of 4 fake CPU devices.

The leader (tests/multiprocess_leader.py, a fresh process: jax.distributed joins before
JAX uses the devices) makes `LLM(..., tensor_parallel_size=8, distributed_executor_backend="ray")`
on its own local Ray cluster; runtime/engine/distributed.py starts the second process as a Ray
actor, both join jax.distributed (CPU collectives over gloo) and every step runs as one
SPMD program over all 8 devices. Its tokens are judged against this process running the
same engine on one device and against transformers.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, hf_greedy, hf_model

LEADER = Path(__file__).with_name("multiprocess_leader.py")
MAX_TOKENS = 12
# 5 tokens, and 40 (more than the 16-token step budget: chunked prefill over three steps).
PROMPTS = [[random.Random(n).randrange(4, 500) for _ in range(n)] for n in (5, 40)]
HANG_TIMEOUT_S = 20  # distributed_timeout_s of the two-process runs
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64,
              show_progress=False, compilation_cache_dir="")


def run_leader(model: Path | str, model_impl: str, servax_cache: Path, finish: str, *, tp: int = 8,
               local_devices: int = 4, engine: dict | None = None) -> dict:
    """Runs the leader in a fresh process; its result comes back in a file (the raylet may print
    to stdout after it, e.g. that the stopped worker died)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}",
               JAX_PLATFORMS="cpu", SERVAX_CACHE=str(servax_cache), PYTHONPATH=str(REPO))
    spec = dict(model=str(model), model_impl=model_impl, tp=tp, prompts=PROMPTS, max_tokens=MAX_TOKENS,
                engine=dict(ENGINE, distributed_timeout_s=HANG_TIMEOUT_S, **(engine or {})), finish=finish,
                result_path=tempfile.mktemp(prefix=f"leader-{model_impl}-{finish}-", suffix=".json"))
    proc = subprocess.run([sys.executable, str(LEADER), json.dumps(spec)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = Path(spec["result_path"])
    assert result.exists(), f"the leader wrote no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    try:
        return json.loads(result.read_text())
    finally:
        result.unlink()


def one_process(model: Path | str, model_impl: str) -> dict:
    """The same requests on one device in this process (no parallelism)."""
    from app.llm import LLM
    from runtime import SamplingParams

    llm = LLM(str(model), model_impl=model_impl, **ENGINE)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
               for i in range(len(PROMPTS))]
    return dict(greedy=[o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)],
                sampled=[o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampled, use_tqdm=False)])


@pytest.fixture(scope="module", params=["jax", "torchax"])
def runs(request, servax_cache, tmp_path_factory):
    """(model_impl, checkpoint, two-process result, one-process result) for a tiny model with
    8 attention heads and 8 KV heads, so that every device holds one of each. The native run
    ends by stopping its worker mid-request, the torchax run by LLM.shutdown()."""
    from registry.tiny import make_tiny_checkpoint

    impl = request.param
    arch = "llama" if impl == "jax" else "phi"  # phi: biases, partial rotary, LayerNorm
    path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}-8-heads"), num_attention_heads=8,
                                num_key_value_heads=8)
    finish = "hang" if impl == "jax" else "shutdown"
    return impl, path, run_leader(path, impl, servax_cache, finish), one_process(path, impl)


def test_process_count_follows_tensor_parallel_size_and_local_devices():
    from runtime.engine.distributed import num_processes

    assert num_processes(4, local_devices=4) == 1
    assert num_processes(8, local_devices=4) == 2
    assert num_processes(16, local_devices=4) == 4
    with pytest.raises(ValueError, match="not a multiple of 4"):
        num_processes(6, local_devices=4)


def test_local_device_count_reads_xla_flags_without_starting_jax(monkeypatch):
    from runtime.engine.distributed import local_device_count

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert local_device_count() == 4
    monkeypatch.setenv("XLA_FLAGS", "")
    assert local_device_count() == 1


def test_executor_backends_vllm_has_and_servax_does_not_are_refused_saying_why(monkeypatch):
    from app.llm import load_model
    from runtime.engine import distributed
    from runtime.engine.config import EngineConfig

    for backend in ("mp", "external_launcher"):
        with pytest.raises(ValueError, match="Ray actors"):
            EngineConfig(model="servax-tiny/llama", distributed_executor_backend=backend)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    uni = EngineConfig(model="servax-tiny/llama", tensor_parallel_size=8, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="'uni' keeps the engine in one process.*over 2 processes"):
        distributed.connect(uni, load_model)
    assert distributed.current_group() is None


@pytest.mark.slow
def test_two_processes_form_one_eight_device_mesh(runs):
    _, _, two, _ = runs
    assert (two["num_devices"], two["local_devices"], two["process_count"]) == (8, 4, 2)
    assert two["mesh"] == {"data": 1, "model": 8} and two["num_processes"] == 2


@pytest.mark.slow
def test_greedy_and_seeded_tokens_match_one_process(runs):
    impl, _, two, one = runs
    assert all(len(t) == MAX_TOKENS for t in two["greedy"] + two["sampled"])
    assert two["greedy"] == one["greedy"], f"{impl}: greedy tokens over 2 processes differ from 1 device"
    assert two["sampled"] == one["sampled"], f"{impl}: seeded sampled tokens over 2 processes differ"
    assert two["sampled"] != two["greedy"]


@pytest.mark.slow
def test_greedy_tokens_match_transformers(runs):
    _, path, two, _ = runs
    hf = hf_model(path)
    assert two["greedy"] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.slow
def test_each_process_holds_half_the_weights(runs):
    """Measured from the live arrays' addressable shards, in each process."""
    _, _, two, _ = runs
    half = two["total_param_bytes"] / 2
    for held in [two["leader_param_bytes"], *two["worker_param_bytes"]]:
        assert half <= held < 1.1 * half, (held, two["total_param_bytes"])


@pytest.mark.slow
def test_nothing_compiles_while_serving_and_only_small_inputs_are_sent(runs):
    _, _, two, _ = runs
    assert two["compilations_since_warmup"] == 0 and two["worker_compilations_since_warmup"] == [0]
    assert two["kv_blocks_used_after"] == 0
    # Two calls per step (step, sampler), each sending only small host arrays.
    assert two["greedy_calls"] % 2 == 0 and two["greedy_bytes"] / (two["greedy_calls"] // 2) < 32 * 1024


@pytest.mark.slow
def test_shutdown_stops_the_workers_and_a_hung_worker_is_reported(runs):
    impl, _, two, _ = runs
    if impl == "torchax":  # ended by LLM.shutdown(): the actor and its process are gone
        assert two["workers_left"] == 0 and two["worker_processes_left"] == 0
    else:  # ended by SIGSTOP of the worker while a request decoded
        hang = two["hang"]
        assert hang["error"] and "a worker hangs" in hang["error"]
        assert HANG_TIMEOUT_S <= hang["seconds"] < HANG_TIMEOUT_S + 10


# ---- the real demo model over three processes ----------------------------------------------

DEMO = "servax-demo/smollm2-135m-instruct"


@pytest.fixture(scope="module")
def demo(servax_cache):
    """SmolLM2-135M has 9 attention heads and 3 KV heads, so tensor parallelism 8 cannot split it;
    3 processes of 1 device each (tensor_parallel_size=3) can: (two-process result, one-process result)."""
    from registry.demo import demo_checkpoint_path

    one = one_process(DEMO, "auto")  # converts the demo model into the cache first, if needed
    return demo_checkpoint_path(DEMO), run_leader(DEMO, "auto", servax_cache, "shutdown", tp=3, local_devices=1), one


@pytest.mark.slow
def test_demo_model_over_three_processes_matches_one_process_and_transformers(demo):
    path, three, one = demo
    assert (three["num_devices"], three["process_count"], three["num_processes"]) == (3, 3, 3)
    assert three["greedy"] == one["greedy"] and three["sampled"] == one["sampled"]
    assert three["greedy"] == [hf_greedy(hf_model(path), p, MAX_TOKENS) for p in PROMPTS]
    third = three["total_param_bytes"] / 3
    for held in [three["leader_param_bytes"], *three["worker_param_bytes"]]:
        assert third <= held < 1.1 * third, (held, three["total_param_bytes"])
    assert three["compilations_since_warmup"] == 0 and three["worker_compilations_since_warmup"] == [0, 0]
    assert three["workers_left"] == 0 and three["worker_processes_left"] == 0


# ---- `serve run` of the shipped two-process config, and a worker killed mid-stream ----------

MP_MODEL = "servax-tiny/llama-8-heads"


def _engine_workers() -> list[int]:
    """PIDs of live EngineWorker actor processes of this test's cluster (Ray titles them ray::EngineWorker)."""
    from conftest import own_processes

    return own_processes("^ray::EngineWorker")


def _replicas() -> list[int]:
    """PIDs of live LLMServer replica processes of this test's cluster."""
    from conftest import own_processes

    return own_processes("^ray::ServeReplica:.*LLMServer")


@pytest.mark.slow
@pytest.mark.cluster
def test_serve_run_two_processes_answers_and_survives_a_killed_worker(servax_cache, tmp_path):
    import signal
    import threading
    import time

    import httpx
    from conftest import alive, openai_client, serve_run, sse_events

    with serve_run(REPO / "configs" / "multiprocess-cpu.yaml", tmp_path, ready_timeout_s=400) as run:
        client = openai_client(run.base_url)
        (card,) = client.models.list().data
        assert card.id == MP_MODEL
        done = client.completions.create(model=MP_MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 8
        chat = client.chat.completions.create(model=MP_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 6
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MP_MODEL, prompt="Hello world", max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert text == done.choices[0].text  # streamed tokens = the same greedy tokens
        (worker,) = _engine_workers()
        (replica,) = _replicas()

        # Kill the worker process while a stream is running.
        outcome: dict = {}

        def stream() -> None:
            t0 = time.perf_counter()
            try:
                with httpx.stream("POST", run.base_url + "/v1/completions", timeout=120, json=dict(
                        model=MP_MODEL, prompt="Hello", max_tokens=240, temperature=0, stream=True,
                        ignore_eos=True)) as r:
                    outcome["status"] = r.status_code
                    outcome["events"] = sse_events(r)
            except httpx.HTTPError as e:  # the connection dropped: also an ending, not a hang
                outcome["transport_error"] = repr(e)
            outcome["seconds"] = time.perf_counter() - t0

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(1.0)
        os.kill(worker, signal.SIGKILL)
        killed = time.perf_counter()
        thread.join(timeout=150)
        assert not thread.is_alive(), "the stream hung after its worker was killed"
        events = outcome.get("events", [])
        tokens = sum(len(e["choices"][0]["text"]) > 0 for e in events if isinstance(e, dict) and "choices" in e)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert outcome.get("transport_error") or errors or outcome.get("status", 200) >= 500, outcome
        assert tokens < 240  # it did not finish: the stream ended with an error
        # Its engine dead, the replica process exits (as vLLM's server does), so Serve's routers
        # stop sending to it and Serve replaces it at once rather than after failed health checks.
        # A worker killed inside a collective may only be seen as a hung step: up to
        # distributed_timeout_s (30 s in the config).
        while replica in _replicas():
            assert time.perf_counter() - killed < 30 + 15, "the replica outlived its engine"
            time.sleep(0.2)

        # Requests meanwhile get a 503 (never a hang), until Serve has replaced the group.
        statuses = []
        while True:
            assert time.perf_counter() - killed < 300, f"not recovered; statuses {statuses}"
            try:
                r = httpx.post(run.base_url + "/v1/completions", timeout=60, json=dict(
                    model=MP_MODEL, prompt="Hello world", max_tokens=8, temperature=0, ignore_eos=True))
                statuses.append(r.status_code)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["error"]["code"] in ("engine_dead", "replica_unavailable")
            except httpx.HTTPError as e:
                statuses.append(repr(e))
            time.sleep(1.0)
        recovered = time.perf_counter() - killed
        assert r.json()["choices"][0]["text"] == done.choices[0].text  # the new group: same tokens
        new_workers, new_replicas = _engine_workers(), _replicas()
        assert len(new_workers) == 1 and new_workers != [worker]
        print(f"\nworker killed: stream ended after {outcome['seconds']:.1f} s; then {statuses} "
              f"(200 after {recovered:.1f} s)")
    deadline = time.time() + 30
    started = [worker, replica, *new_workers, *new_replicas]
    while alive(started) and time.time() < deadline:
        time.sleep(0.5)
    assert alive(started) == []  # the cluster's end leaves no worker or replica behind


@pytest.mark.slow
@pytest.mark.cluster
def test_expert_parallel_moe_over_two_processes_matches_one_process(servax_cache, tmp_path):
    """A Qwen3-MoE with 8 experts, one per device of two processes (enable_expert_parallel):
    each process loads its experts only, and the tokens are one device's."""
    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe-8", num_attention_heads=8, num_key_value_heads=8,
                                num_experts=8)
    two = run_leader(path, "jax", servax_cache, "shutdown", engine=dict(enable_expert_parallel=True))
    one = one_process(path, "jax")
    assert two["process_count"] == 2 and two["mesh"] == {"data": 1, "model": 8}
    assert two["greedy"] == one["greedy"] and two["sampled"] == one["sampled"]
    assert two["leader_param_bytes"] < two["total_param_bytes"]
