"""Async scheduling (runtime/engine/core.py step(), Scheduler.advance / settle): the next
step is scheduled and dispatched before the tokens of the one in flight are on the host.
It must give exactly the tokens, finish reasons and block accounting of synchronous steps,
under stops it could not foresee, preemption and requests that need their tokens on the host."""

from __future__ import annotations

import random

import pytest

from app import LLM, SamplingParams
from runtime.engine.request import PENDING_TOKEN, prefix_block_hashes

MODEL = "servax-tiny/llama"
SMALL = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, show_progress=False)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 40 blocks of 16 tokens: fewer than 16 running sequences of up to ~150 tokens need (preemption).
    return LLM(MODEL, num_kv_blocks=40, **SMALL)


def run(llm: LLM, prompts, params, *, ahead: bool | None) -> tuple[list, int]:
    """(outputs, steps scheduled before the one in flight was collected) with
    EngineConfig.async_scheduling `ahead`."""
    engine = llm.engine
    advance, ahead_steps = engine.scheduler.advance, []
    engine.scheduler.advance = lambda output: (ahead_steps.append(1), advance(output))[1]
    setting, engine.ahead.setting = engine.ahead.setting, ahead
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        engine.scheduler.advance = advance
        engine.ahead.setting = setting
    return outs, len(ahead_steps)


def summary(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


def assert_all_blocks_free(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0
    assert not llm.engine.kv.req_to_blocks


def test_by_default_steps_run_ahead_while_they_are_short(llm):
    """The default (async_scheduling None) runs ahead while steps take at most max_step_s
    (offline: always; serving: AHEAD_MAX_STEP_S), not when they take longer; True / False force
    it; an engine that cannot run ahead refuses True."""
    from runtime.engine.runner import AHEAD_MAX_STEP_S, AheadPolicy

    ahead = llm.engine.ahead
    assert ahead.setting is None and ahead.supported and ahead.max_step_s == float("inf")
    prompts, params = [[5, 6, 7] * 4] * 3, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert run(llm, prompts, params, ahead=None)[1] > 0
    ahead.max_step_s = 0.0  # every step is longer
    try:
        assert run(llm, prompts, params, ahead=None)[1] == 0 and run(llm, prompts, params, ahead=True)[1] > 0
    finally:
        ahead.max_step_s = float("inf")
    assert AheadPolicy(None, supported=True).max_step_s == AHEAD_MAX_STEP_S
    slow = AheadPolicy(None, supported=True)
    slow.step_seconds = 1.0
    assert not slow.wanted and AheadPolicy(True, supported=True).wanted
    assert not AheadPolicy(True, supported=False).wanted and not AheadPolicy(False, supported=True).wanted
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(MODEL, loaded_model=llm.engine.model, async_scheduling=True, num_kv_blocks=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, **SMALL)


def test_async_steps_equal_synchronous_ones_under_unforeseen_stops_and_preemption(llm):
    """Stop tokens taken from each request's own greedy continuation end it mid-way (the step
    already dispatched for it is dropped), min_tokens and max_tokens end others; the KV budget
    forces preemptions of requests whose newest token is still on the device."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(5, 100))] for _ in range(24)]
    free = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 48), ignore_eos=True) for _ in prompts]
    reference, _ = run(llm, prompts, free, ahead=False)
    params = []
    for i, (out, p) in enumerate(zip(reference, free)):
        ids = out.outputs[0].token_ids
        kind = i % 3
        if kind == 0 and len(ids) > 3:  # ends at a token it will generate (unless min_tokens holds it)
            params.append(SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=[ids[len(ids) // 2]],
                                         min_tokens=i % 2))
        elif kind == 1:  # seeded sampling: the same draws whichever way the steps are scheduled
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=p.max_tokens, ignore_eos=True))
        else:
            params.append(p)
    sync, none_ahead = run(llm, prompts, params, ahead=False)
    preemptions = llm.engine.stats().num_preemptions
    asynchronous, ahead = run(llm, prompts, params, ahead=True)
    assert none_ahead == 0 and ahead > 0
    assert summary(asynchronous) == summary(sync)
    assert any(o.outputs[0].finish_reason == "stop" for o in sync)
    assert llm.engine.stats().num_preemptions > preemptions  # the async run preempted too
    assert_all_blocks_free(llm)
    assert llm.engine.stats().compilations_since_warmup == 0


def test_pending_tokens_never_reach_outputs_or_prefix_hashes(llm):
    """Every finished request's tokens are real and its blocks' prefix-cache keys are those
    of its real tokens (a block holding a pending token is hashed once the token is known)."""
    finished = []
    finish = llm.engine.scheduler.finish_request

    def recording_finish(*args, **kwargs):
        request = finish(*args, **kwargs)
        finished.append(request)
        return request

    llm.engine.scheduler.finish_request = recording_finish
    try:
        prompts = [[7 + i] * (13 + 5 * i) for i in range(6)]
        outs, ahead = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), ahead=True)
    finally:
        llm.engine.scheduler.finish_request = finish
    assert ahead > 0 and len(finished) == len(prompts)
    for request in finished:
        assert PENDING_TOKEN not in request.all_token_ids
        assert request.block_hashes == prefix_block_hashes(request.all_token_ids, request.block_size)
    for out in outs:
        assert PENDING_TOKEN not in out.outputs[0].token_ids and len(out.outputs[0].token_ids) == 40


def test_requests_that_need_their_tokens_on_the_host_step_synchronously(llm):
    """Penalties, allowed token ids (a token mask) and plain requests in one batch: the steps
    that hold the former wait for their tokens; every request gets the tokens it gets alone."""
    prompts = [[11, 12, 13, 14] * 3, [21, 22] * 9, [31] * 7, [41, 42, 43] * 5]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, allowed_token_ids=[5, 9, 77, 300]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    alone = [summary(run(llm, [p], [sp], ahead=False)[0])[0] for p, sp in zip(prompts, params)]
    together, ahead = run(llm, prompts, params, ahead=True)
    assert summary(together) == alone
    assert all(set(t) <= {5, 9, 77, 300} for t in [together[1].outputs[0].token_ids])
    assert ahead > 0  # the plain request's last steps, once the others had finished
    assert_all_blocks_free(llm)
