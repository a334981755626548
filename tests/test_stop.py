"""runtime.engine.stop: the one decision of whether a sequence finishes and why (vLLM's precedence)."""

from __future__ import annotations

from runtime.engine.request import Request, RequestStatus
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.stop import check_stop, is_stop_token, suppressed_token_ids

EOS = 2


def generated(tokens: list[int], **params) -> Request:
    r = Request("r", [5, 6, 7], SamplingParams(**params), eos_token_ids=(EOS,), block_size=4,
                max_model_len=64, sample_seed=0)
    for t in tokens:
        r.append_output_token(t)
    return r


def test_eos_stops_with_no_stop_reason():
    d = check_stop(generated([9, EOS]), EOS)
    assert d.status == RequestStatus.FINISHED_STOPPED and d.finish_reason == "stop" and d.reason is None


def test_ignore_eos_keeps_going_until_length():
    assert check_stop(generated([EOS], ignore_eos=True, max_tokens=4), EOS) is None
    d = check_stop(generated([EOS] * 4, ignore_eos=True, max_tokens=4), EOS)
    assert d.finish_reason == "length"


def test_stop_token_id_is_the_stop_reason():
    d = check_stop(generated([9, 11], stop_token_ids=[11]), 11)
    assert d.finish_reason == "stop" and d.reason == 11


def test_stop_string_is_the_stop_reason_and_beats_length():
    d = check_stop(generated([9, 10], stop=["ab"], max_tokens=2), 10, stop_string="ab")
    assert d.finish_reason == "stop" and d.reason == "ab"


def test_below_min_tokens_only_length_stops():
    r = generated([EOS], min_tokens=3, stop_token_ids=[11], stop=["x"], max_tokens=8)
    assert check_stop(r, EOS) is None and check_stop(r, EOS, stop_string="x") is None
    assert sorted(suppressed_token_ids(r)) == [EOS, 11]
    r = generated([9, 9, EOS], min_tokens=3)
    assert check_stop(r, EOS).finish_reason == "stop" and suppressed_token_ids(r) == []


def test_context_limit_caps_max_tokens():
    r = Request("r", list(range(60)), SamplingParams(max_tokens=None), eos_token_ids=(), block_size=4,
                max_model_len=64, sample_seed=0)
    for t in range(3):
        r.append_output_token(t)
    assert check_stop(r, 2) is None
    r.append_output_token(3)
    assert check_stop(r, 3).finish_reason == "length"


def test_stop_tokens_stay_out_of_the_text():
    r = generated([], stop_token_ids=[11])
    assert is_stop_token(r, 11) and is_stop_token(r, EOS) and not is_stop_token(r, 9)
