"""KV-cache-aware routing (#44): the engine's block-hash event feed, and on a real cluster the
KVAwareRouter (app.kv_routing) sending each request to the replica whose prefix cache holds
its prompt, traded against load, with LoRA adapters keyed apart."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.lora_request import LoRARequest
from runtime.engine.request import Request, prefix_block_hashes
from runtime.engine.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int], lora: LoRARequest | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=(0,), block_size=BS,
                   max_model_len=128, sample_seed=0, lora_request=lora)


def test_block_hash_events_mirror_the_prefix_cache_and_hashes_agree_across_processes():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    cursor = kv.block_hash_events().cursor
    first = _request("a", list(range(1, 10)))  # 9 tokens: 2 full blocks
    assert kv.allocate_slots(first, 9, []) and first.block_hashes == prefix_block_hashes(list(range(1, 10)), BS)
    events = kv.block_hash_events(cursor)
    assert events.stored == first.block_hashes and events.removed == [] and not events.reset
    kv.free(first)  # cached blocks stay cached while free
    assert kv.block_hash_events(events.cursor).stored == []
    second = _request("b", list(range(50, 66)))  # 16 tokens: all 4 blocks, evicting the first request's
    assert kv.allocate_slots(second, 16, [])
    later = kv.block_hash_events(events.cursor)
    assert set(later.removed) == set(first.block_hashes) and later.stored == second.block_hashes
    snapshot = kv.block_hash_events(-1)
    assert snapshot.reset and set(snapshot.stored) == set(second.block_hashes)
    # An adapter's blocks chain from the adapter: other keys for the same tokens.
    lora = LoRARequest("adapter", 7, "/nowhere")
    assert _request("c", list(range(1, 10)), lora).block_hashes == prefix_block_hashes(list(range(1, 10)), BS, 7)
    assert prefix_block_hashes(list(range(1, 10)), BS, 7) != first.block_hashes
    # The keys are the same in another process (a router hashes prompts where the engine is not).
    code = "from runtime.engine.request import prefix_block_hashes as p; print(p(list(range(1, 10)), 4, 7))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "random"}, cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == str(prefix_block_hashes(list(range(1, 10)), BS, 7))


def test_router_reads_the_prompt_of_bodies_pd_prefill_calls_and_generate_calls():
    """The call shapes a KVAwareRouter sees: an ingress' (body, lora), P/D's prefill(kind, body)
    (the body's prompt, not the kind), a handle's generate(prompt, sampling, lora_request)."""
    from types import SimpleNamespace

    from app.kv_routing import _prompt_and_adapter
    from app.openai_requests import ChatCompletionRequest, CompletionRequest

    def call(*args, model_id="", **kwargs):
        return SimpleNamespace(args=args, kwargs=kwargs, metadata=SimpleNamespace(multiplexed_model_id=model_id))

    messages = [{"role": "user", "content": "hello there"}]
    chat = ChatCompletionRequest(model="m", messages=messages)
    completion = CompletionRequest(model="m", prompt="once upon a time")
    prompt, lora = _prompt_and_adapter(call("chat", chat), {})
    assert [m["content"] for m in prompt.messages] == ["hello there"] and lora is None
    assert _prompt_and_adapter(call("completion", completion), {}) == ("once upon a time", None)
    assert _prompt_and_adapter(call(completion, {"lora_int_id": 3}), {}) == ("once upon a time", 3)
    assert _prompt_and_adapter(call("once", {"max_tokens": 4}, {"lora_int_id": 5}), {}) == ("once", 5)
    assert _prompt_and_adapter(call("once", {"max_tokens": 4}), {}) == ("once", None)
    assert _prompt_and_adapter(call(), {}) == (None, None)


# ---- on a cluster ----------------------------------------------------------------------------

KV_YAML = """
applications:
- name: kvrouting
  route_prefix: /
  import_path: app.builder:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: kv, model_source: {base}}}
      engine_kwargs: {{max_model_len: 1024, max_num_seqs: 8, max_num_batched_tokens: 128, num_kv_blocks: 128,
                      enable_lora: true, max_loras: 1, max_lora_rank: 8, show_progress: false}}
      lora_modules: [{{name: kv-adapter, path: {adapter}}}]
      deployment_config:
        num_replicas: 2
        ray_actor_options: {{num_cpus: 0.25}}
        request_router_config:
          request_router_class: "app.kv_routing:KVAwareRouter"
          request_router_kwargs: {{imbalanced_threshold: 2, pending_ttl_s: 1.0}}
          request_routing_stats_period_s: 0.3
"""
WORDS = "alpha beta gamma delta river stone cloud forest paper window garden silver".split()


def _text(rng, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def kv_run(tiny_checkpoint, tmp_path_factory):
    from conftest import serve_run
    from test_lora import _peft_adapter

    base = tiny_checkpoint("llama")
    folder = tmp_path_factory.mktemp("kvrouting")
    _peft_adapter(base, folder / "adapter", seed=1, rank=8, targets=("q_proj", "v_proj"), rslora=False)
    config = folder / "kv.yaml"
    config.write_text(KV_YAML.format(base=base, adapter=folder / "adapter"))
    with serve_run(config, folder, models=("kv",)) as served:
        yield served, base


def _hashes(base, messages: list[dict], lora_int_id: int | None = None) -> list[int]:
    """The engine's block hashes of a chat's prompt (the tiny model's template, block size 16)."""
    from registry.model_info import load_tokenizer
    from runtime.engine.input_processor import InputProcessor

    processor = InputProcessor(load_tokenizer(base, required=True), vocab_size=512, max_model_len=512,
                               max_logprobs=0, max_num_seqs=1)
    return prefix_block_hashes(processor.tokenize(messages)[1], 16, lora_int_id)


def _replica_caches() -> dict[str, set[int]]:
    """Each `kv` replica's published block hashes (asking its actor, as Serve's controller does)."""
    import time

    import ray

    deadline = time.time() + 120
    while True:  # a replica that Serve is (re)starting does not answer yet
        out = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if "SERVE_REPLICA" in entry["name"] and "LLMServer:kv" in entry["name"]:
                try:
                    stats = ray.get(ray.get_actor(entry["name"], namespace=entry["namespace"])
                                    .record_routing_stats.remote(), timeout=10)
                except (ray.exceptions.RayError, ValueError):
                    continue
                out[entry["name"]] = set(stats["servax_kv"]["block_hashes"])
        if len(out) == 2:
            return out
        assert time.time() < deadline, f"2 replicas did not answer in 120 s: {sorted(out)}"
        time.sleep(1)


def _holders(hashes: list[int]) -> list[str]:
    return [name for name, cached in _replica_caches().items() if set(hashes) <= cached]


def _long_running(pool, client, messages, max_tokens: int):
    """Start a streamed request of `max_tokens` tokens; returns its future once its first token
    came (it runs on its replica from then on)."""
    import threading

    started = threading.Event()

    def run():
        stream = client.chat.completions.create(model="kv", messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()

    future = pool.submit(run)
    assert started.wait(60), future.exception()
    return future


def _chat(client, messages, model="kv", max_tokens=2, **kw):
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return reply.choices[0].message.content, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
@pytest.mark.cluster
def test_kv_router_sends_each_follow_up_turn_to_the_replica_holding_its_prefix(kv_run):
    """6 chats x 3 turns on 2 replicas: every follow-up finds its conversation's full blocks
    cached (a load-only router would miss about half of them)."""
    import time

    from conftest import openai_client

    run, base = kv_run
    client = openai_client(run.base_url)
    rng = random.Random(0)
    chats = [[{"role": "user", "content": _text(rng, 20)}] for _ in range(6)]
    missed, previous = [], [None] * len(chats)
    for turn in range(3):
        for i, messages in enumerate(chats):
            # The blocks of the previous turn's prompt but its last (where the template differs).
            before = max(0, len(_hashes(base, previous[i])) - 1) * 16 if turn else 0
            reply, prompt, cached = _chat(client, messages)
            if turn and cached < before:
                missed.append((i, turn, cached, before))
            previous[i] = list(messages)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": _text(rng, 8)}]
        time.sleep(1.5)  # published, and past the router's pending window: the index alone decides
    assert not missed, missed


@pytest.mark.slow
@pytest.mark.cluster
def test_evicted_prefix_stops_attracting_and_load_beats_affinity(kv_run):
    """A chat whose blocks its replica evicted goes to the less loaded replica, not to its old
    one; and a follow-up whose replica's queue is more than imbalanced_threshold (2) longer
    goes to the other replica although that has none of its prefix."""
    import concurrent.futures
    import time

    from conftest import openai_client

    run, base = kv_run
    client = openai_client(run.base_url)
    rng = random.Random(1)

    # Eviction: the chat's replica fills its 128 blocks with other prompts, then holds two long requests.
    chat = [{"role": "user", "content": _text(rng, 60)}]
    _chat(client, chat)
    time.sleep(1.5)
    (holder,) = _holders(_hashes(base, chat))
    flood = []
    while _holders(_hashes(base, chat)):  # other prompts, spread by load, until the holder evicted the chat
        assert len(flood) < 80, "80 other prompts did not evict the chat's blocks"
        for _ in range(10):
            flood.append([{"role": "user", "content": _text(rng, 70)}])
            _chat(client, flood[-1])
        time.sleep(1.5)
    pinned = next(m for m in flood if holder in _holders(_hashes(base, m)))  # the holder has it: affinity
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # 2 requests on the holder: a gap <= 2, affinity decides
        busy = [_long_running(pool, client, pinned, 600) for _ in range(2)]
        follow_up = chat + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": _text(rng, 8)}]
        _chat(client, follow_up)
        assert not all(b.done() for b in busy), "the holder's requests ended before the follow-up was routed"
        time.sleep(0.8)
        assert _holders(_hashes(base, follow_up)) not in ([holder], []), "went to the replica that evicted it"
        for b in busy:
            b.result()

    # Load beats affinity: 3 long requests on the prefix's replica (affinity while the gap is <= 2),
    # then its follow-up (a gap of 3).
    chat = [{"role": "user", "content": _text(rng, 25)}]
    _chat(client, chat)
    time.sleep(1.5)
    (holder,) = _holders(_hashes(base, chat))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        longs = [_long_running(pool, client, chat, 500) for _ in range(3)]
        follow_up = chat + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": _text(rng, 8)}]
        _, _, cached = _chat(client, follow_up)
        assert not all(f.done() for f in longs), "the holder's requests ended before the follow-up was routed"
        time.sleep(0.8)
        assert cached == 0 and _holders(_hashes(base, follow_up)) != [holder]
        for f in longs:
            f.result()


@pytest.mark.slow
@pytest.mark.cluster
def test_kv_router_keys_lora_adapters_apart(kv_run):
    """The same conversation under an adapter and under the base model: separate blocks on the
    replicas (the adapter's turn finds none of the base's), and each one's follow-up finds its own."""
    import time

    from conftest import openai_client

    run, base = kv_run
    client = openai_client(run.base_url)
    rng = random.Random(2)
    for i in range(3):
        chat = [{"role": "user", "content": _text(rng, 30)}]
        _, _, base_cached = _chat(client, chat)
        _, _, adapter_cached = _chat(client, chat, model="kv-adapter")
        assert adapter_cached == 0  # the base's blocks are not the adapter's
        time.sleep(1.5)
        follow_up = chat + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": _text(rng, 8)}]
        for model in ("kv-adapter", "kv"):
            _, prompt, cached = _chat(client, follow_up, model=model)
            assert cached >= (len(_hashes(base, chat)) - 1) * 16, (model, i, cached, prompt)


@pytest.mark.slow
@pytest.mark.cluster
def test_metrics_split_routing_frontend_queue_prefill_and_decode_time(kv_run):
    """GET /metrics: each request's time in Serve's router and handle, in the replica before the
    engine, in the engine's queue, prefill and decode, as histograms beside TTFT."""
    import re

    import httpx

    run, _ = kv_run
    for _ in range(2):
        assert httpx.post(f"{run.base_url}/v1/completions", timeout=60,
                          json={"model": "kv", "prompt": "where does the time go", "max_tokens": 4}).status_code == 200
    text = httpx.get(f"{run.base_url}/metrics", timeout=60).text
    for phase in ("routing", "frontend", "queue", "prefill", "decode"):
        counts = re.findall(rf'^servax:request_{phase}_time_seconds_count{{model_name="kv"}} (\S+)$', text, re.M)
        assert counts and sum(float(c) for c in counts) >= 1, phase
    assert re.search(r'^vllm:request_queue_time_seconds_count\{', text, re.M)
