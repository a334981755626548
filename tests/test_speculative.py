"""N-gram speculative decoding: vLLM's proposal rule and config, greedy outputs identical with
and without speculation under batching, chunked prefill, prefix caching and preemption, the
same sampled tokens per seed and the same distribution, logprobs and stop strings, metrics."""

from __future__ import annotations

import random

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from scipy.stats import chi2_contingency

from app import LLM, SamplingParams
from runtime.engine.config import EngineConfig
from runtime.engine.speculative import (AcceptanceHistory, DraftPolicy, SpeculativeConfig, accept_drafts,
                                 candidate_draft_lengths, propose_ngram)

MODEL = "servax-tiny/llama"
SMALL = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, show_progress=False)
# Drafts every time one is found (as vLLM), so that what is tested does not hang on timings.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive_drafts": False}


def brute_force_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule spelled out: the longest suffix n-gram that occurs earlier, its earliest occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tokens[-n:]:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_proposal_is_vllms_rule():
    # vLLM's docstring example: [4,2,3] cannot be found, [2,3] is, and 3 tokens follow it.
    assert propose_ngram(np.array([1, 2, 3, 4, 2, 3]), min_n=2, max_n=3, k=4) == [4, 2, 3]
    assert propose_ngram(np.array([1, 2, 3, 4, 1, 2, 3, 5, 6]), min_n=2, max_n=2, k=2) == []
    assert propose_ngram(np.array([7, 7, 7]), min_n=1, max_n=3, k=2) == [7]  # overlapping match
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=rng.integers(1, 40)).tolist()
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 3)), int(rng.integers(1, 6))
        assert propose_ngram(np.array(tokens), min_n=lo, max_n=hi, k=k) == brute_force_proposal(tokens, lo, hi, k)


def test_accepted_drafts_are_the_draws_up_to_the_first_miss():
    assert accept_drafts([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_drafts([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted: a bonus token
    assert accept_drafts([5, 6, 7], [4, 6, 7, 1]) == [4]


def test_draft_policy_drafts_only_what_pays():
    cpu = DraftPolicy(7, {1: 1.6, 3: 2.0, 7: 2.2})  # step costs as a 2-core CPU measures them
    fresh, good, bad = AcceptanceHistory(), AcceptanceHistory(), AcceptanceHistory()
    assert cpu.draft_length(fresh, room=15) == 7  # optimistic until it has evidence
    assert cpu.draft_length(fresh, room=5) == 5  # never more than fits the step
    for _ in range(4):
        good.observe(drafted=7, accepted=6)
        bad.observe(drafted=3, accepted=0)
    assert good.rate() > 0.8 and cpu.draft_length(good, room=15) == 7
    assert bad.rate() < 0.3 and cpu.draft_length(bad, room=15) == 0  # a plain step is cheaper
    steps = 0
    while cpu.draft_length(bad, room=15) == 0:  # silence makes it try again, with a short draft
        bad.decay()
        steps += 1
    assert 10 < steps < 100 and cpu.draft_length(bad, room=15) < 7
    # Where verification is as cheap as a plain step (an accelerator), every draft pays.
    assert DraftPolicy(4).draft_length(bad, room=15) == 4
    assert candidate_draft_lengths(16) == [1, 3, 7, 15, 16] and candidate_draft_lengths(3) == [1, 3]


def test_speculative_config_as_vllm_reads_it():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_min == 5
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig(model="[ngram]", num_speculative_tokens=2).method == "ngram"
    cfg = EngineConfig(model=MODEL, speculative_config=NGRAM)
    assert cfg.speculative_config.num_speculative_tokens == 4
    for bad, message in [
        (dict(NGRAM, prompt_lookup_min=4), "prompt_lookup_min=4 must be <= prompt_lookup_max=3"),
        (dict(NGRAM, method="eagle"), "speculative method 'eagle' is not supported"),
        ({"num_speculative_tokens": 2}, "needs method='ngram'"),
        (dict(NGRAM, num_speculative_tokens=0), "greater than 0"),
        (dict(NGRAM, model="some/draft-model"), "uses no draft model"),
        (dict(NGRAM, prompt_lookup_maximum=2), "Extra inputs are not permitted"),
    ]:
        with pytest.raises(ValidationError, match=message):
            EngineConfig(model=MODEL, speculative_config=bad)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(MODEL, num_kv_blocks=512, **SMALL)


def speculative(plain: LLM, **overrides) -> LLM:
    """An engine with n-gram speculation on the plain engine's weights."""
    settings = dict(SMALL, num_kv_blocks=512, speculative_config=NGRAM)
    return LLM(MODEL, loaded_model=plain.engine.model, **dict(settings, **overrides))


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that quote themselves (a phrase repeated with variations), as code edits do."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(4, 500) for _ in range(rng.randint(3, 8))]
        out.append((phrase * rng.randint(2, 6))[:120] + phrase[:rng.randint(1, len(phrase))])
    return out


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randint(5, 120))] for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0 and not llm.engine.kv.req_to_blocks


def test_speculative_greedy_equals_plain_on_64_mixed_requests_with_preemption(plain):
    prompts = [p for pair in zip(repetitive_prompts(32, 1), mixed_prompts(32, 2)) for p in pair]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i % 29, ignore_eos=True) for i in range(64)]
    want = tokens(plain.generate(prompts, params))
    # 40 blocks of 16 tokens hold fewer than the 16 running sequences need: preemption, and
    # 128-token steps split the longer prompts (chunked prefill); repeated phrases hit the prefix cache.
    spec = speculative(plain, num_kv_blocks=40)
    assert tokens(spec.generate(prompts, params)) == want
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_accepted_per_position) == stats.spec_decode_num_accepted_tokens
    # Fewer steps than tokens: accepted drafts are tokens that took no step of their own.
    assert stats.generation_tokens_total == sum(len(t) for t in want)
    assert stats.compilations_since_warmup == 0
    assert_all_blocks_free(spec)
    print(f"\n64 requests: {stats.spec_decode_num_drafts} verifications, {stats.spec_decode_num_draft_tokens} drafts, "
          f"{stats.spec_decode_num_accepted_tokens} accepted ({stats.spec_decode_num_accepted_tokens / max(1, stats.spec_decode_num_draft_tokens):.0%}), "
          f"per position {stats.spec_decode_accepted_per_position}, {stats.num_preemptions} preemptions")


def test_speculative_seeded_sampling_draws_the_same_tokens(plain):
    spec = speculative(plain)
    prompts = repetitive_prompts(12, 3)
    # Low temperatures: the tiny random model is predictable enough there for drafts to be accepted.
    params = [SamplingParams(temperature=[0.1, 0.3, 0.6][i % 3], top_k=[0, 8, 40][i % 4 % 3], top_p=[1.0, 0.9][i % 2], seed=100 + i,
                             max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.2 if i % 4 == 0 else 1.0,
                             frequency_penalty=0.5 if i % 4 == 1 else 0.0) for i in range(12)]
    assert tokens(spec.generate(prompts, params)) == tokens(plain.generate(prompts, params))
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0


def test_speculative_sampling_keeps_the_token_distribution(plain):
    """Two independent samples (disjoint seeds) of 6-token continuations, one with speculation:
    at every position the token frequencies agree (chi-squared test of homogeneity)."""
    spec = speculative(plain)
    # A prompt the tiny model continues with a loop (197 197 ...) that drafts propose, sampled
    # at a temperature where it mostly follows the loop but often leaves it.
    prompt, n, new = [229, 197, 197, 197], 300, 6

    def draws(llm, first_seed):
        params = [SamplingParams(temperature=0.15, seed=first_seed + i, max_tokens=new, ignore_eos=True)
                  for i in range(n)]
        return np.array(tokens(llm.generate([prompt] * n, params)))

    with_spec, without = draws(spec, 0), draws(plain, 10_000)
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0.3 * n, stats  # drafts were accepted and rejected
    assert stats.spec_decode_num_accepted_tokens < 0.8 * stats.spec_decode_num_draft_tokens, stats
    for j in range(new):
        a, b = with_spec[:, j], without[:, j]
        ids = sorted(set(a) | set(b))
        common = [t for t in ids if np.sum(a == t) + np.sum(b == t) >= 10]  # rare tokens pooled
        table = [[int(np.sum(col == t)) for t in common] + [int(np.sum(~np.isin(col, common)))] for col in (a, b)]
        table = [row for row in np.array(table).T if row.sum() > 0]
        if len(table) > 1:
            assert chi2_contingency(np.array(table).T).pvalue > 1e-3 / new, (j, table)


def test_speculative_logprobs_and_stop_strings_match_plain(plain):
    spec = speculative(plain)
    prompts = [[229, 197, 197, 197], [10, 20, 30, 229, 197, 197]]  # the tiny model loops after these
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    outs = [plain.generate(prompts, greedy), spec.generate(prompts, greedy)]
    for want, got in zip(*outs):
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids and g.text == w.text
        assert len(g.logprobs) == len(w.logprobs) == 20
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert lg.keys() == lw.keys()
            for t in lw:
                assert lg[t].rank == lw[t].rank and abs(lg[t].logprob - lw[t].logprob) < 1e-4
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
    # min_tokens holds stop tokens back row by row: drafts below it see the same suppression.
    held = [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=m, stop_token_ids=[197, 463])
            for m in (0, 3, 6, 9)]
    want = plain.generate([prompts[0]] * 4, held)
    got = spec.generate([prompts[0]] * 4, held)
    assert [(o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].stop_reason) for o in want]
    assert len({len(o.outputs[0].token_ids) for o in want}) > 1  # min_tokens mattered
    # A stop string completed by an accepted draft (not the last token of its step) ends the
    # text there, as without speculation: find such a token in a streamed run.
    engine, greedy = spec.engine, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("find", prompts[0], greedy)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].delta_token_ids for o in engine.step()]
    ids = [t for d in deltas for t in d]
    first = next(i for i, d in enumerate(deltas) if len(d) > 1)  # a step that accepted drafts
    end = sum(len(d) for d in deltas[:first]) + 1  # through its first token
    prefix, text = spec.tokenizer.decode(ids[:end]), spec.tokenizer.decode(ids)
    stop = next(prefix[-n:] for n in range(1, len(prefix) + 1) if text.find(prefix[-n:]) + n == len(prefix))
    stopped = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    want, got = plain.generate(prompts[:1], stopped)[0].outputs[0], spec.generate(prompts[:1], stopped)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, "stop", stop)
    assert got.token_ids == ids[:end]
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(spec)


@pytest.mark.slow
def test_speculative_server_streams_the_same_text_and_exports_acceptance(plain):
    """A Serve deployment with speculation from engine_kwargs (as YAML gives it): streamed
    completions equal the plain engine's, and /metrics has vLLM's acceptance counters."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import local_llm_servers, openai_api_server, openai_client

    engine = dict(SMALL, model_impl="jax", num_kv_blocks=512, speculative_config=NGRAM)
    prompts = [[229, 197, 197, 197], [10, 20, 30, 229, 197, 197]]
    want = [o.outputs[0].text for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=20,
                                                                               ignore_eos=True))]
    with local_llm_servers([{"model_loading_config": {"model_id": "spec", "model_source": MODEL},
                             "engine_kwargs": engine}]) as handles, openai_api_server(handles) as url:
        client = openai_client(url)
        for prompt, text in zip(prompts, want):
            chunks = client.completions.create(model="spec", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in chunks) == text
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                   for s in f.samples if s.labels.get("model_name") == "spec"}
    assert samples["servax:spec_decode_num_drafts_total"] > 0
    assert 0 < samples["servax:spec_decode_num_accepted_tokens_total"] <= samples["servax:spec_decode_num_draft_tokens_total"]
    assert samples["servax:generation_tokens_total"] == 40
