"""Drop-in for vLLM and Ray Serve LLM users: their engine args, offline script and YAML run as written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from app import LLM, SamplingParams
from app.config import load_app_config
from conftest import REPO, local_llm_servers
from registry.tiny import tiny_checkpoint_path
from runtime.engine.config import EngineConfig

MODEL = "servax-tiny/llama"
SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, show_progress=False)
PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def llm(servax_cache):
    return LLM(MODEL, num_kv_blocks=64, **SMALL)


@pytest.mark.parametrize("arg, value, says", [
    ("pipeline_parallel_size", 2, "use tensor_parallel_size"),
    ("max_seq_len_to_capture", 8192, "precompiles every"),
    ("swap_space", 4, "recomputed"),
    ("cpu_offload_gb", 2, "not offloaded"),
    ("kv_cache_dtype", "fp8_e5m2", "not supported"),
    ("quantization", "awq", "supported: int8"),
    ("generation_config", "/no/such/folder", "'auto', 'vllm' or a folder"),
    ("load_format", "dummy", "drop load_format"),
])
def test_vllm_args_that_cannot_apply_are_refused_saying_why(arg, value, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(model=MODEL, **{arg: value})


def test_vllm_offline_example_runs_unchanged_and_matches_servax_spelling(llm, servax_cache, tmp_path):
    # vLLM's quickstart as its users write it; only the import line differs.
    script = tmp_path / "offline.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from app import LLM, SamplingParams          # was: from vllm import LLM, SamplingParams

        if __name__ == "__main__":
            prompts = {PROMPTS!r}
            sampling_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            llm = LLM(model="{MODEL}", gpu_memory_utilization=0.5, enforce_eager=True, seed=0, dtype="float32",
                      max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, generation_config="auto",
                      tokenizer_mode="auto", trust_remote_code=False, disable_log_stats=True)
            outputs = llm.generate(prompts, sampling_params)
            for output in outputs:
                print(f"Prompt: {{output.prompt!r}}, Generated text: {{output.outputs[0].text!r}}", file=sys.stderr)
            chat = llm.chat([{{"role": "user", "content": "Hello!"}}], sampling_params, use_tqdm=False)
            ids = llm.get_tokenizer()("Hello, my name is").input_ids
            by_ids = llm.generate({{"prompt_token_ids": ids}}, sampling_params)
            print(json.dumps([o.outputs[0].token_ids for o in outputs + chat + by_ids]))
    """))
    # The checkout under test, whatever servax the interpreter has installed (if any).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    ours += [llm.chat([{"role": "user", "content": "Hello!"}], greedy, use_tqdm=False)[0].outputs[0].token_ids]
    ours += [ours[0]]
    assert theirs == ours


def test_generation_config_auto_sets_defaults_vllm_does_not(servax_cache, tmp_path, llm):
    folder = shutil.copytree(tiny_checkpoint_path(MODEL), tmp_path / "with-defaults")
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 0, "temperature": 0.0, "max_new_tokens": 5}))
    auto = LLM(str(folder), loaded_model=None, num_kv_blocks=64, **SMALL)
    assert auto.get_default_sampling_params().temperature == 0.0
    out = auto.generate("Hello", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    explicit = auto.generate("Hello", SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 9  # a SamplingParams is taken as given
    plain = LLM(str(folder), loaded_model=auto.engine.model, generation_config="vllm", num_kv_blocks=64, **SMALL)
    assert plain.get_default_sampling_params() == SamplingParams()


def test_gpu_memory_utilization_sizes_the_cache_from_host_memory(llm):
    shared = LLM(MODEL, loaded_model=llm.engine.model, gpu_memory_utilization=0.5, **SMALL)
    # Capped at twice what max_num_seqs full-length sequences need (+ the null block).
    assert shared.engine.num_blocks == 2 * 4 * (128 // 16) + 1
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        LLM(MODEL, loaded_model=llm.engine.model, gpu_memory_utilization=1e-9, **SMALL)


def test_enforce_eager_compiles_nothing_up_front_and_gives_the_same_tokens(llm):
    eager = LLM(MODEL, loaded_model=llm.engine.model, enforce_eager=True, num_kv_blocks=64, **SMALL)
    assert eager.engine.warmup_seconds == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]


def test_skip_tokenizer_init_serves_token_ids_only(llm):
    from registry.errors import ModelLoadError  # noqa: F401  (the import path users catch)
    from runtime.engine.errors import InvalidRequestError

    bare = LLM(MODEL, skip_tokenizer_init=True, num_kv_blocks=64, **SMALL)
    assert bare.get_tokenizer() is None
    assert bare.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        bare.generate("text", use_tqdm=False)


def test_hf_overrides_change_the_config_before_loading():
    override = LLM(MODEL, hf_overrides={"max_position_embeddings": 96}, num_kv_blocks=64,
                   **dict(SMALL, max_model_len=None))
    assert override.engine.max_model_len == 96


RAY_SERVE_LLM_YAML = """
applications:
- name: llm_app
  route_prefix: /
  import_path: app.builder:build_openai_app     # was: ray.serve.llm:build_openai_app
  args:
    llm_configs:
    - model_loading_config:
        model_id: my-llama
        model_source: servax-tiny/llama
      llm_engine: vLLM
      accelerator_type: A10G
      runtime_env: {env_vars: {SERVAX_EXAMPLE: "1"}}
      placement_group_config: {bundles: [{CPU: 1}], strategy: PACK}
      log_engine_metrics: true
      experimental_configs: {num_ingress_replicas: 1}
      deployment_config:
        autoscaling_config: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 8,
                             look_back_period_s: 15, upscale_smoothing_factor: 1.0}
        max_ongoing_requests: 64
      engine_kwargs: {max_model_len: 128, max_num_seqs: 4, max_num_batched_tokens: 32, dtype: float32,
                      gpu_memory_utilization: 0.5, enforce_eager: false, show_progress: false}
    ingress_deployment_config: {max_ongoing_requests: 100}
"""


def test_ray_serve_llm_yaml_validates_and_places_like_ray(tmp_path):
    path = tmp_path / "ray_llm.yaml"
    path.write_text(RAY_SERVE_LLM_YAML)
    config = load_app_config(path)
    (block,) = config.llm_configs
    opts = block.serve_options()
    assert opts["ray_actor_options"]["accelerator_type"] == "A10G"
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": {"SERVAX_EXAMPLE": "1"}}
    assert opts["placement_group_bundles"] == [{"CPU": 1}] and opts["placement_group_strategy"] == "PACK"
    assert opts["autoscaling_config"]["look_back_period_s"] == 15
    assert config.ingress_config.max_ongoing_requests == 100 and config.ingress_config.num_replicas == 1
    from app.builder import build_app, build_openai_app

    assert build_openai_app is build_app


@pytest.mark.parametrize("key, value, says", [
    ("lora_config", {"dynamic_lora_loading_path": "s3://x"}, "cloud storage URIs are not supported"),
    ("llm_engine", "SGLang", "its own JAX engine"),
    ("placement_group_config", {"bundle": [{"CPU": 1}]}, "bundles"),
    ("experimental_configs", {"warp_speed": 9}, "unknown experimental_configs"),
])
def test_ray_serve_llm_keys_that_cannot_apply_are_refused(key, value, says):
    with pytest.raises(ValueError, match=says):
        load_app_config({"llm_configs": [{"model_loading_config": {"model_id": MODEL}, key: value}]})


def test_ray_serve_llm_yaml_serves_the_same_tokens(tmp_path, llm):
    import yaml

    args = yaml.safe_load(RAY_SERVE_LLM_YAML)["applications"][0]["args"]
    with local_llm_servers(args["llm_configs"]) as handles:
        result = handles["my-llama"].generate.remote(
            "Hello, my name is", {"max_tokens": 8, "temperature": 0, "ignore_eos": True}).result()
    ours = llm.generate("Hello, my name is", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert result.outputs[0].token_ids == ours


def test_beam_search_is_refused_saying_so(llm):
    with pytest.raises(NotImplementedError, match="beam search"):
        llm.beam_search(PROMPTS, {"beam_width": 2, "max_tokens": 4})
