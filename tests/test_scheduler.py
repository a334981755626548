"""The scheduler without a model: budgets, ordering, chunked prefill, preemption, abort."""

from __future__ import annotations

import pytest

from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.request import Request, RequestStatus
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.scheduler import Scheduler

BS = 4


def make(num_blocks=64, max_num_seqs=4, budget=16, chunked=True):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)


def req(rid, n_prompt, max_tokens=8, start=1, **params):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(rid, list(range(start, start + n_prompt)), sp, eos_token_ids=(0,), block_size=BS,
                   max_model_len=128, sample_seed=0)


def step(s: Scheduler, token=7):
    out = s.schedule()
    s.update_from_output(out, [[token]] * len(out.scheduled))
    return out


def plan(out):
    return [(e.request.request_id, e.num_new_tokens) for e in out.scheduled]


def test_decodes_first_then_waiting_prefills_within_budget():
    s = make(budget=16)
    s.add_request(req("a", 10))
    assert plan(step(s)) == [("a", 10)]
    s.add_request(req("b", 20, start=100))
    out = step(s)
    assert plan(out) == [("a", 1), ("b", 15)] and out.num_scheduled_tokens == 16
    assert plan(step(s)) == [("a", 1), ("b", 5)]  # b's chunked prefill completes
    assert plan(step(s)) == [("a", 1), ("b", 1)]


def test_chunked_prefill_only_samples_on_the_last_chunk():
    s = make(budget=8)
    r = req("a", 20)
    s.add_request(r)
    for expected_computed in (8, 16):
        step(s)
        assert r.num_computed_tokens == expected_computed and r.output_token_ids == []
    step(s)
    assert r.num_computed_tokens == 20 and r.output_token_ids == [7]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make(budget=16, chunked=False)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, start=50))
    assert plan(step(s)) == [("a", 10)]  # b does not fit in the 6 tokens left
    assert plan(step(s)) == [("a", 1), ("b", 10)]


def test_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=2, budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 3, start=10 * i + 1))
    assert [rid for rid, _ in plan(step(s))] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_preempts_the_newest_when_blocks_run_out_and_recomputes_it():
    s = make(num_blocks=7, budget=64)  # 6 usable blocks of 4 tokens
    old, new = req("old", 8, max_tokens=12), req("new", 8, max_tokens=12, start=50)
    s.add_request(old)
    s.add_request(new)
    step(s)  # 2 blocks each
    preempted = []
    while old.status == RequestStatus.RUNNING:
        out = step(s)
        preempted += out.preempted_ids
    assert preempted and set(preempted) == {"new"} and old.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert new.num_preemptions >= 1
    while s.has_unfinished_requests():
        step(s)
    assert new.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(new.output_token_ids) == 12
    assert s.kv.num_free_blocks == 6 and s.num_preemptions >= 1


def test_abort_frees_everything():
    s = make()
    s.add_request(req("a", 10))
    s.add_request(req("b", 3, start=40))
    step(s)
    assert s.kv.num_free_blocks < 63
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 63 and not s.has_unfinished_requests()
    assert s.schedule().is_empty


def test_status_is_an_explicit_state_machine():
    r = req("a", 3)
    assert r.status == RequestStatus.WAITING
    with pytest.raises(RuntimeError):
        r.set_status(RequestStatus.PREEMPTED)
    r.set_status(RequestStatus.RUNNING)
    r.set_status(RequestStatus.FINISHED_STOPPED)
    with pytest.raises(RuntimeError):
        r.set_status(RequestStatus.RUNNING)
    assert r.status.finish_reason == "stop"


def test_stop_checks_respect_min_tokens():
    s = make()
    r = req("a", 3, max_tokens=5, min_tokens=2, stop_token_ids=[9])
    s.add_request(r)
    step(s, token=9)  # below min_tokens: not a stop
    assert not r.is_finished
    step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_prompt_logprob_prefill_takes_one_slot_per_token():
    s = make(max_num_seqs=4, budget=64)
    r = req("a", 6, prompt_logprobs=1)
    s.add_request(r)
    out = s.schedule()
    assert plan(out) == [("a", 4)] and out.num_slots == 4
