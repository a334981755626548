"""Compare servax's pooling routes (/v1/embeddings, /v1/score, /rerank, /v1/rerank) with `vllm serve`
(not a test: run by hand; #43).

Serves the tiny random Qwen3 (servax-tiny/qwen3) twice with servax in this process: as an embedding
model (`runner: pooling`, last-token pooling, normalized: Qwen3-Embedding's recipe, declared
Matryoshka so that `dimensions` is allowed) and as a Qwen3-Reranker-style reranker; sends the same
requests to them and to a running `vllm serve` of the same folder, one vLLM server at a time (two
do not fit this machine). Prints, per request, the status codes, the JSON shapes where they differ
(ids and timings aside), and the values side by side: the cosine of each pair of embeddings, the
largest score difference, whether the rerank order is the same. servax never imports vLLM:

    PY=$(../shared/tools/vllm-reference | tail -1); VLLM="$(dirname "$PY")/vllm"
    DIR=$(python -c "from registry.tiny import tiny_checkpoint_path as p; print(p('servax-tiny/qwen3'))")
    export VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=1
    "$VLLM" serve $DIR --served-model-name tiny-embed --port 8765 --max-model-len 512 --dtype float32 \\
        --runner pooling --convert embed --pooler-config '{"pooling_type": "LAST", "use_activation": true}' \\
        --hf-overrides '{"is_matryoshka": true}'
    python tests/vllm_compare_pooling.py --embed http://127.0.0.1:8765
    # then, that server stopped:
    "$VLLM" serve $DIR --served-model-name tiny-rerank --port 8765 --max-model-len 512 --dtype float32 \\
        --runner pooling --hf-overrides "$(python tests/vllm_compare_pooling.py --reranker-overrides)"
    python tests/vllm_compare_pooling.py --rerank http://127.0.0.1:8765
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from vllm_compare_api import flat, shape  # noqa: E402

EMBED, RERANK = "tiny-embed", "tiny-rerank"
TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a third, longer sentence about nothing at all"]
QUERY = "what does the fox do"


def reranker_overrides() -> dict:
    """vLLM's recipe for a Qwen3-Reranker, with two words the tiny vocabulary has as single tokens."""
    from transformers import AutoTokenizer

    from registry.tiny import tiny_checkpoint_path
    from test_pooling import _single_token_words

    words = _single_token_words(AutoTokenizer.from_pretrained(tiny_checkpoint_path("servax-tiny/qwen3")), 2)
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": words,
            "is_original_qwen3_reranker": True}


def embed_requests(token_ids: list[list[int]]) -> list[tuple[str, str, dict]]:
    e = {"model": EMBED}
    return [
        ("embeddings: one text, float", "/v1/embeddings", {**e, "input": TEXTS[0], "encoding_format": "float"}),
        ("embeddings: batch of texts", "/v1/embeddings", {**e, "input": TEXTS}),
        ("embeddings: base64", "/v1/embeddings", {**e, "input": TEXTS[:2], "encoding_format": "base64"}),
        ("embeddings: token ids (batch)", "/v1/embeddings", {**e, "input": token_ids}),
        ("embeddings: token ids (one)", "/v1/embeddings", {**e, "input": token_ids[0]}),
        ("embeddings: dimensions 16", "/v1/embeddings", {**e, "input": TEXTS[:2], "dimensions": 16}),
        ("embeddings: dimensions 0", "/v1/embeddings", {**e, "input": TEXTS[0], "dimensions": 0}),
        ("embeddings: dimensions > hidden", "/v1/embeddings", {**e, "input": TEXTS[0], "dimensions": 4096}),
        ("embeddings: use_activation false", "/v1/embeddings", {**e, "input": TEXTS[0], "use_activation": False}),
        ("embeddings: truncate_prompt_tokens 3", "/v1/embeddings",
         {**e, "input": TEXTS[2], "truncate_prompt_tokens": 3}),
        ("embeddings: empty string", "/v1/embeddings", {**e, "input": ""}),
        ("embeddings: empty list", "/v1/embeddings", {**e, "input": []}),
        ("embeddings: bad encoding_format", "/v1/embeddings", {**e, "input": "x", "encoding_format": "int8"}),
        ("embeddings: unknown model", "/v1/embeddings", {**e, "model": "nope", "input": "x"}),
        ("score on the embedding model (cosine)", "/v1/score", {**e, "queries": QUERY, "documents": TEXTS}),
        ("rerank on the embedding model (cosine)", "/rerank", {**e, "query": QUERY, "documents": TEXTS}),
    ]


def rerank_requests() -> list[tuple[str, str, dict]]:
    r = {"model": RERANK}
    return [
        ("score: text_1 + text_2, 1 -> N", "/v1/score", {**r, "text_1": QUERY, "text_2": TEXTS}),
        ("score: queries + documents, N -> N", "/v1/score", {**r, "queries": TEXTS[:2], "documents": TEXTS[1:]}),
        ("score: 1 -> 1", "/v1/score", {**r, "queries": QUERY, "documents": TEXTS[0]}),
        ("score: N -> M mismatch", "/v1/score", {**r, "queries": TEXTS[:2], "documents": TEXTS}),
        ("rerank", "/rerank", {**r, "query": QUERY, "documents": TEXTS}),
        ("v1/rerank top_n 2", "/v1/rerank", {**r, "query": QUERY, "documents": TEXTS, "top_n": 2}),
        ("v2/rerank return_documents false", "/v2/rerank",
         {**r, "query": QUERY, "documents": TEXTS, "return_documents": False}),
        ("rerank: no documents", "/rerank", {**r, "query": QUERY, "documents": []}),
        ("rerank: no query", "/rerank", {**r, "documents": TEXTS}),
        ("embeddings on the reranker", "/v1/embeddings", {**r, "input": TEXTS[0]}),
    ]


def send(base: str, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(base + path, json=body, timeout=300)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"raw": r.text}


def vectors(body: dict) -> list[np.ndarray]:
    out = []
    for d in body.get("data") or ():
        e = d.get("embedding")
        if e is None:
            continue
        out.append(np.frombuffer(base64.b64decode(e), "<f4") if isinstance(e, str) else np.asarray(e, np.float32))
    return out


def scores(body: dict) -> list[tuple[int, float]]:
    """(index, score) of a score or rerank body, in the body's order."""
    if "results" in body:
        return [(r["index"], r["relevance_score"]) for r in body["results"]]
    return [(d["index"], d["score"]) for d in body.get("data") or () if "score" in d]


def compare(name: str, path: str, body: dict, vllm: str, servax: str) -> None:
    (vs, vb), (ss, sb) = send(vllm, path, body), send(servax, path, body)
    vkeys, skeys = flat(shape(vb)), flat(shape(sb))
    only_v = sorted(f"{k}:{v}" for k, v in vkeys.items() if skeys.get(k) != v)
    only_s = sorted(f"{k}:{v}" for k, v in skeys.items() if vkeys.get(k) != v)
    print(f"\n## {name}  status vllm={vs} servax={ss}{'' if vs == ss else '  <-- status differs'}")
    if vs != 200 or ss != 200:
        print(f"   vllm:   {json.dumps(vb)[:300]}")
        print(f"   servax: {json.dumps(sb)[:300]}")
    else:
        vv, sv = vectors(vb), vectors(sb)
        if vv or sv:
            dims = [(len(a), len(b)) for a, b in zip(vv, sv)]
            cos = [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(vv, sv) if len(a) == len(b)]
            norms = [(round(float(np.linalg.norm(a)), 4), round(float(np.linalg.norm(b)), 4)) for a, b in zip(vv, sv)]
            print(f"   {len(vv)} vs {len(sv)} vectors, dims {dims}, cosine min {min(cos, default=float('nan')):.6f}, "
                  f"norms (vllm, servax) {norms}")
        vsc, ssc = scores(vb), scores(sb)
        if vsc or ssc:
            diff = max((abs(a[1] - b[1]) for a, b in zip(sorted(vsc), sorted(ssc))), default=float("nan"))
            print(f"   scores vllm {[(i, round(s, 6)) for i, s in vsc]}")
            print(f"   scores servax {[(i, round(s, 6)) for i, s in ssc]}")
            print(f"   max |diff| {diff:.2e}, same order: {[i for i, _ in vsc] == [i for i, _ in ssc]}")
        if vb.get("usage") != sb.get("usage"):
            print(f"   usage vllm {vb.get('usage')} servax {sb.get('usage')}")
    if only_v:
        print("   only/different in vllm:  ", only_v)
    if only_s:
        print("   only/different in servax:", only_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embed", help="base URL of `vllm serve` of the embedding model")
    parser.add_argument("--rerank", help="base URL of `vllm serve` of the reranker")
    parser.add_argument("--reranker-overrides", action="store_true", help="print the reranker's --hf-overrides")
    args = parser.parse_args()
    if args.reranker_overrides:
        print(json.dumps(reranker_overrides()))
        return
    from transformers import AutoTokenizer

    from conftest import local_llm_servers, openai_api_server
    from registry.tiny import tiny_checkpoint_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint_path("servax-tiny/qwen3"))
    engine = dict(model_impl="jax", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
                  num_kv_blocks=256, show_progress=False)
    configs = []
    if args.embed:
        configs.append({"model_loading_config": {"model_id": EMBED, "model_source": "servax-tiny/qwen3"},
                        "engine_kwargs": {**engine, "runner": "pooling", "convert": "embed",
                                          "pooler_config": {"pooling_type": "LAST", "use_activation": True},
                                          "hf_overrides": {"is_matryoshka": True}}})
    if args.rerank:
        configs.append({"model_loading_config": {"model_id": RERANK, "model_source": "servax-tiny/qwen3"},
                        "engine_kwargs": {**engine, "runner": "pooling", "hf_overrides": reranker_overrides()}})
    with local_llm_servers(configs) as handles, openai_api_server(handles) as servax:
        if args.embed:
            for name, path, body in embed_requests([tokenizer(t).input_ids for t in TEXTS[:2]]):
                compare(name, path, body, args.embed, servax)
        if args.rerank:
            for name, path, body in rerank_requests():
                compare(name, path, body, args.rerank, servax)


if __name__ == "__main__":
    main()
