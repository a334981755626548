"""The pooling routes over real HTTP: the official openai client and LangChain's
OpenAIEmbeddings against /v1/embeddings, and /rerank + /v1/score of a Qwen3-Reranker-style
model, each equal to transformers on the same tiny checkpoint."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from conftest import SMALL_ENGINE, local_llm_servers, openai_api_server, openai_client
from registry.tiny import tiny_checkpoint_path
from test_pooling import PROMPTS, _single_token_words, assert_cosine, hf_hidden, pooled_reference

EMBED, RERANK = "tiny-embed", "tiny-rerank"


@pytest.fixture(scope="module")
def url():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_path("servax-tiny/qwen3"))
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": _single_token_words(tok, 2), "is_original_qwen3_reranker": True}
    with local_llm_servers([
        {"model_loading_config": {"model_id": EMBED, "model_source": "servax-tiny/qwen3"},
         "engine_kwargs": {**SMALL_ENGINE, "runner": "pooling"}},
        {"model_loading_config": {"model_id": RERANK, "model_source": "servax-tiny/qwen3"},
         "engine_kwargs": {**SMALL_ENGINE, "hf_overrides": overrides}},
    ]) as handles, openai_api_server(handles) as base:
        yield base


@pytest.mark.slow
def test_openai_client_embeddings_float_and_base64_equal_transformers(url):
    client = openai_client(url)
    texts = ["the quick brown fox", "jumps over the lazy dog"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_path("servax-tiny/qwen3"))
    # No encoding_format: the client asks for base64 and decodes it itself; float as asked;
    # base64 as asked comes back as the string (little-endian float32).
    for fmt in (None, "float", "base64"):
        reply = client.embeddings.create(model=EMBED, input=texts, **({"encoding_format": fmt} if fmt else {}))
        assert [d.index for d in reply.data] == [0, 1] and reply.model == EMBED
        for text, d in zip(texts, reply.data):
            vec = np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
            assert_cosine(vec, pooled_reference(tok(text).input_ids, "LAST"))
        assert reply.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in texts)
    ids = client.embeddings.create(model=EMBED, input=[PROMPTS[0], PROMPTS[2]])  # token ids, as LangChain sends
    for prompt, d in zip((PROMPTS[0], PROMPTS[2]), ids.data):
        assert_cosine(d.embedding, pooled_reference(prompt, "LAST"))
    one = client.embeddings.create(model=EMBED, input=PROMPTS[1])
    assert_cosine(one.data[0].embedding, pooled_reference(PROMPTS[1], "LAST"))


@pytest.mark.slow
def test_langchain_openai_embeddings(url):
    from langchain_openai import OpenAIEmbeddings
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_path("servax-tiny/qwen3"))
    # check_embedding_ctx_length=False: LangChain's default first tokenizes with tiktoken's
    # cl100k (a download) and sends those ids; the id form itself is tested above.
    emb = OpenAIEmbeddings(model=EMBED, base_url=f"{url}/v1", api_key="unused", check_embedding_ctx_length=False)
    docs = ["the quick brown fox", "a lazy dog"]
    for text, vec in zip(docs, emb.embed_documents(docs)):
        assert_cosine(vec, pooled_reference(tok(text).input_ids, "LAST"))
    assert_cosine(emb.embed_query("fox"), pooled_reference(tok("fox").input_ids, "LAST"))


@pytest.mark.slow
def test_rerank_and_score_order_equal_transformers(url):
    import torch
    from transformers import AutoTokenizer

    from conftest import hf_model

    path = tiny_checkpoint_path("servax-tiny/qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    no, yes = (tok.encode(w, add_special_tokens=False)[0] for w in _single_token_words(tok, 2))
    hf = hf_model(path)
    query, docs = "which fox is quick?", ["the quick brown fox", "a lazy dog sleeps", "jumps over", "fox fox"]
    want = []
    for d in docs:
        with torch.no_grad():
            logits = hf(torch.tensor([tok(query + d).input_ids])).logits[0, -1].double().numpy()
        want.append(1 / (1 + np.exp(logits[no] - logits[yes])))
    with httpx.Client(base_url=url, timeout=60) as http:
        for path in ("/rerank", "/v1/rerank"):
            r = http.post(path, json={"model": RERANK, "query": query, "documents": docs, "top_n": 3})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == list(np.argsort(want)[::-1][:3])
            np.testing.assert_allclose([x["relevance_score"] for x in results], sorted(want, reverse=True)[:3],
                                       atol=1e-5)
            assert results[0]["document"] == {"text": docs[results[0]["index"]], "multi_modal": None}
        bare = http.post("/rerank", json={"model": RERANK, "query": query, "documents": docs,
                                          "return_documents": False}).json()["results"]
        assert len(bare) == 4 and "document" not in bare[0]
        score = http.post("/v1/score", json={"model": RERANK, "queries": query, "documents": docs}).json()
        np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
        cos = http.post("/score", json={"model": EMBED, "text_1": "fox", "text_2": ["fox", "dog"]}).json()
        assert abs(cos["data"][0]["score"] - 1) < 1e-5  # an embedding model scores with the cosine


def test_pooling_errors_are_precise_400s(url):
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"model": EMBED, "input": "fox", "dimensions": 8})
        assert r.status_code == 400 and "does not support Matryoshka" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "dimensions"
        r = http.post("/v1/embeddings", json={"model": EMBED, "input": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = http.post("/v1/embeddings", json={"model": EMBED, "input": [[1, 2, 99999]]})
        assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
        r = http.post("/v1/embeddings", json={"model": RERANK, "input": "fox"})
        assert r.status_code == 400 and "embed model" in r.json()["error"]["message"]
        r = http.post("/v1/score", json={"model": RERANK, "queries": ["a", "b"], "documents": ["a", "b", "c"]})
        assert r.status_code == 400 and "1 -> 1, 1 -> N or N -> N" in r.json()["error"]["message"]
        r = http.post("/rerank", json={"model": RERANK, "query": "q", "documents": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    assert hf_hidden is not None
