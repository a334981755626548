"""Prefill/decode disaggregation at the engine (#44, runtime/engine/kv_transfer.py): a prefill
engine computes the prompt and first token and exports the blocks; a decode engine imports them
and continues; the tokens equal one engine's, greedy and seeded, for short, chunked and
prefix-hit prompts; no block is left held and nothing compiles while serving."""

from __future__ import annotations

import random

import pytest

from app import LLM, SamplingParams
from runtime.engine.kv_transfer import ExportKV, KVTransfer

SETTINGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=128, block_size=8,
                show_progress=False)
PROMPTS = [[random.Random(n).randrange(4, 500) for _ in range(n)] for n in (5, 23, 150)]  # 150: chunked


@pytest.fixture(scope="module")
def engines():
    colocated = LLM("servax-tiny/llama", **SETTINGS)
    prefill = LLM("servax-tiny/llama", loaded_model=colocated.engine.model, **SETTINGS)
    decode = LLM("servax-tiny/llama", loaded_model=colocated.engine.model, **SETTINGS)
    for llm in (prefill, decode):
        llm.engine.enable_kv_transfer()
    yield colocated.engine, prefill.engine, decode.engine
    for llm in (colocated, prefill, decode):
        llm.shutdown()


def run(engine, rid: str, prompt: list[int], params: SamplingParams, kv_transfer=None):
    processed = engine.process_inputs(rid, {"prompt_token_ids": prompt}, params)
    processed.kv_transfer = kv_transfer
    engine.add_processed(processed)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def pd(prefill, decode, rid: str, prompt: list[int], params: SamplingParams):
    first = run(prefill, rid, prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), ExportKV())
    transfer = prefill.kv_transfer.take(rid)
    assert isinstance(transfer, KVTransfer) and transfer.first_token_id == first.outputs[0].token_ids[0]
    assert transfer.prompt_token_ids == prompt and len(transfer.blocks) == -(-len(prompt) // 8)
    if first.outputs[0].logprobs:  # what app/pd.py's prefill replica adds from the request's output
        transfer.first_logprobs = first.outputs[0].logprobs[0]
    return run(decode, rid, prompt, params, transfer), transfer


def test_pd_engines_match_one_engine_greedy_seeded_chunked_and_prefix_hits(engines):
    colocated, prefill, decode = engines
    cases = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=2)]
    for i, params in enumerate(cases):
        for j, prompt in enumerate(PROMPTS + PROMPTS[-1:]):  # the last again: a prefix hit on both sides
            want = run(colocated, f"c{i}{j}", prompt, params)
            got, transfer = pd(prefill, decode, f"p{i}{j}", prompt, params)
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, (i, j)
            assert got.outputs[0].text == want.outputs[0].text
            assert got.num_cached_tokens == want.num_cached_tokens, (i, j)
            if params.logprobs:
                assert [sorted(e) for e in got.outputs[0].logprobs] == [sorted(e) for e in want.outputs[0].logprobs]
                assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)
            if j == len(PROMPTS):
                assert transfer.num_cached_tokens > 0
    for engine in (prefill, decode):
        s = engine.stats()
        assert s.kv_blocks_used == 0 and not engine.kv.req_to_blocks and s.num_running == s.num_waiting == 0
        assert s.compilations_since_warmup == 0
    assert prefill.kv_transfer.num_pending_exports == 0
    assert decode.kv_transfer.num_imported == 2 * (len(PROMPTS) + 1)
    assert decode.stats().prefix_cache_hits > 0  # the repeated prompt's imported blocks were cached


def test_an_export_whose_reader_left_is_dropped_not_kept(engines):
    """A prefill replica's reader can go away (a disconnect) after the engine thread finished the
    request and stored its export, before the reader saw it: the abort its stream posts then
    drops the export. A request aborted while it runs exports nothing."""
    _, prefill, _ = engines
    mover = prefill.kv_transfer
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for rid, abort_first in (("gone", False), ("aborted", True)):
        processed = prefill.process_inputs(rid, {"prompt_token_ids": PROMPTS[1]}, params)
        processed.kv_transfer = ExportKV()
        prefill.add_processed(processed)
        if abort_first:
            prefill.abort_request(rid)
        while prefill.has_unfinished_requests():
            prefill.step()
        assert mover.num_pending_exports == (0 if abort_first else 1)
        prefill.abort_request(rid)  # what AsyncLLMEngine.generate posts when its reader leaves early
        assert mover.num_pending_exports == 0 and mover.take(rid) is None
    assert prefill.stats().kv_blocks_used == 0
    # and a taken export still comes through
    assert run(prefill, "kept", PROMPTS[0], params, ExportKV()) is not None
    assert mover.take("kept") is not None and mover.num_pending_exports == 0


def test_a_16_bit_cache_moves_as_it_is_kept():
    """kv_cache_dtype bfloat16 on CPU (kept as uint16 bits): the blocks move as they are kept and
    the decode engine's greedy tokens equal one engine's with the same cache; nothing is left held."""
    engines = [LLM("servax-tiny/llama", kv_cache_dtype="bfloat16", **SETTINGS) for _ in range(3)]
    colocated, prefill, decode = (llm.engine for llm in engines)
    for engine in (prefill, decode):
        engine.enable_kv_transfer()
    assert decode.programs.kv_cache.half_bits == "bfloat16"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for j, prompt in enumerate(PROMPTS):
        want = run(colocated, f"c{j}", prompt, params)
        got, transfer = pd(prefill, decode, f"p{j}", prompt, params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, j
    for engine in (prefill, decode):
        assert engine.stats().kv_blocks_used == 0 and not engine.kv.req_to_blocks
    for llm in engines:
        llm.shutdown()
