"""Pooling requests (embeddings, scores) in the engine: equal to transformers' pooled hidden
states of the same checkpoint, beside generation requests without changing their tokens,
and with no KV blocks kept afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ENGINE_PROMPTS, greedy, hf_greedy, hf_model, output_tokens, tiny_llm, wait_idle
from registry.tiny import tiny_checkpoint_path
from runtime.engine.errors import InvalidRequestError
from runtime.engine.pooling import PoolingParams

# ENGINE_PROMPTS' 70-token prompt is prefilled in three chunks (max_num_batched_tokens=32).
PROMPTS = ENGINE_PROMPTS


def hf_hidden(tokens: list[int]) -> np.ndarray:
    """transformers' last_hidden_state (after the final norm) of the tiny Qwen3: [len, D]."""
    import torch

    hf = hf_model(tiny_checkpoint_path("servax-tiny/qwen3"))
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0].numpy()


def pooled_reference(tokens: list[int], pooling_type: str, dims: int | None = None) -> np.ndarray:
    h = hf_hidden(tokens)
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling_type]
    v = v[:dims] if dims else v
    return v / np.linalg.norm(v)


def assert_cosine(a, b) -> None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b) >= 0.9999


@pytest.mark.parametrize("pooling_type", ["LAST", pytest.param("MEAN", marks=pytest.mark.slow),
                                          pytest.param("CLS", marks=pytest.mark.slow)])
def test_embeddings_equal_transformers_pooled_hidden_states(pooling_type):
    with tiny_llm("qwen3", runner="pooling", pooler_config={"pooling_type": pooling_type}) as llm:
        outs = llm.embed(PROMPTS, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            assert out.prompt_token_ids == prompt
            assert_cosine(out.outputs.embedding, pooled_reference(prompt, pooling_type))
            assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5
        again = llm.embed(PROMPTS[2], use_tqdm=False)[0]  # LAST reads the prefix cache, MEAN and CLS do not
        assert (again.num_cached_tokens > 0) == (pooling_type == "LAST")
        assert_cosine(again.outputs.embedding, outs[2].outputs.embedding)
        wait_idle(llm.engine)


@pytest.mark.slow
def test_pooling_beside_generation_keeps_tokens_and_frees_blocks():
    hf = hf_model(tiny_checkpoint_path("servax-tiny/qwen3"))
    with tiny_llm("qwen3", runner="pooling") as llm:
        engine = llm.engine
        alone = output_tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False))
        assert alone == [hf_greedy(hf, p, len(alone[0])) for p in PROMPTS]
        for i, p in enumerate(PROMPTS):  # generation and pooling requests in the same steps
            engine.add_request(f"g{i}", p, greedy())
            engine.add_request(f"e{i}", p[::-1], PoolingParams())
        outs, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
            steps += 1
            if steps == 2:  # one more arrives mid-generation
                engine.add_request("late", PROMPTS[1] + [7, 8, 9], PoolingParams())
        assert [outs[f"g{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
        for i, p in enumerate(PROMPTS):
            assert_cosine(outs[f"e{i}"].outputs.data, pooled_reference(p[::-1], "LAST"))
        assert_cosine(outs["late"].outputs.data, pooled_reference(PROMPTS[1] + [7, 8, 9], "LAST"))
        stats = wait_idle(engine)
        assert stats.kv_blocks_used == 0 and stats.compilations_since_warmup == 0


@pytest.mark.slow
def test_matryoshka_dimensions_truncate_then_normalize():
    with tiny_llm("qwen3", runner="pooling", hf_overrides={"matryoshka_dimensions": [16, 32]}) as llm:
        out = llm.embed(PROMPTS[1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0]
        assert len(out.outputs.embedding) == 16
        assert_cosine(out.outputs.embedding, pooled_reference(PROMPTS[1], "LAST", dims=16))
        with pytest.raises(InvalidRequestError, match=r"only supports Matryoshka dimensions \[16, 32\], got 8"):
            llm.embed(PROMPTS[1], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)


def _single_token_words(tokenizer, n: int) -> list[str]:
    """`n` words the tiny tokenizer encodes as one token each (its vocabulary has no "yes"/"no")."""
    words = []
    for i in range(300, 512):
        w = tokenizer.decode([i])
        if w.strip() and tokenizer.encode(w, add_special_tokens=False) == [i] and w not in words:
            words.append(w)
        if len(words) == n:
            return words
    raise AssertionError("no single-token words")


@pytest.mark.slow
def test_reranker_scores_and_order_equal_transformers():
    """The Qwen3-Reranker recipe: sigmoid(logit(yes) - logit(no)) at the last token of
    query + document, from the causal LM's head (vLLM's hf_overrides)."""
    from transformers import AutoTokenizer

    path = tiny_checkpoint_path("servax-tiny/qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    no, yes = _single_token_words(tok, 2)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    query = "which fox is quick?"
    docs = ["the quick brown fox", "a lazy dog sleeps", "jumps over the dog", "quick quick fox fox"]
    hf = hf_model(path)
    import torch

    ids = tok.convert_tokens_to_ids
    no_id, yes_id = tok.encode(no, add_special_tokens=False)[0], tok.encode(yes, add_special_tokens=False)[0]
    want = []
    for d in docs:
        with torch.no_grad():
            logits = hf(torch.tensor([tok(query + d).input_ids])).logits[0, -1].numpy().astype(np.float64)
        want.append(1 / (1 + np.exp(-(logits[yes_id] - logits[no_id]))))
    del ids
    with tiny_llm("qwen3", hf_overrides=overrides) as llm:
        assert llm.engine.model_config["pooling_task"] == "classify"
        got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert list(np.argsort(got)) == list(np.argsort(want))
        wait_idle(llm.engine)


def test_generate_runner_refuses_pooling_requests():
    with tiny_llm("qwen3") as llm:
        with pytest.raises(InvalidRequestError, match="runner='generate'"):
            llm.embed("hello", use_tqdm=False)
