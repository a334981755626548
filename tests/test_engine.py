"""The engine core: batching invariance, preemption, chunked prefill, prefix cache, no
recompilation, block accounting, seeded sampling across batch mixes, abort."""

from __future__ import annotations

import dataclasses

import random

import pytest

from app import LLM, SamplingParams
from conftest import wait_idle
from runtime.engine.core import Engine

MODEL = "servax-tiny/llama"
MAX_LEN = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SMALL = dict(max_model_len=MAX_LEN, max_num_seqs=16, max_num_batched_tokens=128, show_progress=False)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, num_kv_blocks=512, **SMALL)


def make_engine(llm: LLM, **overrides) -> LLM:
    """Another engine on the same loaded weights (no reload)."""
    return LLM(MODEL, loaded_model=llm.engine.model, **dict(SMALL, **overrides))


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randint(5, 120))] for _ in range(n)]


@pytest.fixture(scope="module")
def prompts64() -> list[list[int]]:
    return mixed_prompts(64)


@pytest.fixture(scope="module")
def alone64(llm, prompts64) -> list[list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts64]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(engine: Engine) -> None:
    s = engine.stats()
    assert s.kv_blocks_used == 0 and s.kv_blocks_free == s.kv_blocks_total
    assert s.num_running == 0 and s.num_waiting == 0
    assert not engine.kv.req_to_blocks


def test_batched_greedy_equals_alone(llm, prompts64, alone64):
    assert tokens(llm.generate(prompts64, GREEDY)) == alone64
    assert_all_blocks_free(llm.engine)


def test_batched_greedy_equals_alone_under_preemption(llm, prompts64, alone64):
    # 40 blocks of 16 tokens: fewer than 16 running sequences of up to 136 tokens need.
    small = make_engine(llm, num_kv_blocks=40)
    assert tokens(small.generate(prompts64, GREEDY)) == alone64
    assert small.engine.stats().num_preemptions > 0
    assert_all_blocks_free(small.engine)
    assert small.engine.stats().compilations_since_warmup == 0


def test_batched_greedy_equals_alone_with_chunked_prefill(llm, prompts64, alone64):
    chunked = make_engine(llm, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=512)
    outs = chunked.generate(prompts64, GREEDY)
    assert tokens(outs) == alone64
    assert_all_blocks_free(chunked.engine)



def test_prefix_cache_reuses_blocks(llm):
    engine = llm.engine
    prefix = list(range(100, 220))
    a = prefix + [11, 12, 13]
    b = prefix + [21, 22]
    alone_b = make_engine(llm, enable_prefix_caching=False, num_kv_blocks=512).generate([b], GREEDY)[0]
    before = engine.stats()
    llm.generate([a], GREEDY)
    mid = engine.stats()
    out_b = llm.generate([b], GREEDY)[0]
    after = engine.stats()
    assert after.prefix_cache_hits - mid.prefix_cache_hits == 112  # 7 full blocks of 16
    assert out_b.num_cached_tokens == 112
    assert after.prefix_cache_hit_rate > 0 and mid.prefix_cache_queries > before.prefix_cache_queries
    assert out_b.outputs[0].token_ids == alone_b.outputs[0].token_ids
    assert_all_blocks_free(engine)


def test_prefix_cache_off_has_no_hits(llm):
    off = make_engine(llm, enable_prefix_caching=False, num_kv_blocks=512)
    p = mixed_prompts(1, seed=2)[0]
    off.generate([p, p], GREEDY)
    off.generate([p], GREEDY)
    assert off.engine.stats().prefix_cache_hits == 0


def test_no_compilation_after_warmup_under_random_workload(llm):
    rng = random.Random(3)
    for _ in range(3):
        batch = mixed_prompts(rng.randint(1, 40), seed=rng.randrange(1000))
        params = [
            SamplingParams(
                temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8]),
                min_p=rng.choice([0.0, 0.1]), repetition_penalty=rng.choice([1.0, 1.2]),
                presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, 0.3]),
                max_tokens=rng.randint(1, 24), logprobs=rng.choice([None, 2]), seed=rng.choice([None, 5]),
                n=rng.choice([1, 1, 2]), prompt_logprobs=rng.choice([None, None, None, 1]),
                logit_bias=rng.choice([None, {3: 2.0}]), stop=rng.choice([None, ["e"]]),
            )
            for _ in batch
        ]
        llm.generate(batch, params)
    assert llm.engine.stats().compilations_since_warmup == 0
    assert_all_blocks_free(llm.engine)


def test_seeded_sampling_is_independent_of_batch_mix(llm):
    target = [10, 20, 30, 40, 50]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([target], sp)[0].outputs[0].token_ids
    others = mixed_prompts(9, seed=4)
    mix = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 9
    outs = llm.generate(others[:4] + [target] + others[4:], mix[:4] + [sp] + mix[4:])
    assert outs[4].outputs[0].token_ids == alone
    unseeded = llm.generate([target] * 2, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_abort_frees_blocks(llm):
    engine = llm.engine
    free0 = engine.stats().kv_blocks_free
    for i, p in enumerate(mixed_prompts(6, seed=5)):
        engine.add_request(f"abort-{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks_free < free0
    outs = engine.abort_request([f"abort-{i}" for i in range(6)])
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_blocks_free == free0
    assert engine.step() == []


def test_streaming_deltas_add_up(llm):
    engine = llm.engine
    engine.add_request("stream", "Hello world! How are you", SamplingParams(temperature=0, max_tokens=20,
                                                                             ignore_eos=True, stop=["zzz"]))
    text, ids, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].delta_text
            ids += out.outputs[0].delta_token_ids
            last = out
    assert last.finished and text == last.outputs[0].text and ids == last.outputs[0].token_ids


# -- AsyncLLMEngine ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def async_engine(llm):
    from runtime import AsyncLLMEngine, EngineConfig

    engine = AsyncLLMEngine(EngineConfig(model=MODEL, num_kv_blocks=512, **SMALL), llm.engine.model)
    yield engine
    engine.shutdown()


def test_stats_give_up_instead_of_waiting_inside_a_stuck_step(async_engine):
    """Stats read with a timeout give up inside a step that never ends (a hung worker of a
    multi-process engine); the gauges' stats (latest_stats, read on the replica's event loop
    after every request and by health checks) never wait at all. Here the loop's lock is held
    as a stuck step would hold it."""
    import time

    assert async_engine.stats(timeout=1.0).num_running == 0
    with async_engine._engine_lock:
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="inside one step"):
            async_engine.stats(timeout=0.2)
        assert time.perf_counter() - t0 < 1.0
        t0 = time.perf_counter()
        assert async_engine.latest_stats().num_running == 0
        assert time.perf_counter() - t0 < 0.01
        async_engine.check_health()  # answers too (a single-process engine has no workers to check)


def test_async_request_joins_the_step_after_the_one_in_flight(async_engine):
    """A request that arrives while a step runs is scheduled in the very next step (the loop
    adds it between collecting that step and scheduling the next), not one step later: a
    whole step less of time to first token under load. Here the step in flight is held in
    `collect` until the request has been posted. (With async scheduling the next step is
    dispatched before the one in flight is collected, so the request joins the step after
    that: the engine steps synchronously here.)"""
    import asyncio
    import threading

    engine, runner = async_engine.engine, async_engine.engine.runner
    held, posted = threading.Event(), threading.Event()
    dispatched: list[set[str]] = []
    collect_, dispatch_ = runner.collect, runner.dispatch

    def holding_collect(step):
        if not held.is_set():
            held.set()
            assert posted.wait(10)
        return collect_(step)

    def recording_dispatch(sched, block_ids, prev=None):
        dispatched.append({e.request.request_id for e in sched.scheduled})
        return dispatch_(sched, block_ids, prev)

    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        first = asyncio.ensure_future(collect(async_engine, "the first request", long, "first"))
        await asyncio.to_thread(held.wait, 10)  # step 1 (first's prefill) is in flight, its collect held
        assert len(dispatched) == 1 and dispatched[0] == {"first"}
        second = asyncio.ensure_future(collect(async_engine, "the second request", long, "second"))
        while not async_engine._commands:  # posted to the loop
            await asyncio.sleep(0.001)
        posted.set()
        return await first, await second

    runner.collect, runner.dispatch = holding_collect, recording_dispatch
    setting, engine.ahead.setting = engine.ahead.setting, False
    try:
        first, second = asyncio.run(main())
    finally:
        runner.collect, runner.dispatch = collect_, dispatch_
        engine.ahead.setting = setting
    assert first[-1].finished and second[-1].finished
    assert "second" in dispatched[1], dispatched[:3]  # the step right after the one in flight
    wait_idle(async_engine)


async def collect(engine, prompt, params, request_id):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


def test_async_streams_match_offline_greedy(async_engine, prompts64, alone64):
    import asyncio

    async def main():
        return await asyncio.gather(*(collect(async_engine, p, GREEDY, f"a{i}") for i, p in enumerate(prompts64[:12])))

    results = asyncio.run(main())
    for outs, want in zip(results, alone64[:12]):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == want
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == want
        assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    s = async_engine.stats()
    assert s.compilations_since_warmup == 0 and s.kv_blocks_used == 0


def test_async_step_outputs_reach_a_loop_in_one_wake_up(async_engine, prompts64):
    """8 streams decoding together on one event loop: each engine step hands its outputs over in
    one call_soon_threadsafe, not one per request."""
    import asyncio

    from runtime.engine import async_engine as module

    batches = []

    async def main():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if callback is module._deliver:
                batches.append(len(args[0]))
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        params = dataclasses.replace(GREEDY, max_tokens=12, ignore_eos=True)
        return await asyncio.gather(*(collect(async_engine, prompts64[0], params, f"w{i}") for i in range(8)))

    results = asyncio.run(main())
    assert all(outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12 for outs in results)
    # one output per request and token handed over (a consumer that lags merges what it finds queued)
    assert sum(batches) == 8 * 12 and sum(len(outs) for outs in results) <= sum(batches)
    assert max(batches) == 8 and len(batches) < sum(batches) / 2, batches


def test_async_slow_consumer_gets_merged_deltas(async_engine):
    """A consumer that falls behind gets fewer snapshots whose deltas still add up exactly."""
    import asyncio
    import time

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2, logprobs=2)

    async def slow():
        outs = []
        async for out in async_engine.generate("a slow reader", params, "slow"):
            outs.append(out)
            time.sleep(0.05)  # block the loop: several engine steps land meanwhile
        return outs

    outs = asyncio.run(slow())
    final = outs[-1]
    assert final.finished and len(outs) < 40, "a lagging consumer must see merged snapshots"
    for c in final.outputs:
        mine = [o.outputs[c.index] for o in outs]
        assert sum((m.delta_token_ids for m in mine), []) == c.token_ids and len(c.token_ids) == 40
        assert "".join(m.delta_text for m in mine) == c.text
        assert sum((m.delta_logprobs for m in mine), []) == c.logprobs
    wait_idle(async_engine)


def test_async_consumer_cancel_and_abort_free_blocks(async_engine):
    import asyncio

    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        agen = async_engine.generate([1, 2, 3, 4, 5], long, "cancel-me")
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()  # the client went away

        async def consume():
            return await collect(async_engine, [6, 7, 8], long, "kill-me")

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        await async_engine.abort("kill-me")
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(async_engine)


def test_async_errors_raise_before_first_output(async_engine):
    import asyncio

    from runtime.engine.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError

    async def first(prompt, params, rid):
        async for out in async_engine.generate(prompt, params, rid):
            return out

    with pytest.raises(PromptTooLongError):
        asyncio.run(first([1] * 300, GREEDY, "too-long"))
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(first([1, 2], SamplingParams(logprobs=1000), "bad"))
    assert e.value.param == "logprobs"
    # Idle: max_num_seqs requests start at the next step and max_queue_size wait; one more is refused.
    capacity = async_engine.config.max_num_seqs + async_engine.config.max_queue_size
    async_engine.engine.process_inputs("x", [1, 2], GREEDY, num_pending=capacity - 1)
    with pytest.raises(EngineOverloadedError):
        async_engine.engine.process_inputs("x", [1, 2], GREEDY, num_pending=capacity)
    async_engine.check_health()
    assert async_engine.model_config["max_model_len"] == MAX_LEN


def test_async_shutdown_marks_engine_dead(llm):
    from runtime import AsyncLLMEngine, EngineConfig
    from runtime.engine.errors import EngineDeadError

    engine = AsyncLLMEngine(EngineConfig(model=MODEL, num_kv_blocks=512, **SMALL), llm.engine.model)
    engine.check_health()
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_async_loop_death_is_reported(llm):
    import asyncio

    from runtime import AsyncLLMEngine, EngineConfig
    from runtime.engine.errors import EngineDeadError

    engine = AsyncLLMEngine(EngineConfig(model=MODEL, num_kv_blocks=512, **SMALL), llm.engine.model)

    def broken_step():
        raise RuntimeError("device fell over")

    engine.engine.step = broken_step
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, [1, 2, 3], GREEDY, "doomed"))
    with pytest.raises(EngineDeadError, match="device fell over"):
        engine.check_health()
    engine.shutdown()


def test_buckets_cover_every_step_and_pad_mixed_steps_by_at_most_half():
    """Every (tokens, rows) a step can have lands in a precompiled bucket (step_buckets lists
    all step_bucket returns), and from 128 tokens up a step pads by less than half: 32 decodes
    and a 100-token prompt (131 tokens) run as 192, not 256."""
    from runtime.engine.plan import packed_weight_buckets, step_bucket, step_buckets, token_buckets, seq_buckets

    tokens, seqs = token_buckets(512), seq_buckets(32)
    assert tokens == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512] and seqs == [8, 16, 32]
    assert token_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert token_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 300]
    assert step_bucket(131, 32, tokens, seqs) == (192, 32)
    packed = packed_weight_buckets(tokens, seqs)  # where padding rows cost the products nothing
    assert packed == ([1, 16, 32, 64, 128, 192, 256, 384, 512], [1, 8, 16, 32])
    assert packed_weight_buckets(token_buckets(8), seq_buckets(4)) == ([1, 8], [1, 4])
    assert step_bucket(1, 1, *packed) == (1, 1) and step_bucket(5, 1, *packed) == (16, 1)
    for tokens, seqs in ((tokens, seqs), packed):
        compiled = set(step_buckets(tokens, seqs))
        for n in range(1, 513):
            for rows in range(1, min(n, 32) + 1):
                t, s = step_bucket(n, rows, tokens, seqs)
                assert (t, s) in compiled and t >= n and s >= rows
                if n >= 128:
                    assert t < 1.5 * n + 1, (n, t)


def test_compile_in_background_serves_from_the_largest_bucket_meanwhile(llm, prompts64, alone64, monkeypatch):
    """compile_in_background: the engine is ready once the largest bucket and its sampler are
    compiled; while the others compile (held back here), steps run padded to the largest and
    give the same tokens; a request with penalties waits for its sampler; afterwards every
    bucket is compiled, and the engine's own thread compiled nothing all along."""
    import threading

    from runtime.engine.compilation import BucketPrograms

    go = threading.Event()
    compile_later = BucketPrograms._compile_later

    def held_back(self, keys):
        go.wait(60)
        compile_later(self, keys)

    monkeypatch.setattr(BucketPrograms, "_compile_later", held_back)
    bg = make_engine(llm, num_kv_blocks=512, compile_in_background=True)
    programs = bg.engine.programs
    largest = bg.engine.plan.largest_bucket
    assert programs.compiling_in_background and len(bg.engine.plan.bucket_pairs) > 1
    assert programs.compiled.ready == {("step", *largest), ("sampler", largest[1], False)}
    assert tokens(bg.generate(prompts64[:6], GREEDY)) == alone64[:6]  # all padded to the largest bucket
    assert programs.compiled.ready == {("step", *largest), ("sampler", largest[1], False)}

    penalized = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.5)
    want = llm.generate([prompts64[0]], penalized)[0].outputs[0].token_ids
    threading.Timer(0.5, go.set).start()  # the penalties sampler compiles once the thread goes on
    assert bg.generate([prompts64[0]], penalized)[0].outputs[0].token_ids == want
    assert programs.wait_compiled(120) and not programs.compiling_in_background
    assert {("step", t, s) for t, s in bg.engine.plan.bucket_pairs} <= programs.compiled.ready
    assert tokens(bg.generate(prompts64[:6], GREEDY)) == alone64[:6]
    assert bg.engine.stats().compilations_since_warmup == 0
    assert_all_blocks_free(bg.engine)


def test_a_failed_background_compilation_is_reported_and_serving_goes_on(llm, prompts64, alone64, monkeypatch,
                                                                          caplog):
    """A program that fails to compile in the background is logged; the buckets compiled keep
    serving (the same tokens) and waiting for the background work ends."""
    import threading

    from runtime.engine.compilation import BucketPrograms

    go = threading.Event()
    compile_later = BucketPrograms._compile_later
    monkeypatch.setattr(BucketPrograms, "_compile_later", lambda self, keys: (go.wait(60), compile_later(self, keys)))
    bg = make_engine(llm, num_kv_blocks=512, compile_in_background=True)
    compiling, lower = bg.engine.programs.compiled, bg.engine.programs.compiled._lower

    def lower_but_one(key, seen):
        if key[0] == "step" and key[1] == 16:
            raise RuntimeError("this program does not compile")
        return lower(key, seen)

    compiling._lower = lower_but_one
    go.set()
    assert bg.engine.programs.wait_compiled(120)
    assert bg.engine.programs.compiling_in_background and isinstance(compiling.error, RuntimeError)
    assert "compiling in the background failed" in caplog.text
    assert ("step", 1, 1) in compiling.ready and not any(k[0] == "step" and k[1] == 16 for k in compiling.ready)
    assert tokens(bg.generate(prompts64[:4], GREEDY)) == alone64[:4]
    assert bg.engine.stats().compilations_since_warmup == 0
    assert_all_blocks_free(bg.engine)
