"""configs/multi-model.yaml: a native JAX model and a torchax-fallback model behind one API.

Both LLMServers run in-process (`_local_testing_mode`); the ingress app is called through
httpx's ASGI transport, so routing by `model` is exercised end to end without a cluster.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import REPO, local_llm_servers

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def api(servax_cache):
    from app.config import load_app_config
    from app.ingress import OpenAIRouter, build_openai_api

    blocks = load_app_config(REPO / "configs" / "multi-model.yaml").llm_configs
    with local_llm_servers([b.model_dump() for b in blocks]) as handles:
        yield build_openai_api(OpenAIRouter(handles))


def _call(api, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://servax") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def test_models_report_native_and_fallback_impls(api):
    cards = {m["id"]: m for m in _call(api, "GET", "/v1/models").json()["data"]}
    assert {k: v["impl"] for k, v in cards.items()} == {"servax-tiny/llama": "jax", "servax-tiny/gpt2": "torchax"}


@pytest.mark.parametrize("model", ["servax-tiny/llama", "servax-tiny/gpt2"])
def test_each_model_answers_by_name(api, model):
    body = {"model": model, "prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    a, b = (_call(api, "POST", "/v1/completions", json=body).json() for _ in range(2))
    assert a["model"] == model and a["usage"]["completion_tokens"] == 6
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    chat = _call(api, "POST", "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).json()
    assert chat["model"] == model and chat["usage"]["completion_tokens"] <= 4


def test_the_two_models_are_different_models(api):
    texts = {m: _call(api, "POST", "/v1/completions", json={
        "model": m, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    }).json()["choices"][0]["text"] for m in ("servax-tiny/llama", "servax-tiny/gpt2")}
    assert texts["servax-tiny/llama"] != texts["servax-tiny/gpt2"]


def test_model_is_required_with_two_models(api):
    r = _call(api, "POST", "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
