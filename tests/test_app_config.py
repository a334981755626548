"""The YAML/args schema (app.config) and the OpenAI request models (app.openai_requests): unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig, load_app_config, sanitize_name
from app.openai_requests import ChatCompletionRequest, CompletionRequest

REPO = Path(__file__).resolve().parents[1]


def _block(model_id: str = "servax-tiny/llama", **extra) -> dict:
    return {"model_loading_config": {"model_id": model_id}, **extra}


def _error(args) -> str:
    with pytest.raises(ValueError) as info:
        load_app_config(args)
    return str(info.value)


@pytest.mark.parametrize("name", ["app", "tiny", "multi-model", "tensor-parallel", "hub-qwen", "multiprocess-cpu", "moe"])
def test_shipped_configs_validate(name):
    config = load_app_config(REPO / "configs" / f"{name}.yaml")
    assert config.llm_configs
    for block in config.llm_configs:
        assert block.engine_config().model == block.model_loading_config.source


def test_default_app_serves_the_demo_model_natively():
    (block,) = load_app_config(REPO / "configs" / "app.yaml").llm_configs
    engine = block.engine_config()
    assert (block.model_id, engine.model, engine.model_impl) == (
        "smollm2-135m-instruct", "servax-demo/smollm2-135m-instruct", "jax")
    assert engine.dtype == "float32"


def test_tiny_app_serves_tiny_llama_with_small_context():
    (block,) = load_app_config(REPO / "configs" / "tiny.yaml").llm_configs
    engine = block.engine_config()
    assert (block.model_id, engine.model, engine.model_impl) == ("servax-tiny/llama", "servax-tiny/llama", "jax")
    assert engine.max_model_len <= 512


def test_multi_model_has_native_and_fallback_models():
    blocks = load_app_config(REPO / "configs" / "multi-model.yaml").llm_configs
    impls = {b.model_id: b.engine_config().model_impl for b in blocks}
    assert impls == {"servax-tiny/llama": "jax", "servax-tiny/gpt2": "auto"}


def test_tensor_parallel_config_asks_for_four_chips():
    (block,) = load_app_config(REPO / "configs" / "tensor-parallel.yaml").llm_configs
    assert block.engine_config().tensor_parallel_size == 4
    assert block.deployment_config.serve_options()["ray_actor_options"]["resources"] == {"TPU": 4}


def test_model_source_defaults_to_model_id():
    config = load_app_config({"llm_configs": [_block("servax-tiny/gpt2")]})
    assert config.llm_configs[0].engine_config().model == "servax-tiny/gpt2"


def test_unknown_engine_kwarg_is_named():
    msg = _error({"llm_configs": [_block(engine_kwargs={"max_modle_len": 512})]})
    assert "llm_configs.0.engine_kwargs" in msg and "engine_kwargs.max_modle_len" in msg and "unknown field" in msg


def test_bad_engine_value_is_named():
    msg = _error({"llm_configs": [_block(engine_kwargs={"max_model_len": -1, "dtype": "int3"})]})
    assert "engine_kwargs.max_model_len" in msg and "engine_kwargs.dtype" in msg


def test_engine_cross_field_rule_is_reported():
    msg = _error({"llm_configs": [_block(engine_kwargs={"max_num_seqs": 64, "max_num_batched_tokens": 32})]})
    assert "max_num_batched_tokens" in msg


def test_model_in_engine_kwargs_points_to_model_source():
    assert "model_source" in _error({"llm_configs": [_block(engine_kwargs={"model": "x"})]})


def test_unknown_deployment_field_is_named():
    msg = _error({"llm_configs": [_block(deployment_config={"num_replica": 2})]})
    assert "llm_configs.0.deployment_config.num_replica" in msg


def test_unknown_top_level_field_is_named():
    assert "args.llm_config" in _error({"llm_config": [_block()]})


def test_unknown_ray_actor_option_is_named():
    msg = _error({"llm_configs": [_block(deployment_config={"ray_actor_options": {"num_cpu": 1}})]})
    assert "ray_actor_options.num_cpu" in msg


def test_num_replicas_and_autoscaling_are_exclusive():
    msg = _error({"llm_configs": [_block(deployment_config={
        "num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})]})
    assert "num_replicas or autoscaling_config" in msg


def test_autoscaling_options_reach_serve():
    config = load_app_config({"llm_configs": [_block(deployment_config={
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}})]})
    opts = config.llm_configs[0].deployment_config.serve_options()
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"]["max_replicas"] == 4


def test_duplicate_model_ids_rejected():
    assert "duplicate model_id 'm'" in _error({"llm_configs": [_block("m"), _block("m")]})


def test_model_ids_that_sanitize_alike_rejected():
    assert "same deployment name" in _error({"llm_configs": [_block("a/b"), _block("a--b")]})


def test_empty_llm_configs_rejected():
    assert "llm_configs" in _error({"llm_configs": []})


def test_model_impl_shortcut_sets_engine_model_impl_and_must_agree():
    config = load_app_config({"llm_configs": [_block(model_impl="torchax")]})
    assert config.llm_configs[0].engine_config().model_impl == "torchax"
    assert "contradicts" in _error({"llm_configs": [_block(model_impl="jax", engine_kwargs={"model_impl": "torchax"})]})


def test_impl_is_a_deprecated_alias_of_model_impl():
    with pytest.warns(FutureWarning, match="model_impl"):
        config = load_app_config({"llm_configs": [_block(engine_kwargs={"impl": "torchax"})]})
    assert config.llm_configs[0].engine_config().model_impl == "torchax"
    with pytest.warns(FutureWarning, match="model_impl"):
        assert load_app_config({"llm_configs": [_block(impl="jax")]}).llm_configs[0].model_impl == "jax"


def test_block_file_included_relative_to_including_file(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    block = _block("from-file", engine_kwargs={"max_model_len": 64})
    (tmp_path / "models" / "m.yaml").write_text(yaml.safe_dump(block))
    args = {"llm_configs": ["models/m.yaml", _block("inline")]}
    (tmp_path / "app.yaml").write_text(yaml.safe_dump({"applications": [
        {"name": "x", "import_path": "app.builder:build_app", "args": args}]}))
    monkeypatch.chdir("/")
    config = load_app_config(tmp_path / "app.yaml")
    assert [b.model_id for b in config.llm_configs] == ["from-file", "inline"]
    assert config.llm_configs[0].engine_config().max_model_len == 64


def test_block_file_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(_block("cwd-model")))
    monkeypatch.chdir(tmp_path)
    assert load_app_config({"llm_configs": ["m.yaml"]}).llm_configs[0].model_id == "cwd-model"


def test_missing_block_file_names_the_path():
    assert "'no/such.yaml' not found" in _error({"llm_configs": ["no/such.yaml"]})


def test_bad_block_file_names_field(tmp_path):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(_block(engine_kwargs={"blok_size": 16})))
    assert "engine_kwargs.blok_size" in _error({"llm_configs": [str(tmp_path / "m.yaml")]})


def test_config_path_arg_with_overrides():
    config = load_app_config({"config_path": str(REPO / "configs" / "tiny.yaml"),
                              "ingress_config": {"api_key": "k"}})
    assert config.llm_configs[0].model_id == "servax-tiny/llama"
    assert config.ingress_config.resolved_api_key() == "k"


def test_api_key_env_must_be_set(monkeypatch):
    monkeypatch.delenv("SERVAX_TEST_KEY", raising=False)
    config = AppConfig.model_validate({"llm_configs": [_block()], "ingress_config": {"api_key_env": "SERVAX_TEST_KEY"}})
    with pytest.raises(ValueError, match="SERVAX_TEST_KEY"):
        config.ingress_config.resolved_api_key()
    monkeypatch.setenv("SERVAX_TEST_KEY", "secret")
    assert config.ingress_config.resolved_api_key() == "secret"


def test_deployment_names_are_sanitized():
    assert sanitize_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen--Qwen2.5-0.5B-Instruct"
    assert sanitize_name("a b:c#d") == "a-b-c-d"
    config = load_app_config({"llm_configs": [_block("servax-tiny/llama")]})
    assert config.llm_configs[0].deployment_name() == "LLMServer:servax-tiny--llama"


def test_build_app_binds_one_server_per_model_and_an_ingress():
    from app.builder import build_app

    app = build_app({"llm_configs": [_block("a"), _block("b/c")]})
    ingress = app._bound_deployment
    assert ingress.name == "OpenAIIngress"
    handles = ingress.init_args[0]
    assert sorted(handles) == ["a", "b/c"]
    assert handles["b/c"]._bound_deployment.name == "LLMServer:b--c"


def test_colocated_app_is_one_llm_server_deployment_serving_http():
    from app.builder import build_app

    app = build_app({"llm_configs": [_block("b/c", deployment_config={"num_replicas": 2})],
                     "ingress_config": {"colocate": True, "api_key": "k"}})
    server = app._bound_deployment
    assert server.name == "LLMServer:b--c" and server.num_replicas == 2
    assert server.init_args[1] == "k"  # the API key reaches the replica's router
    assert hasattr(server.func_or_class, "__serve_build_asgi_app__")  # it is the app's HTTP ingress


@pytest.mark.parametrize("args, why", [
    ({"llm_configs": [_block("a"), _block("b")]}, "one model, not 2"),
    ({"llm_configs": [_block(lora_config={"dynamic_lora_loading_path": "/adapters"})]}, "multiplexing"),
    ({"llm_configs": [_block(deployment_config={"request_router_config": {"request_router_class": "x:Y"}})]},
     "request_router_config"),
    ({"llm_configs": [_block()], "ingress_config": {"num_replicas": 2}}, "num_replicas does not apply"),
])
def test_colocation_refuses_what_needs_the_separate_ingress(args, why):
    args = {**args, "ingress_config": {**args.get("ingress_config", {}), "colocate": True}}
    message = _error(args)
    assert "ingress_config.colocate" in message and why in message


# ---- OpenAI request bodies ------------------------------------------------------------

def test_completion_request_maps_to_vllm_sampling_names():
    req = CompletionRequest(prompt="hi", max_tokens=5, temperature=0, stop="\n", logit_bias={"7": 5},
                            seed=3, logprobs=2, echo=True, top_k=4, user="ignored")
    kwargs = req.sampling_kwargs()
    assert kwargs == {"n": 1, "max_tokens": 5, "temperature": 0, "stop": ["\n"], "logit_bias": {"7": 5.0},
                      "seed": 3, "logprobs": 2, "prompt_logprobs": 2, "top_k": 4}


def test_completion_prompt_forms():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": []}, "prompt"),
])
def test_completion_request_refusals_name_the_param(body, param):
    # (An unknown field such as `tempreature` is not refused: vLLM ignores it, and so does servax.)
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    assert info.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"tok": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"temperature": -0.5}, "temperature"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_value_ranges_are_sampling_params_own(body, param):
    # The HTTP schema types the fields; the ranges are checked once, by SamplingParams,
    # for HTTP, handles and the offline LLM alike.
    from runtime.engine.errors import InvalidRequestError
    from runtime.engine.input_processor import to_sampling_params

    kwargs = CompletionRequest.model_validate({"prompt": "x", **body}).sampling_kwargs()
    with pytest.raises(InvalidRequestError) as info:
        to_sampling_params(kwargs)
    assert info.value.param == param


def test_temperature_has_no_upper_limit_as_in_vllm():
    from runtime.engine.sampling_params import SamplingParams

    assert SamplingParams(temperature=5.0).temperature == 5.0


def test_chat_request_max_completion_tokens_and_logprobs():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                max_completion_tokens=7, logprobs=True, top_logprobs=2)
    assert req.sampling_kwargs() == {"n": 1, "max_tokens": 7, "logprobs": 2}
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


def test_chat_request_text_parts_are_joined():
    from runtime.engine.input_processor import template_message

    req = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert [template_message(m) for m in req.chat_messages()] == [{"role": "user", "content": "ab"}]


def test_unknown_request_fields_are_listed_as_ignored():
    req = CompletionRequest.model_validate({"prompt": "x", "tempreature": 1, "vendor": {}})
    assert req.ignored_fields == ["tempreature", "vendor"] and "tempreature" not in req.sampling_kwargs()


def test_serving_settings_are_written_in_engine_kwargs_and_kept_out_of_the_engine():
    def block(**engine_kwargs):
        return {"llm_configs": [{"model_loading_config": {"model_id": "m"}, "engine_kwargs": engine_kwargs}]}

    (llm,) = load_app_config(block(tool_call_parser="hermes", enable_auto_tool_choice=True)).llm_configs
    assert llm.serving_config().tool_call_parser == "hermes" and llm.serving_config().enable_auto_tool_choice
    assert not {"tool_call_parser", "enable_auto_tool_choice"} & set(type(llm.engine_config()).model_fields)
    with pytest.raises(ValueError, match=r"engine_kwargs.*tool_call_parser.*hermes"):
        load_app_config(block(tool_call_parser="nope"))
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        load_app_config(block(enable_auto_tool_choice=True))


def test_an_unset_max_tokens_is_decided_once_by_the_input_processor():
    from runtime.engine.input_processor import InputProcessor

    def processor(**defaults):
        return InputProcessor(None, vocab_size=100, max_model_len=64, max_logprobs=5, max_num_seqs=4,
                              sampling_defaults=defaults)

    assert "max_tokens" not in CompletionRequest(prompt="x").sampling_kwargs()  # the protocol sets no default
    assert processor().sampling_params({}).max_tokens == 16  # a prompt: vLLM's and OpenAI completions' 16
    assert processor().sampling_params({}, chat=True).max_tokens is None  # a conversation may fill the context
    assert processor().sampling_params({"max_tokens": 3}, chat=True).max_tokens == 3
    assert processor(max_tokens=7).sampling_params({}, chat=True).max_tokens == 7  # the model's generation_config
