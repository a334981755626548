"""LoRA adapters (runtime/ops/lora.py) against transformers + PEFT on the tiny models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from app import LLM, LoRARequest, SamplingParams
from conftest import hf_greedy, hf_model
from runtime.engine.errors import InvalidRequestError

PROMPT = [(7 * i + 3) % 500 + 4 for i in range(12)]
NEW = 16
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (name, seed, rank, target modules, rsLoRA): all projections; attention only with rsLoRA; MLP only.
ADAPTERS = [("all", 1, 8, ALL, False), ("qv-rslora", 2, 4, ("q_proj", "v_proj"), True),
            ("mlp", 3, 8, ("gate_proj", "up_proj", "down_proj"), False)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)  # EOS held back, as hf_greedy does


def _peft_adapter(base_path: Path, out: Path, seed: int, rank: int, targets, rslora: bool):
    """A random PEFT LoRA adapter (non-zero A and B) saved to `out`; returns the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base_path), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False, use_rslora=rslora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)  # deltas that change the greedy tokens, small enough to stay a fine-tune
    model.save_pretrained(out)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """{name: (LoRARequest, PEFT greedy tokens, PEFT log-softmax of the prompt)} + the base's tokens."""
    import torch

    base_path = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora")
    made = {}
    for i, (name, seed, rank, targets, rslora) in enumerate(ADAPTERS):
        peft_model = _peft_adapter(base_path, root / name, seed, rank, targets, rslora)
        with torch.no_grad():
            logits = peft_model(torch.tensor([PROMPT])).logits[0].float()
        made[name] = (LoRARequest(name, i + 1, str(root / name)), hf_greedy(peft_model, PROMPT, NEW),
                      torch.log_softmax(logits, -1).numpy())
    return base_path, made, hf_greedy(hf_model(base_path), PROMPT, NEW)


@pytest.fixture(scope="module")
def lora_llm(adapters):
    base_path, _, _ = adapters
    return LLM(model=str(base_path), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
               max_num_seqs=4, max_num_batched_tokens=64, show_progress=False, compilation_cache_dir="")


def test_greedy_tokens_and_logprobs_equal_peft(lora_llm, adapters):
    """Each adapter's greedy tokens equal transformers+PEFT; its prompt logprobs are close."""
    _, made, base_tokens = adapters
    for name, (lora, want, log_softmax) in made.items():
        params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, prompt_logprobs=0)
        out = lora_llm.generate({"prompt_token_ids": PROMPT}, params, lora_request=lora, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want, name
        assert out.outputs[0].token_ids != base_tokens, f"{name}: the adapter changed nothing"
        got = np.array([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
        ref = log_softmax[np.arange(len(PROMPT) - 1), PROMPT[1:]]
        np.testing.assert_allclose(got, ref, atol=2e-4)


def test_one_batch_mixes_adapters_and_base_and_equals_each_alone(lora_llm, adapters):
    """3 adapters and the base in one call (2 slots: adapters are evicted and reloaded while
    it runs), each equal to its run alone and to PEFT; nothing compiles."""
    _, made, base_tokens = adapters
    loras = [made[name][0] for name in ("all", "qv-rslora", "mlp")] + [None]
    loads_before = lora_llm.engine.lora.num_loads
    prompts = [{"prompt_token_ids": PROMPT}] * 8
    outs = lora_llm.generate(prompts, GREEDY, lora_request=loras * 2, use_tqdm=False)
    want = [made[name][1] for name in ("all", "qv-rslora", "mlp")] + [base_tokens]
    assert [o.outputs[0].token_ids for o in outs] == want * 2
    alone = [lora_llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=lr, use_tqdm=False)[0]
             for lr in loras]
    assert [o.outputs[0].token_ids for o in alone] == want
    assert lora_llm.engine.lora.num_loads > loads_before  # slots were rewritten
    assert lora_llm.engine.stats().compilations_since_warmup == 0
    assert lora_llm.engine.kv.num_free_blocks == lora_llm.engine.kv.num_usable_blocks  # nothing leaked


def test_prefix_cache_does_not_cross_adapters(lora_llm, adapters):
    """The same prompt under another adapter hits no cached block (its K/V differ)."""
    _, made, base_tokens = adapters
    long_prompt = {"prompt_token_ids": PROMPT * 4}
    first = lora_llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    again = lora_llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the base's own blocks are reused
    under = lora_llm.generate(long_prompt, GREEDY, lora_request=made["all"][0], use_tqdm=False)[0]
    assert under.num_cached_tokens == 0
    assert under.outputs[0].token_ids != first.outputs[0].token_ids


def test_bad_adapters_are_refused_saying_why(lora_llm, adapters, tmp_path):
    base_path, made, _ = adapters
    greedy = SamplingParams(max_tokens=2)
    # Rank above max_lora_rank.
    big = tmp_path / "rank16"
    _peft_adapter(base_path, big, 4, 16, ("q_proj",), False)
    with pytest.raises(InvalidRequestError, match="rank 16 > max_lora_rank=8"):
        lora_llm.generate("hi", greedy, lora_request=LoRARequest("big", 10, str(big)))
    # An adapter of another base: the shapes of a wider model.
    other = tmp_path / "other-base"
    shutil.copytree(made["all"][0].lora_path, other)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(other / "adapter_model.safetensors"))
    save_file({k: np.concatenate([v, v], axis=-1) if "lora_A" in k else v for k, v in tensors.items()},
              str(other / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="another base model"):
        lora_llm.generate("hi", greedy, lora_request=LoRARequest("other", 11, str(other)))
    # A module the model cannot adapt.
    odd = tmp_path / "odd"
    shutil.copytree(made["all"][0].lora_path, odd)
    tensors = load_file(str(odd / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key.replace("q_proj", "rotary_proj")] = tensors[key]
    save_file(tensors, str(odd / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="rotary_proj"):
        lora_llm.generate("hi", greedy, lora_request=LoRARequest("odd", 12, str(odd)))
    # Not an adapter at all; a name taken by another id.
    with pytest.raises(InvalidRequestError, match="neither a local folder nor a reachable hub repo|adapter_config"):
        lora_llm.generate("hi", greedy, lora_request=LoRARequest("none", 13, str(tmp_path / "missing")))
    # The same name under another id (loaded again from elsewhere) replaces the old entry.
    lora_llm.generate("hi", greedy, lora_request=LoRARequest("all", 99, made["all"][0].lora_path))
    assert [r.lora_int_id for r in lora_llm.engine.list_loras() if r.lora_name == "all"] == [99]
    # The engine still serves, adapters and base alike.
    out = lora_llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=made["all"][0], use_tqdm=False)
    assert out[0].outputs[0].token_ids == made["all"][1]
    with pytest.raises(ValueError):
        LoRARequest("x", 0, "/nowhere")
    assert json.loads((Path(made["all"][0].lora_path) / "adapter_config.json").read_text())["r"] == 8


def test_remove_and_readd_adapter(lora_llm, adapters):
    _, made, _ = adapters
    lora = made["mlp"][0]
    assert lora_llm.engine.add_lora(lora)
    assert lora.lora_int_id in {r.lora_int_id for r in lora_llm.engine.list_loras()}
    assert lora_llm.engine.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in {r.lora_int_id for r in lora_llm.engine.list_loras()}
    assert not lora_llm.engine.remove_lora(lora.lora_int_id)
    out = lora_llm.generate({"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == made["mlp"][1]


def test_lora_needs_enable_lora_and_a_native_model(tiny_checkpoint, adapters):
    _, made, _ = adapters
    plain = LLM(model="servax-tiny/llama", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                enforce_eager=True, show_progress=False, compilation_cache_dir="")
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.generate("hi", SamplingParams(max_tokens=2), lora_request=made["all"][0])
    with pytest.raises(ValueError, match="native JAX models"):
        LLM(model="servax-tiny/llama", model_impl="torchax", enable_lora=True, max_model_len=64,
            enforce_eager=True, show_progress=False, compilation_cache_dir="")


# ---- over HTTP (Serve's local testing mode, uvicorn, the openai client) -----------------------------

@pytest.fixture(scope="module")
def lora_http(adapters, tmp_path_factory):
    """The tiny Llama with a static adapter (lora_modules) behind the OpenAI ingress, runtime
    loading allowed: (base URL, PEFT-made adapters)."""
    from app.builder import lora_routes
    from app.config import load_app_config
    from conftest import local_llm_servers, openai_api_server

    base_path, made, base_tokens = adapters
    block = {
        "model_loading_config": {"model_id": "tiny", "model_source": str(base_path)},
        "engine_kwargs": {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_loras": 2,
                          "max_lora_rank": 8, "show_progress": False, "compilation_cache_dir": ""},
        "lora_modules": [{"name": "static-all", "path": made["all"][0].lora_path}],
    }
    config = load_app_config({"llm_configs": [block], "ingress_config": {"allow_runtime_lora_updating": True}})
    with local_llm_servers([block]) as handles, openai_api_server(handles, lora=lora_routes(config)) as url:
        yield url, made, base_tokens, handles["tiny"]


def _completion(client, model: str) -> tuple[str, str]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0.0,
                                    extra_body={"min_tokens": NEW})
    return out.model, out.choices[0].text


def _text(made, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    base = json.loads((Path(made["all"][0].lora_path) / "adapter_config.json").read_text())["base_model_name_or_path"]
    return AutoTokenizer.from_pretrained(base).decode(tokens, skip_special_tokens=True)


def test_http_serves_static_and_runtime_loaded_adapters(lora_http):
    import requests

    from conftest import assert_openai_error, openai_client

    url, made, base_tokens, handle = lora_http
    client = openai_client(url)
    # A static adapter (lora_modules): PEFT's tokens, the adapter named in the response.
    assert _completion(client, "static-all") == ("static-all", _text(made, made["all"][1]))
    # Load another at run time, use it, list it, unload it.
    r = requests.post(f"{url}/v1/load_lora_adapter",
                      json={"lora_name": "qv", "lora_path": made["qv-rslora"][0].lora_path}, timeout=60)
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert _completion(client, "qv") == ("qv", _text(made, made["qv-rslora"][1]))
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "static-all", "qv"}
    assert cards["qv"].parent == "tiny" and cards["qv"].root == made["qv-rslora"][0].lora_path
    again = requests.post(f"{url}/v1/load_lora_adapter",
                          json={"lora_name": "qv", "lora_path": made["qv-rslora"][0].lora_path}, timeout=60)
    assert_openai_error(again, 400)
    r = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "qv"}, timeout=60)
    assert r.status_code == 200 and "removed successfully" in r.text
    gone = requests.post(f"{url}/v1/completions", json={"model": "qv", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert_openai_error(gone, 404, param="model", code="model_not_found")
    assert_openai_error(requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "qv"}, timeout=60), 404)
    # The base model is still the base model.
    assert _completion(client, "tiny") == ("tiny", _text(made, base_tokens))
    # Python handle calls take the LoRARequest itself.
    sampling = {"temperature": 0.0, "max_tokens": NEW, "min_tokens": NEW}
    result = handle.generate.remote({"prompt_token_ids": PROMPT}, sampling, made["mlp"][0]).result()
    assert result.outputs[0].token_ids == made["mlp"][1]
    deltas = list(handle.options(stream=True).stream.remote({"prompt_token_ids": PROMPT}, sampling,
                                                            lora_request=made["all"][0]))
    assert [t for d in deltas for t in d.token_ids] == made["all"][1]
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    assert 'servax:lora_requests{lora_name="static-all",model_name="tiny"}' in metrics, metrics[-2000:]
    assert "servax:lora_adapters_loaded" in metrics


def test_http_bad_adapter_is_a_400_and_nothing_else_is_disturbed(lora_http, tmp_path):
    import requests

    from conftest import assert_openai_error, openai_client

    url, made, _, _ = lora_http
    base_path = Path(json.loads((Path(made["all"][0].lora_path) / "adapter_config.json").read_text())
                     ["base_model_name_or_path"])
    big = tmp_path / "rank16"
    _peft_adapter(base_path, big, 5, 16, ("q_proj",), False)
    r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)}, timeout=60)
    assert "max_lora_rank" in assert_openai_error(r, 400)["message"]
    r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "nowhere", "lora_path": str(tmp_path / "no")},
                      timeout=60)
    assert_openai_error(r, 400)
    assert {m.id for m in openai_client(url).models.list().data} == {"tiny", "static-all"}
    assert_openai_error(requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=60), 400)
    assert _completion(openai_client(url), "static-all") == ("static-all", _text(made, made["all"][1]))


RAY_SERVE_LLM_LORA_YAML = """
applications:
- name: llm-app
  route_prefix: /
  import_path: app.builder:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: tiny-lora, model_source: {base}}}
      engine_kwargs: {{max_model_len: 128, max_num_seqs: 4, max_num_batched_tokens: 32, max_loras: 1,
                      max_lora_rank: 8, show_progress: false}}
      lora_config: {{dynamic_lora_loading_path: {adapters}, max_num_adapters_per_replica: 2}}
      deployment_config: {{num_replicas: 2, ray_actor_options: {{num_cpus: 0.5}}}}
"""


@pytest.mark.slow
@pytest.mark.cluster
def test_ray_serve_llm_yaml_with_lora_config_serves_base_colon_adapter_on_two_replicas(adapters, tmp_path_factory):
    """Ray Serve LLM's lora_config: "<model_id>:<adapter>" loads the adapter folder on demand on
    a replica (Serve multiplexing); PEFT's tokens over HTTP; an unknown adapter is a 404."""
    import requests

    from conftest import assert_openai_error, openai_client, serve_run

    base_path, made, base_tokens = adapters
    root = tmp_path_factory.mktemp("lora-serve")
    for name in ("all", "mlp"):
        shutil.copytree(made[name][0].lora_path, root / "adapters" / name)
    config = root / "lora.yaml"
    config.write_text(RAY_SERVE_LLM_LORA_YAML.format(base=base_path, adapters=root / "adapters"))
    with serve_run(config, root) as run:
        client = openai_client(run.base_url)
        for _ in range(2):  # the second round finds the adapters loaded
            for name in ("all", "mlp"):
                assert _completion(client, f"tiny-lora:{name}") == (f"tiny-lora:{name}", _text(made, made[name][1]))
            assert _completion(client, "tiny-lora") == ("tiny-lora", _text(made, base_tokens))
        stream = client.chat.completions.create(model="tiny-lora:all", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True)
        assert [c.model for c in stream][0] == "tiny-lora:all"
        missing = requests.post(f"{run.base_url}/v1/completions",
                                json={"model": "tiny-lora:nope", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert_openai_error(missing, 404, param="model", code="model_not_found")
        assert _completion(client, "tiny-lora:mlp")[1] == _text(made, made["mlp"][1])


_TP_SCRIPT = """
import json, sys
from app import LLM, LoRARequest, SamplingParams
base, a_path, a_tokens, tokens_base = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model=base, enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=128, max_num_seqs=4,
          max_num_batched_tokens=64, show_progress=False, compilation_cache_dir="", tensor_parallel_size=2,
          enforce_eager=True)
prompt = {"prompt_token_ids": json.loads(sys.argv[5])}
g = SamplingParams(temperature=0.0, max_tokens=len(a_tokens), min_tokens=len(a_tokens))
outs = llm.generate([prompt, prompt], g, lora_request=[LoRARequest("a", 1, a_path), None], use_tqdm=False)
layer = llm.engine.model.params["layers"][0]["lora"]
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "q_b": str(layer["q_proj"]["b"].sharding.spec), "o_a": str(layer["o_proj"]["a"].sharding.spec)}))
"""


@pytest.mark.slow
def test_adapters_shard_like_their_weights_under_tensor_parallelism(adapters):
    """tp=2 on fake devices: the slot tables split as the base weights do (q's output, o's
    input), and the tokens are PEFT's."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    base_path, made, base_tokens = adapters
    lora, want, _ = made["all"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(base_path), lora.lora_path, json.dumps(want),
                           json.dumps(base_tokens), json.dumps(PROMPT)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tokens"] == [want, base_tokens]
    assert out["q_b"] == "P(None, None, 'model')" and out["o_a"] == "P(None, 'model', None)"


def test_speculative_decoding_under_adapters_gives_each_adapters_tokens(lora_llm, adapters):
    """n-gram drafts verified in one batch under a mix of adapters and the base: each sequence's
    tokens are still its adapter's (PEFT's greedy tokens, or the engine's without drafts)."""
    _, made, base_tokens = adapters
    with pytest.raises(ValueError, match="needs its own registry.load"):
        LLM(model=str(adapters[0]), loaded_model=lora_llm.engine.model, enable_lora=True, show_progress=False)
    spec = LLM(model=str(adapters[0]), enable_lora=True, max_loras=2, compilation_cache_dir="",
               max_lora_rank=8, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, show_progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2, "adaptive_drafts": False})
    loras = [made[name][0] for name in ("all", "qv-rslora")] + [None, None]
    loop = [229, 197, 197, 197]  # the tiny model loops after it: drafts are accepted
    prompts = [{"prompt_token_ids": p} for p in (PROMPT, PROMPT, PROMPT, loop)]
    want = [made["all"][1], made["qv-rslora"][1], base_tokens,
            lora_llm.generate(prompts[3], GREEDY, lora_request=loras[3], use_tqdm=False)[0].outputs[0].token_ids]
    outs = spec.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0, stats
    print(f"\nacceptance under adapters: {stats.spec_decode_num_accepted_tokens}/{stats.spec_decode_num_draft_tokens}")
