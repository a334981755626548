"""Native mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) against transformers.

Greedy tokens identical to transformers' and prompt logprobs within 1e-4, through the engine:
chunked prefill, prefix-cache hits, preemption and seeded sampling; tensor parallelism and
expert parallelism on fake devices give the same tokens as one device (tests/spmd_worker.py).
"""

from __future__ import annotations

import pytest

from conftest import (
    ENGINE_PROMPTS as PROMPTS, assert_prefix_hits_keep_their_tokens, assert_prompt_logprobs_match_hf, greedy,
    hf_greedy, hf_model, NEW_TOKENS,
    output_tokens as tokens, quick_loop_keeps, SMALL_ENGINE as ENGINE, tiny_llm,
)

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]  # gpt_oss: sinks, windows of 8 tokens, YaRN


@pytest.fixture(scope="module", params=quick_loop_keeps(MOE, "qwen3_moe"))
def moe_model(request, tiny_checkpoint):
    with tiny_llm(request.param) as llm:
        yield request.param, llm, tiny_checkpoint(request.param)


def test_moe_models_run_natively_on_the_grouped_kernel(moe_model):
    from runtime.ops.matmul import PackedExperts

    name, llm, _ = moe_model
    assert llm.engine.model.impl == "jax"
    experts = llm.engine.programs.model.params["layers"][0]["mlp"]["experts"]
    matrices = [w for name, w in experts.items() if not name.endswith("_bias")]  # biases stay arrays
    assert matrices and all(isinstance(w, PackedExperts) for w in matrices), name


def test_moe_greedy_tokens_match_transformers(moe_model):
    """Batched, with the 70-token prompt prefilled in chunks of the 32-token budget."""
    name, llm, path = moe_model
    hf = hf_model(path)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert tokens(llm.generate(PROMPTS, greedy())) == want
    assert llm.engine.stats().compilations_since_warmup == 0


def test_moe_prompt_logprobs_match_transformers(moe_model):
    name, llm, path = moe_model
    assert_prompt_logprobs_match_hf(llm, hf_model(path), PROMPTS[2])


def test_moe_prefix_hits_and_seeded_sampling_keep_their_tokens(moe_model):
    from app import SamplingParams

    name, llm, _ = moe_model
    assert_prefix_hits_keep_their_tokens(llm, PROMPTS[2])
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = tokens(llm.generate([PROMPTS[1]], seeded))[0]
    mixed = tokens(llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [greedy(), seeded, greedy()]))[1]
    assert alone == mixed


@pytest.mark.slow
def test_moe_preemption_recomputes_the_same_tokens(tiny_checkpoint):
    """A KV cache too small for every sequence at once: requests are preempted and recomputed."""
    from app import LLM

    path = tiny_checkpoint("qwen3_moe")
    want = [hf_greedy(hf_model(path), p, 24) for p in PROMPTS]
    llm = LLM("servax-tiny/qwen3_moe", **{**ENGINE, "max_model_len": 128, "num_kv_blocks": 24})
    try:
        assert tokens(llm.generate(PROMPTS * 2, greedy(max_tokens=24))) == want * 2
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()


def test_expert_parallel_needs_experts_and_divisible_counts(tiny_checkpoint):
    from app import LLM
    from registry.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="needs a mixture-of-experts model"):
        LLM("servax-tiny/llama", enable_expert_parallel=True, **ENGINE)


@pytest.mark.slow
def test_moe_tensor_and_expert_parallel_match_one_device(servax_cache, tmp_path_factory):
    """Qwen3-MoE (8 experts, 8 heads): tensor parallel 2, expert parallel 4 and 8, the same
    greedy tokens as one device; expert weights split as asked; nothing compiles while serving."""
    from registry.tiny import make_tiny_checkpoint
    from test_spmd import run_worker

    root = tmp_path_factory.mktemp("moe")
    model = str(make_tiny_checkpoint("qwen3_moe", root / "qwen3_moe_8", num_attention_heads=8, num_key_value_heads=4))
    experts = {"gate": "layers.mlp.experts.gate", "down": "layers.mlp.experts.down"}
    runs = run_worker(dict(model_impl="jax", runs=[
        dict(model=model, name="tp", tp=[1, 2], params=experts),
        dict(model=model, name="ep", tp=[4, 8], params=experts, engine=dict(enable_expert_parallel=True)),
        dict(model="servax-tiny/gpt_oss", name="gpt_oss", tp=[1, 2]),
        dict(model="servax-tiny/gpt_oss", name="gpt_oss-ep", tp=[4], engine=dict(enable_expert_parallel=True)),
    ]), servax_cache)
    for key, ref in [(("tp", 2), "tp"), (("ep", 4), "tp"), (("ep", 8), "tp"),
                     (("gpt_oss", 2), "gpt_oss"), (("gpt_oss-ep", 4), "gpt_oss")]:
        run, ref = runs[key], runs[(ref, 1)]
        for field in ("batched", "alone", "pair"):
            assert run[field] == ref[field], f"{key}: {field}"
        assert run["compilations_since_warmup"] == 0
    # tensor parallel: every expert on every device, its features split; expert parallel: whole experts
    assert runs[("tp", 2)]["params"]["gate"]["shard_shape"] == [8, 64, 16]
    assert runs[("tp", 2)]["params"]["down"]["shard_shape"] == [8, 16, 64]
    assert runs[("ep", 8)]["params"]["gate"]["shard_shape"] == [1, 64, 32]
    assert runs[("ep", 4)]["params"]["down"]["shard_shape"] == [2, 32, 64]


def test_the_number_of_programs_does_not_grow_with_the_experts(tmp_path):
    """One grouped product per projection whatever the expert count: 8 and 32 experts compile
    the same programs (and every expert's weights are packed once, at load)."""
    from app import LLM
    from registry.tiny import make_tiny_checkpoint

    counts = []
    for experts in (8, 32):
        path = make_tiny_checkpoint("qwen3_moe", tmp_path / f"e{experts}", num_experts=experts)
        llm = LLM(str(path), **ENGINE)
        counts.append(llm.engine.programs.compiled.num_programs)
        assert llm.engine.programs.model.params["layers"][0]["mlp"]["experts"]["down"].shape[0] == experts
        llm.shutdown()
    assert counts[0] == counts[1] > 0


@pytest.mark.slow
@pytest.mark.cluster
def test_serve_run_moe_yaml_streams_the_offline_tokens(servax_cache, tmp_path_factory):
    """`serve run configs/moe.yaml` as a user starts it: the official client's completion, streamed
    and not, gives the offline engine's greedy tokens (a native MoE model behind real HTTP)."""
    from app import LLM
    from conftest import REPO, openai_client, serve_run

    prompt = "The experts of a mixture"
    llm = LLM("servax-tiny/qwen3_moe", **ENGINE)
    want = llm.generate([prompt], greedy(max_tokens=12))[0].outputs[0].text
    llm.shutdown()
    with serve_run(REPO / "configs" / "moe.yaml", tmp_path_factory.mktemp("serve-moe")) as run:
        client = openai_client(run.base_url)
        args = dict(model="servax-tiny/qwen3_moe", prompt=prompt, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True})
        assert client.completions.create(**args).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)
        assert streamed == want
