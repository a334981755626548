"""The offline LLM API end to end on the tiny Llama: matches transformers, stops, n, logprobs."""

from __future__ import annotations

import math

import pytest

from app import LLM, SamplingParams
from conftest import hf_greedy, hf_model
from registry.tiny import tiny_checkpoint_path
from runtime.engine.errors import InvalidRequestError, PromptTooLongError

MODEL = "servax-tiny/llama"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        MODEL, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=256,
        show_progress=False,
    )


def test_greedy_matches_transformers_generate(llm):
    prompt = "The quick brown fox jumps over the lazy dog. Once upon a time"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    ids = llm.tokenizer(prompt).input_ids
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(hf_model(tiny_checkpoint_path(MODEL)), ids, 40)
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "length"


def test_token_id_prompts_and_prompt_order(llm):
    prompts = [[5, 6, 7], [100, 200, 300, 400, 10], [42]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)


def test_max_tokens_and_min_tokens(llm):
    ids = [10, 20, 30, 40]
    eos = llm.engine.model.eos_token_ids[0]
    greedy = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(greedy.token_ids) == 8
    # Force EOS to be the best token: it ends generation at once, unless min_tokens holds it back.
    bias = {eos: 100.0}
    o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))[0].outputs[0]
    assert o.token_ids == [eos] and o.finish_reason == "stop" and o.stop_reason is None
    o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias=bias))[0].outputs[0]
    assert len(o.token_ids) == 4 and eos not in o.token_ids[:3] and o.token_ids[3] == eos
    o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias))[0].outputs[0]
    assert o.token_ids == [eos] * 8 and o.finish_reason == "length"


def test_stop_token_ids(llm):
    ids = [10, 20, 30, 40]
    ref = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    stop_tok = ref[5]
    sp = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok], ignore_eos=True)
    o = llm.generate([ids], sp)[0].outputs[0]
    first = ref.index(stop_tok)
    assert o.token_ids == ref[: first + 1]
    assert o.finish_reason == "stop" and o.stop_reason == stop_tok


def test_stop_strings_cut_text_and_stream_consistently(llm):
    prompt = "Hello world! How are you"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = ref.text
    stop = text[8:11]
    assert stop and stop not in text[:8]
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop))[0].outputs[0]
    assert o.text == text[:8] and o.finish_reason == "stop" and o.stop_reason == stop
    o = llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True,
    ))[0].outputs[0]
    assert o.text == text[:11]


def test_n_samples_share_prompt_and_differ(llm):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = llm.generate("Once upon a time", sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3 and all(len(s) == 12 for s in seqs)
    again = llm.generate("Once upon a time", sp)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs  # seeded: reproducible


def test_logprobs_of_sampled_tokens(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate([[10, 20, 30]], sp)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the most likely
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        lps = [entry[t].logprob for t in sorted(entry, key=lambda t: entry[t].rank)]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        total += entry[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-5)


def test_prompt_logprobs_match_teacher_forcing(llm):
    prompt = [10, 20, 30, 40, 50, 60, 70]
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    # Teacher forcing: the logprob of prompt[i] given prompt[:i], via the last-token logprobs
    # of a greedy request on that prefix.
    for i in (1, 4, 6):
        prefix_out = llm.generate([prompt[:i]], SamplingParams(temperature=0, max_tokens=1, logprobs=20,
                                                               ignore_eos=True))[0].outputs[0]
        want = prefix_out.logprobs[0]
        got = plp[i][prompt[i]]
        if prompt[i] in want:
            assert got.logprob == pytest.approx(want[prompt[i]].logprob, abs=1e-4)
        top1 = min(want.values(), key=lambda lp: lp.rank)
        assert max(v.logprob for v in plp[i].values()) == pytest.approx(top1.logprob, abs=1e-4)
    assert out.outputs[0].token_ids == llm.generate([prompt], GREEDY)[0].outputs[0].token_ids[:3]


def test_bad_requests_raise_before_queueing(llm):
    with pytest.raises(PromptTooLongError) as e:
        llm.generate([[1] * 256], GREEDY)
    assert "256" in str(e.value) and "max_model_len=256" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[1, 2], [600]], GREEDY)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_p=1.5)
    assert e.value.param == "top_p" and "(0, 1]" in str(e.value)
    assert llm.engine.num_unfinished_requests == 0


@pytest.mark.slow
def test_bfloat16_generates(llm):
    bf = LLM(MODEL, dtype="bfloat16", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             num_kv_blocks=64, show_progress=False)
    out = bf.generate([[10, 20, 30]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 16
    assert bf.engine.stats().compilations_since_warmup == 0


def stream_tokens(tokenizer, ids, **kw):
    from runtime.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, [], **kw)
    deltas, stop = [], None
    for i, t in enumerate(ids):
        stop = detok.update([t])
        if stop:
            detok.stop_at_match()  # what the engine does when runtime.engine.stop says the match ends it
        deltas.append(detok.delta(finished=stop is not None or i == len(ids) - 1))
        if stop:
            break
    return deltas, detok, stop


def test_detokenizer_streams_whole_multibyte_characters(llm):
    text = "héllo wörld ☃ snow ✓ done"
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in ids)  # some tokens split a character
    deltas, detok, _ = stream_tokens(llm.tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.output_text


def test_detokenizer_holds_back_a_possible_stop_string(llm):
    text = "héllo wörld ☃ snow"
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    deltas, detok, stop = stream_tokens(llm.tokenizer, ids, stop=["wörld"])
    assert stop == "wörld" and "".join(deltas) == "héllo " == detok.output_text
    streamed = ""
    for d in deltas:
        streamed += d
        assert "w" not in streamed  # never a prefix of the stop string that is later cut
    deltas, detok, _ = stream_tokens(llm.tokenizer, ids, stop=["wörld"], include_stop_str_in_output=True)
    assert "".join(deltas) == "héllo wörld"


_TP_SCRIPT = """
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from app import LLM, SamplingParams
sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
prompts = [[10, 20, 30, 40], list(range(100, 160))]
res = {}
for tp in (1, 2):
    llm = LLM("servax-tiny/llama", tensor_parallel_size=tp, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, num_kv_blocks=64, show_progress=False)
    res[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    res[f"devices{tp}"] = len(llm.engine.model_config["devices"])
    res[f"compiles{tp}"] = llm.engine.stats().compilations_since_warmup
# A 16-bit cache on the mesh (kept as its bits on CPU), sharded by heads as a float32 one is.
llm = LLM("servax-tiny/llama", tensor_parallel_size=2, kv_cache_dtype="float16", max_model_len=128,
          max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64, show_progress=False)
res["2-float16"] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
res["bits"] = llm.engine.programs.kv_cache.half_bits
print("RESULT" + json.dumps(res))
"""


@pytest.mark.slow
def test_tensor_parallel_gives_the_same_tokens():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT], cwd=root, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["devices1"] == 1 and res["devices2"] == 2
    assert res["1"] == res["2"] and res["compiles1"] == res["compiles2"] == 0
    assert res["2-float16"] == res["1"] and res["bits"] == "float16"


def test_mesh_refuses_sizes_the_devices_cannot_hold():
    from runtime.ops.mesh import make_mesh

    import jax

    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 x data_parallel_size=1 = 3 devices"):
        make_mesh(3, devices=jax.devices() * 2)


def test_data_parallel_is_refused_with_the_alternative():
    from runtime import EngineConfig

    with pytest.raises(ValueError, match=r"data_parallel_size=2 is not supported.*Serve replicas"):
        EngineConfig(model="servax-tiny/llama", data_parallel_size=2)


def test_torchax_fallback_serves_the_same_tokens(llm):
    prompts = [[10, 20, 30], list(range(100, 140))]
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    fallback = LLM(MODEL, model_impl="torchax", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                   num_kv_blocks=64, show_progress=False)
    assert fallback.engine.model_config["impl"] == "torchax"
    assert [o.outputs[0].token_ids for o in fallback.generate(prompts, GREEDY)] == native
    assert fallback.engine.stats().compilations_since_warmup == 0


def test_prompt_dicts_give_the_same_tokens_as_plain_prompts(llm):
    ids = llm.tokenizer("Once upon a time").input_ids
    plain = llm.generate(["Once upon a time", ids], GREEDY)
    dicts = llm.generate([{"prompt": "Once upon a time"}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == "Once upon a time" and dicts[1].prompt_token_ids == ids


def test_chat_renders_the_template_like_the_tokenizer(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    (chat,) = llm.chat(messages, GREEDY)
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    both = llm.chat([messages, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]],
                    GREEDY)
    assert both[0].prompt_token_ids == both[1].prompt_token_ids == ids  # developer is system to templates


def test_bad_prompt_forms_are_refused_by_the_one_processor(llm):
    for bad, param in (({"text": "x"}, "prompt"), ([[{"type": "image"}]], "prompt"), ([1.5, 2], "prompt")):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(bad, GREEDY)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter"):
        llm.engine.process_inputs("x", "hi", {"temprature": 1})


def test_logprob_token_ids_offline_give_the_whole_vocabularys_values():
    """LLM.generate with SamplingParams(logprob_token_ids=...): each position lists the chosen
    token and the named ids, ranked by their place in the list (vLLM's), with the values the
    whole vocabulary's logprobs give; out-of-vocabulary ids are refused naming them."""
    from runtime.engine.errors import InvalidRequestError

    llm = LLM("servax-tiny/llama", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, max_logprobs=-1,
              show_progress=False)
    prompt = {"prompt_token_ids": [5, 9, 33, 71]}
    ids = [300, 7, 42]
    named = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprob_token_ids=ids), use_tqdm=False)
    whole = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=-1), use_tqdm=False)
    out, ref = named[0].outputs[0], whole[0].outputs[0]
    assert out.token_ids == ref.token_ids
    for token, entry, full in zip(out.token_ids, out.logprobs, ref.logprobs):
        assert list(entry)[0] == token and set(entry) == {token, *ids}
        assert [entry[t].rank for t in ids if t != token] == [i + 1 for i, t in enumerate(ids) if t != token]
        for t in entry:
            assert abs(entry[t].logprob - full[t].logprob) < 1e-5
    with pytest.raises(InvalidRequestError, match=r"\[512, 600\]"):
        llm.generate(prompt, SamplingParams(logprob_token_ids=[1, 512, 600]), use_tqdm=False)
