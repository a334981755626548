"""registry.resolve / registry.load: sources, implementation choice, errors, sharded loading."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import registry
from conftest import PagedRunner, hf_logits, hf_model
from registry.errors import ModelLoadError
from runtime.ops.step import KVCacheSpec, LoadedModel

ROOT = Path(__file__).resolve().parents[1]


def edited_copy(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of a checkpoint folder with some config.json fields changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def unrecorded_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint that no earlier load recorded (registry.hf_cache keys on content)."""
    return edited_copy(src, dst, servax_test_copy=str(dst))


def test_resolve_tiny_id_picks_native_jax(servax_cache):
    resolved = registry.resolve("servax-tiny/llama")
    assert resolved.architecture == "LlamaForCausalLM" and resolved.impl == "jax"
    assert (resolved.path / "config.json").is_file() and resolved.path.is_relative_to(servax_cache)


def test_resolve_local_folder(tiny_checkpoint):
    resolved = registry.resolve(str(tiny_checkpoint("qwen3")))
    assert resolved.architecture == "Qwen3ForCausalLM" and resolved.impl == "jax"
    assert resolved.hf_config.head_dim == 32


def test_unregistered_architecture_falls_back_to_torchax_on_auto(tiny_checkpoint):
    resolved = registry.resolve(str(tiny_checkpoint("gpt2")))
    assert resolved.architecture == "GPT2LMHeadModel" and resolved.impl == "torchax"
    assert registry.resolve(str(tiny_checkpoint("llama")), model_impl="torchax").impl == "torchax"


def test_unregistered_architecture_with_impl_jax_is_an_error(tiny_checkpoint):
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        registry.load(str(tiny_checkpoint("gpt2")), model_impl="jax")


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder"):
        registry.resolve(str(tmp_path / "nope"))


def test_folder_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        registry.resolve(str(tmp_path))


def test_unknown_hub_id_offline_is_an_error(monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="servax-no-such-org/no-such-model.*hub"):
        registry.resolve("servax-no-such-org/no-such-model")


def test_unsupported_dtype_is_an_error(tiny_checkpoint):
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        registry.load(str(tiny_checkpoint("llama")), dtype="int8")


def test_unknown_model_impl_is_an_error(tiny_checkpoint):
    with pytest.raises(ModelLoadError, match="model_impl must be one of"):
        registry.resolve(str(tiny_checkpoint("llama")), model_impl="vllm")


def test_impl_is_a_deprecated_alias_of_model_impl(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    with pytest.warns(DeprecationWarning, match="impl= is deprecated.*model_impl="):
        assert registry.resolve(path, impl="torchax").impl == "torchax"
    with pytest.warns(DeprecationWarning, match="use model_impl="):
        assert registry.load(path, impl="jax").impl == "jax"
    with pytest.warns(DeprecationWarning), pytest.raises(ModelLoadError, match="contradicts model_impl='jax'"):
        registry.resolve(path, model_impl="jax", impl="torchax")


def test_unsupported_rope_type_is_an_error(tiny_checkpoint, tmp_path):
    rope = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256,
            "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    path = edited_copy(tiny_checkpoint("llama"), tmp_path / "longrope", rope_parameters=rope)
    with pytest.raises(ModelLoadError, match="rope_type 'longrope' is not supported"):
        registry.load(str(path), model_impl="jax")


def test_weight_shape_mismatch_is_an_error(tiny_checkpoint, tmp_path):
    path = edited_copy(tiny_checkpoint("llama"), tmp_path / "bad", intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight has shape \(128, 64\).*\(96, 64\)"):
        registry.load(str(path))


def test_missing_weights_are_an_error(tiny_checkpoint, tmp_path):
    path = edited_copy(tiny_checkpoint("llama"), tmp_path / "deeper", num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match="weights missing.*model.layers.2"):
        registry.load(str(path))


def test_load_fills_loaded_model(tiny_checkpoint):
    model = registry.load(str(tiny_checkpoint("llama3")))
    assert isinstance(model, LoadedModel) and model.impl == "jax"
    assert model.kv_spec == KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=jax.numpy.float32)
    assert model.kv_partition_spec == P(None, None, "model", None, None)  # [layers, blocks, heads, tokens, dim]
    assert model.max_model_len == 1024 and model.vocab_size == 512
    assert model.eos_token_ids == (0,)
    assert model.tokenizer is not None
    assert model.tokenizer.decode(model.tokenizer.encode("Hello world")) == "Hello world"
    assert model.hf_config.model_type == "llama"
    assert jax.tree.structure(model.params) == jax.tree.structure(
        model.param_shardings, is_leaf=lambda x: isinstance(x, P))
    assert model.params["layers"]["q"].shape == (2, 64, 4, 16)  # [layers, hidden, heads, head_dim]


def test_stacked_layer_weights_load_exactly_from_per_layer_tensors(tiny_checkpoint):
    """Each stacked weight [layers, ...] holds, at layer i, checkpoint tensor model.layers.{i}.... in
    the native layout, bit for bit; a stacked weight names one tensor per layer."""
    from models_jax.llama import ENTRY
    from models_jax.weights import is_weight_spec
    from registry.weights import open_checkpoint

    path = tiny_checkpoint("qwen2")  # q/k/v biases too
    model = registry.load(str(path), model_impl="jax")
    tensors = open_checkpoint(path)
    table = ENTRY.weight_table(model.step_fn.keywords["args"])
    specs = jax.tree.leaves(table["layers"], is_leaf=is_weight_spec)
    assert len(specs) == len(jax.tree.leaves(model.params["layers"])) == 12
    for w, stacked in zip(specs, jax.tree.leaves(model.params["layers"])):
        assert w.num_layers == 2 and w.hf_names == [w.hf_name.format(layer=i) for i in (0, 1)]
        assert stacked.shape == w.shape == (2, *np.shape(w.to_native(tensors[w.hf_names[0]])))
        for i, name in enumerate(w.hf_names):
            assert name.startswith(f"model.layers.{i}.")
            np.testing.assert_array_equal(np.asarray(stacked[i]), w.to_native(tensors[name]), err_msg=name)


def prefill_last_logits(model, ids: np.ndarray) -> np.ndarray:  # [V], one sequence in one step
    return PagedRunner(model, pad_tokens=len(ids), pad_seqs=1).run([(0, 0, list(ids))])[0]


def hf_last_logits(path: Path, ids: np.ndarray) -> np.ndarray:  # [V]
    return hf_logits(hf_model(path), list(ids))[-1]


def test_tied_embeddings_use_the_embedding_as_lm_head(tmp_path):
    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen2", tmp_path / "tied", tie_word_embeddings=True)
    model = registry.load(str(path))
    assert "lm_head" not in model.params
    ids = np.arange(4, 24)
    assert np.abs(prefill_last_logits(model, ids) - hf_last_logits(path, ids)).max() < 1e-4


_SHARDED_SCRIPT = textwrap.dedent("""
    import dataclasses
    import jax, numpy as np
    import registry
    from registry.errors import ModelLoadError
    from runtime.ops.step import allocate_kv_cache, make_step_input
    from jax.sharding import NamedSharding, PartitionSpec as P

    from models_jax.llama import ENTRY
    from models_jax.weights import init_params
    from runtime.ops.mesh import make_mesh

    def mesh(n):
        return make_mesh(n, devices=jax.devices()[:n])

    def run(model, m):
        ids = np.arange(4, 34)
        t = len(ids)
        spec = model.kv_partition_spec
        cache = allocate_kv_cache(model.kv_spec, 16, 4, NamedSharding(m, spec))
        batch = make_step_input(input_ids=ids, positions=np.arange(t), slot_mapping=np.arange(t),
            block_tables=np.arange(8)[None], seq_lens=np.array([t]), query_start_loc=np.array([0, t]),
            logits_indices=np.array([t - 1]), num_seqs=1, num_tokens=t)
        return np.asarray(jax.jit(model.step_fn)(model.params, cache, batch)[0])

    one_device = registry.load("servax-tiny/mistral", mesh=mesh(1))
    ref = run(one_device, mesh(1))
    for n in (2, 4):
        model = registry.load("servax-tiny/mistral", mesh=mesh(n))
        # each device read only its slice of every layer's tensors: together, the same weights
        # (at tp=4 the 2 KV heads are stored twice, so k and v differ in shape; compare the rest)
        for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(one_device.params)):
            assert a.shape != b.shape or np.array_equal(np.asarray(a), np.asarray(b))
        q = model.params["layers"]["q"]
        assert q.sharding.spec == P(None, None, "model", None), q.sharding
        assert q.addressable_shards[0].data.shape == (2, 64, 4 // n, 16)
        print(n, "kv_spec", model.kv_partition_spec, "max diff", np.abs(run(model, mesh(n)) - ref).max())
        assert np.abs(run(model, mesh(n)) - ref).max() < 1e-4
        # random params from the same table land with the loaded params' shardings
        args = model.step_fn.keywords["args"]
        params, specs = init_params(ENTRY.weight_table(args), mesh(n), np.float32, jax.random.key(0))
        assert specs == model.param_shardings
        assert jax.tree.map(lambda a: a.sharding, params) == jax.tree.map(lambda a: a.sharding, model.params)
        assert params["layers"]["q"].addressable_shards[0].data.shape == (2, 64, 4 // n, 16)
        assert np.isfinite(run(dataclasses.replace(model, params=params), mesh(n))).all()
    try:
        registry.load("servax-tiny/mistral", mesh=mesh(8))
    except ModelLoadError as e:
        print("tp8:", e)
""")


@pytest.mark.slow
def test_load_shards_params_over_a_model_axis(servax_cache):
    """On 8 fake CPU devices: tp=2 and tp=4 give the 1-device logits; tp=8 does not divide 4 heads."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=str(ROOT),
               SERVAX_CACHE=str(servax_cache), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 kv_spec P(None, None, 'model', None, None)" in out.stdout
    # 2 kv heads on 4 devices: each stored twice (registry.native.kv_repeat), so the cache still splits
    assert "4 kv_spec P(None, None, 'model', None, None)" in out.stdout
    assert "num_attention_heads=4 is not divisible by the model axis size 8" in out.stdout


def test_missing_torchax_fallback_is_a_clear_error(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "registry.torchax_model", None)  # as if nobody had written it
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel needs the torchax fallback.*LlamaForCausalLM"):
        registry.load(str(tiny_checkpoint("gpt2")))


@pytest.mark.slow
def test_bfloat16_checkpoint_loads_as_float32_and_auto(tmp_path):
    """bfloat16 safetensors (which numpy cannot name) upcast exactly; dtype='auto' keeps bfloat16."""
    from safetensors.torch import load_file

    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen3", tmp_path / "bf16", dtype="bfloat16")
    assert registry.load(str(path), dtype="auto").params["embed"].dtype == jax.numpy.bfloat16
    model = registry.load(str(path), dtype="float32")
    embed = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), embed.float().numpy())
    ids = np.arange(4, 24)
    assert np.abs(prefill_last_logits(model, ids) - hf_last_logits(path, ids)).max() < 1e-4


def test_native_table_is_built_from_the_models_declarations():
    import importlib
    import pkgutil

    import models_jax
    from models_jax import gpt_oss, llama, llama_moe

    modules = [importlib.import_module(f"models_jax.{m.name}") for m in pkgutil.iter_modules(models_jax.__path__)]
    entries = [m.ENTRY for m in modules if hasattr(m, "ENTRY")]
    assert all(e in entries for e in (llama.ENTRY, llama_moe.ENTRY, gpt_oss.ENTRY))
    assert registry.NATIVE_MODELS == {arch: e for e in entries for arch in e.architectures}
    assert set(llama.ENTRY.architectures) == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
    assert set(llama_moe.ENTRY.architectures) == {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
    assert gpt_oss.ENTRY.architectures == ("GptOssForCausalLM",)


def test_a_new_model_module_is_found_by_its_declaration(tmp_path, monkeypatch):
    """A package of model modules: each ENTRY joins the table; one architecture declared twice is refused."""
    from registry.native import declared_models

    pkg = tmp_path / "fake_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    entry = ("from models_jax import ModelEntry\n"
             "ENTRY = ModelEntry(architectures={archs!r}, config_from_hf=None, weight_table=None, forward=None)\n")
    (pkg / "alpha.py").write_text(entry.format(archs=("AlphaForCausalLM", "BetaForCausalLM")))
    (pkg / "helpers.py").write_text("X = 1\n")  # declares nothing: not a model
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_models

    table = declared_models(fake_models)
    assert sorted(table) == ["AlphaForCausalLM", "BetaForCausalLM"]
    assert table["AlphaForCausalLM"].architectures == ("AlphaForCausalLM", "BetaForCausalLM")
    (pkg / "gamma.py").write_text(entry.format(archs=("BetaForCausalLM",)))
    with pytest.raises(ImportError, match="BetaForCausalLM is declared by two native models: "
                                          "fake_models.alpha and fake_models.gamma"):
        declared_models(fake_models)


def test_load_takes_a_tokenizer_from_another_source(tiny_checkpoint, tmp_path):
    from registry.tiny import make_tokenizer

    other = make_tokenizer()
    other.model_max_length = 123  # tells the two tokenizers apart
    other.save_pretrained(tmp_path / "tok")
    model = registry.load(str(tiny_checkpoint("llama")), tokenizer=str(tmp_path / "tok"))
    assert model.tokenizer.model_max_length == 123
    with pytest.raises(ModelLoadError, match="tokenizer .*no-such-tokenizer.*cannot be loaded"):
        registry.load(str(tiny_checkpoint("llama")), tokenizer=str(tmp_path / "no-such-tokenizer"))


def test_model_info_is_read_once_for_both_paths(tmp_path):
    """EOS ids (generation_config first), context length under its other names, dtype names."""
    import types

    import jax.numpy as jnp

    from registry.model_info import eos_token_ids, jax_dtype, max_model_len

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert eos_token_ids(tmp_path, types.SimpleNamespace(eos_token_id=1)) == (2, 7)
    assert eos_token_ids(tmp_path / "none", types.SimpleNamespace(eos_token_id=1)) == (1,)
    assert eos_token_ids(tmp_path / "none", types.SimpleNamespace()) == ()
    assert max_model_len(types.SimpleNamespace(n_positions=300)) == 300  # GPT-2's name
    assert max_model_len(types.SimpleNamespace(max_position_embeddings=4096, n_positions=1)) == 4096
    assert jax_dtype("bfloat16") == jax_dtype(jnp.bfloat16) == jnp.bfloat16
    assert jax_dtype("auto", types.SimpleNamespace(dtype="torch.float16")) == jnp.float16
    assert jax_dtype("auto", types.SimpleNamespace()) == jnp.float32


@pytest.mark.parametrize("name", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_recorded_config_and_tokenizer_build_what_transformers_builds(tiny_checkpoint, tmp_path, name):
    """A native model's second start reads the config and tokenizer class an earlier start
    recorded (registry.hf_cache), and gets the same model arguments and the same tokenizer."""
    import transformers

    from registry.hf_cache import ConfigRecord
    from registry.model_info import eos_token_ids, load_tokenizer, max_model_len
    from registry.native import NATIVE_MODELS

    path = unrecorded_copy(tiny_checkpoint(name), tmp_path / name)
    first, second = registry.resolve(str(path)), registry.resolve(str(path))
    assert not isinstance(first.hf_config, ConfigRecord) and isinstance(second.hf_config, ConfigRecord)
    real = transformers.AutoConfig.from_pretrained(path)
    from_hf = NATIVE_MODELS[second.architecture].config_from_hf
    assert from_hf(second.hf_config) == from_hf(real)
    assert second.hf_config.to_dict() == json.loads(json.dumps(real.to_dict()))
    assert max_model_len(second.hf_config) == max_model_len(real)
    assert eos_token_ids(path, second.hf_config) == eos_token_ids(path, real)

    want = transformers.AutoTokenizer.from_pretrained(str(path))
    load_tokenizer(path)  # records the class
    got = load_tokenizer(path)
    text = "Hello <|im_start|>wörld 123\n"
    chat = [{"role": "user", "content": "hi"}]
    assert type(got) is type(want) and got.get_vocab() == want.get_vocab()
    assert got(text)["input_ids"] == want(text)["input_ids"]
    assert got.all_special_tokens == want.all_special_tokens and got.eos_token_id == want.eos_token_id
    assert (got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_recorded_config_follows_edits_and_the_torchax_path(tiny_checkpoint, tmp_path):
    from registry.hf_cache import ConfigRecord

    path = unrecorded_copy(tiny_checkpoint("llama"), tmp_path / "llama")
    registry.resolve(str(path))
    assert isinstance(registry.resolve(str(path)).hf_config, ConfigRecord)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.125}))
    edited = registry.resolve(str(path))
    assert not isinstance(edited.hf_config, ConfigRecord) and edited.hf_config.rms_norm_eps == 0.125
    assert registry.resolve(str(path)).hf_config.rms_norm_eps == 0.125  # recorded anew
    forced = registry.resolve(str(path), model_impl="torchax")  # builds the transformers model: the real config
    assert forced.impl == "torchax" and not isinstance(forced.hf_config, ConfigRecord)
    overridden = registry.resolve(str(path), hf_overrides={"rms_norm_eps": 0.5})
    assert overridden.hf_config.rms_norm_eps == 0.5 and registry.resolve(str(path)).hf_config.rms_norm_eps == 0.125


@pytest.mark.slow
def test_warm_start_of_a_native_model_imports_no_torch(tiny_checkpoint, tmp_path):
    """transformers' config classes import torch (seconds); a native model's second load in a
    fresh process needs neither, and still loads and tokenizes."""
    path = unrecorded_copy(tiny_checkpoint("qwen3"), tmp_path / "qwen3")
    script = textwrap.dedent(f"""
        import json, sys
        import registry
        model = registry.load({str(path)!r})
        print(json.dumps({{"torch": "torch" in sys.modules, "ids": model.tokenizer("hello world")["input_ids"],
                           "layers": model.stages.num_layers}}))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["torch"] and not runs[1]["torch"]
    assert runs[0]["ids"] == runs[1]["ids"] and runs[0]["layers"] == runs[1]["layers"] == 2
