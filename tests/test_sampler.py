"""The jitted sampler on small vocabularies: each knob does what it says, and only that."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from runtime.engine.errors import InvalidRequestError
from runtime.engine.sampler import BIAS_WIDTH, SamplingBatch, _argmax, _truncate, empty_sampling_batch, sample
from runtime.engine.sampling_params import SamplingParams

ROWS = 2048
PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
sample_jit = jax.jit(sample, static_argnames=("num_logprobs", "use_penalties"))


def run(logits, history_len=8, num_logprobs=4, **rows):
    """Sample every row of `logits` [S, V]; `rows` fills SamplingBatch fields (scalars broadcast)."""
    logits = np.asarray(logits, np.float32)
    b = empty_sampling_batch(logits.shape[0], history_len)
    for k, v in rows.items():
        if k == "token_mask":  # its width is the test's choice
            b[k] = np.asarray(v, np.int32)
        else:
            b[k][...] = v
    out = sample_jit(logits, SamplingBatch(**b), num_logprobs=num_logprobs)
    return {k: np.asarray(getattr(out, k))
            for k in ("sampled", "chosen_logprob", "chosen_rank", "top_ids", "top_logprobs", "id_logprobs")}


def many(probs, **rows):
    """ROWS independent draws from the same distribution (one seed per row)."""
    logits = np.tile(np.log(probs), (ROWS, 1))
    return run(logits, temperature=rows.pop("temperature", 1.0), seeds=np.arange(ROWS, dtype=np.uint32), **rows)["sampled"]


def test_temperature_one_follows_the_distribution():
    freq = np.bincount(many(PROBS), minlength=4) / ROWS
    np.testing.assert_allclose(freq, PROBS, atol=0.04)


def test_greedy_and_tiny_temperature_take_the_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 50)).astype(np.float32)
    assert (run(logits)["sampled"] == logits.argmax(-1)).all()
    assert (run(logits, temperature=1e-4, seeds=np.arange(16, dtype=np.uint32))["sampled"] == logits.argmax(-1)).all()


def test_logprobs_are_computed_only_when_a_row_reports_them():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(4, 30)).astype(np.float32)
    none = run(logits, report=False)
    assert (none["sampled"] == logits.argmax(-1)).all()  # the sample does not depend on it
    assert not none["chosen_logprob"].any() and not none["top_logprobs"].any() and (none["chosen_rank"] == 1).all()
    one = run(logits, report=np.array([False, False, True, False]))
    every = run(logits)
    assert (one["sampled"] == every["sampled"]).all()
    for k in ("chosen_logprob", "chosen_rank", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(one[k][2], every[k][2])
    want = logits[2] - np.log(np.exp(logits[2]).sum())
    np.testing.assert_allclose(one["chosen_logprob"][2], want.max(), rtol=1e-5)


def test_top_k_never_leaves_the_top_k():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(ROWS, 32)).astype(np.float32)
    out = run(logits, temperature=2.0, top_k=3, seeds=np.arange(ROWS, dtype=np.uint32))["sampled"]
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    assert all(out[i] in top3[i] for i in range(ROWS))
    assert len({(i, out[i]) for i in range(ROWS)}) == ROWS and len(set((out == top3[:, 1]).tolist())) == 2


def _truncate_by_sorting(logits, top_k, top_p, min_p):
    """The textbook top-k -> top-p -> min-p filter (vLLM's order) in NumPy, with a full sort."""
    out = logits.copy()
    for r, row in enumerate(logits):
        order = np.argsort(-row, kind="stable")
        k = top_k[r] if top_k[r] > 0 else len(row)
        keep = np.zeros(len(row), bool)
        keep[order[:k]] = True
        kept = np.where(keep, row, -np.inf)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        mass_before = np.cumsum(probs[order]) - probs[order]
        nucleus = order[mass_before < top_p[r]] if top_p[r] < 1 else order
        keep &= np.isin(np.arange(len(row)), nucleus[: max(len(nucleus), 1)])
        kept = np.where(keep, row, -np.inf)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        keep &= probs >= min_p[r] * probs.max()
        out[r] = np.where(keep, row, -np.inf)
    return out


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["bisection", "cpu_kernel"])
@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_sort_free_truncation_equals_sorting(vocab, cpu_kernel):
    """The bisection over bit patterns, and the C++ kernel (runtime/ops/kernels/sampling.cc), keep
    exactly the tokens a full sort would keep."""
    if cpu_kernel:
        require_cpu_kernels()
    rng = np.random.default_rng(vocab)
    rows = 16
    logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 8, size=(rows, 1))).astype(np.float32)
    logits[0, : vocab // 2] = -np.inf  # a constrained row
    top_k = rng.choice([0, 1, 5, 50, vocab], size=rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.05, 1e-6], size=rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.1], size=rows).astype(np.float32)
    b = empty_sampling_batch(rows, 1)
    b.update(top_k=top_k, top_p=top_p, min_p=min_p)
    truncate = jax.jit(functools.partial(_truncate, cpu_kernel=cpu_kernel))
    got = np.asarray(truncate(logits, SamplingBatch(**b)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(_truncate_by_sorting(logits, top_k, top_p, min_p)))
    np.testing.assert_array_equal(got[np.isfinite(got)], logits[np.isfinite(got)])
    # Each search runs only when some row asks for it: no top-k / top-p rows keep everything finite.
    b.update(top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32))
    np.testing.assert_array_equal(np.asarray(truncate(logits, SamplingBatch(**b))), logits)


def require_cpu_kernels() -> None:
    from runtime.ops.cpu_kernels import kernel_status

    status = kernel_status("truncation")
    assert status == "ok", f"the CPU truncation kernel must build on the test machine: {status}"


def test_cpu_kernel_draws_the_tokens_the_bisection_draws():
    """Same seeds, same settings: the sampler draws the same tokens with either cut."""
    require_cpu_kernels()
    rng = np.random.default_rng(3)
    rows, vocab = 32, 49152
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    b = empty_sampling_batch(rows, 1)
    b.update(temperature=rng.uniform(0.3, 1.5, rows).astype(np.float32),
             top_k=rng.choice([0, 20, 200], rows).astype(np.int32),
             top_p=rng.choice([1.0, 0.95, 0.8], rows).astype(np.float32), seeds=np.arange(rows, dtype=np.uint32))
    draws = [np.asarray(jax.jit(sample, static_argnames=("num_logprobs", "cpu_kernel"))(
        logits, SamplingBatch(**b), num_logprobs=1, cpu_kernel=k).sampled) for k in (False, True)]
    np.testing.assert_array_equal(draws[0], draws[1])

    # Ties (a stable sort would break them; both cuts keep every token tied with the cut).
    logits[:8] = np.round(logits[:8])
    logits[8:12] = 0.5
    logits[12:16, ::3] = -np.inf
    b.update(top_k=np.tile(np.array([0, 3, 40, 2], np.int32), 8), top_p=np.tile(np.array([0.6, 1.0, 0.3, 0.99], np.float32), 8))
    cuts = [np.asarray(jax.jit(functools.partial(_truncate, cpu_kernel=k))(logits, SamplingBatch(**b)))
            for k in (False, True)]
    np.testing.assert_array_equal(cuts[0], cuts[1])


@pytest.mark.parametrize("vocab", [1, 7, 50, 49152])
def test_cpu_kernel_argmax_is_the_xla_argmax(vocab):
    """The C++ argmax: the first index of each row's maximum, ties, -inf and +inf rows included,
    and the vocabulary size for a row holding a NaN, as the XLA form gives; one row or many."""
    require_cpu_kernels()
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(12, vocab)).astype(np.float32)
    logits[1] = np.round(logits[1])  # ties: the first wins
    logits[2] = -np.inf
    logits[3, vocab // 2:] = np.inf
    logits[4, vocab - 1] = np.nan
    logits[5, :] = 0.0
    logits[6, vocab - 1] = 100.0  # the last index
    argmax = {k: jax.jit(functools.partial(_argmax, cpu_kernel=k)) for k in (False, True)}
    for rows in (logits, logits[6:7]):
        xla, kernel = (np.asarray(argmax[k](rows)) for k in (False, True))
        np.testing.assert_array_equal(kernel, xla)
    expected = np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=-1)
    expected[4] = vocab
    np.testing.assert_array_equal(np.asarray(argmax[True](logits)), expected)

    # Through the sampler: greedy rows and logit_bias give the same tokens with the kernel.
    b = empty_sampling_batch(12, 1)
    b["bias_ids"][0, 0], b["bias_values"][0, 0] = 0, 1e4
    draws = [np.asarray(jax.jit(sample, static_argnames=("num_logprobs", "cpu_kernel"))(
        logits, SamplingBatch(**b), num_logprobs=1, cpu_kernel=k).sampled) for k in (False, True)]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert draws[1][0] == 0


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    freq = np.bincount(many(PROBS, top_p=0.7), minlength=4) / ROWS
    assert freq[2] == 0 and freq[3] == 0  # 0.5 + 0.3 already reach 0.7
    np.testing.assert_allclose(freq[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.04)


def test_min_p_drops_unlikely_tokens():
    freq = np.bincount(many(PROBS, min_p=0.2), minlength=4) / ROWS  # floor 0.1
    assert freq[3] == 0 and freq[2] > 0.1


def test_logit_bias_moves_the_choice():
    logits = np.log(PROBS)[None]
    ids = np.full((1, BIAS_WIDTH), -1, np.int32)
    ids[0, 0] = 3
    vals = np.zeros((1, BIAS_WIDTH), np.float32)
    vals[0, 0] = 5.0
    assert run(logits, bias_ids=ids, bias_values=vals)["sampled"][0] == 3


def penalty_case(history, prompt_len, **rows):
    logits = np.array([[2.0, 1.9, 0.0, -1.0]], np.float32)
    hist = np.full((1, 8), -1, np.int32)
    hist[0, :len(history)] = history
    return int(run(logits, token_history=hist, prompt_lens=prompt_len, **rows)["sampled"][0])


def test_penalties_change_what_they_should():
    assert penalty_case([0, 0, 0], 0) == 0  # no penalty: argmax
    assert penalty_case([0, 0, 0], 0, frequency_penalty=0.1) == 1  # 2.0 - 0.3 < 1.9
    assert penalty_case([0], 0, frequency_penalty=0.05) == 0  # 2.0 - 0.05 > 1.9
    assert penalty_case([0], 0, presence_penalty=0.2) == 1
    assert penalty_case([0], 1, presence_penalty=0.2) == 0  # prompt tokens are not "generated"
    assert penalty_case([0], 1, repetition_penalty=1.5) == 1  # but repetition counts the prompt
    # Repetition multiplies negative logits: a seen negative token gets less likely.
    logits = np.array([[-0.5, -0.6, -5.0, -5.0]], np.float32)
    hist = np.array([[0, -1, -1, -1, -1, -1, -1, -1]], np.int32)
    assert run(logits, token_history=hist, prompt_lens=1, repetition_penalty=1.5)["sampled"][0] == 1


def test_seed_and_step_fix_the_draw_whatever_the_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(8, 64)).astype(np.float32)
    seeds = np.array([7] * 8, np.uint32)
    steps = np.arange(8, dtype=np.int32)
    a = run(logits, temperature=1.0, seeds=seeds, steps=steps)["sampled"]
    # Same rows in another order and with different neighbours.
    perm = np.array([3, 0, 7, 1])
    other = rng.normal(size=(4, 64)).astype(np.float32)
    mixed = np.concatenate([logits[perm], other])
    b = run(mixed, temperature=1.0, seeds=np.concatenate([seeds[perm], [1, 2, 3, 4]]).astype(np.uint32),
            steps=np.concatenate([steps[perm], [0, 0, 0, 0]]).astype(np.int32))["sampled"]
    assert (b[:4] == a[perm]).all()


def test_logprobs_are_the_raw_distribution():
    logits = np.log(PROBS)[None]
    out = run(logits, temperature=0.0, num_logprobs=3)
    np.testing.assert_allclose(out["top_logprobs"][0], np.log(PROBS[:3]), atol=1e-5)
    assert out["top_ids"][0].tolist() == [0, 1, 2] and out["chosen_rank"][0] == 1
    target = run(logits, target_ids=2)
    assert target["chosen_rank"][0] == 3
    np.testing.assert_allclose(target["chosen_logprob"][0], np.log(0.15), atol=1e-5)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("n", 0), ("max_tokens", 0),
    ("min_tokens", -1), ("logprobs", -2), ("prompt_logprobs", -3), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logit_bias", {5: 200.0}), ("seed", "x"), ("ignore_eos", "yes"),
])
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


def test_sampling_params_normalise():
    sp = SamplingParams(stop="x", top_k=-1, logit_bias={"3": 1})
    assert sp.stop == ["x"] and sp.top_k == 0 and sp.logit_bias == {3: 1.0}
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(min_tokens=5, max_tokens=3)
    assert e.value.param == "min_tokens"


def test_token_mask_applies_only_where_a_row_is_constrained():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    free = run(logits, token_mask=np.full((3, 3), -1, np.int32))  # all ones: nothing constrained
    assert (free["sampled"] == logits.argmax(-1)).all()
    one = np.full((3, 3), -1, np.int32)
    one[1] = [1 << 5, 0, 0]  # row 1 may only take token 5
    got = run(logits, token_mask=one)["sampled"]
    assert got[1] == 5 and got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
    # A narrower mask leaves the ids past its last word allowed.
    narrow = np.full((3, 1), -1, np.int32)
    narrow[0] = 0  # row 0: none of tokens 0-31
    got = run(logits, token_mask=narrow)["sampled"]
    assert got[0] == 32 + logits[0, 32:].argmax() and got[1] == logits[1].argmax()


def test_logprob_token_ids_are_the_raw_distributions_logprobs_of_those_ids():
    """A row naming ids (vLLM's logprob_token_ids) gets their log_softmax values in its order
    (unused slots -inf), whatever the row samples with; other rows' slots stay -inf."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    ids = np.full((3, 128), -1, np.int32)
    ids[0, :3] = [49, 0, 17]
    ids[2, :1] = [5]
    out = run(logits, temperature=np.array([0.0, 0.7, 1.3], np.float32), report=True, logprob_ids=ids,
              seeds=np.arange(3, dtype=np.uint32))
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out["id_logprobs"][0, :3], raw[0, [49, 0, 17]], atol=1e-5)
    np.testing.assert_allclose(out["id_logprobs"][2, :1], raw[2, [5]], atol=1e-5)
    assert np.isneginf(out["id_logprobs"][0, 3:]).all() and np.isneginf(out["id_logprobs"][1]).all()


def test_logprob_token_ids_settings_are_checked():
    assert SamplingParams(logprob_token_ids=[4, 2]).logprobs == 2  # as many entries as ids
    with pytest.raises(InvalidRequestError, match="at most 128"):
        SamplingParams(logprob_token_ids=list(range(129)))
    with pytest.raises(InvalidRequestError, match="logprobs must equal"):
        SamplingParams(logprobs=1, logprob_token_ids=[4, 2])
