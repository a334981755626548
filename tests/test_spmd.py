"""Tensor parallelism on a device mesh, for the native and the torchax model paths.

Multi-device runs need XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is
imported, so they happen in tests/spmd_worker.py, once per model path (each run loops
over tensor_parallel_size and prints JSON); the tests below judge that JSON. On fake CPU
devices this proves the layout and the tokens, not speed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from registry.errors import ModelLoadError

WORKER = Path(__file__).with_name("spmd_worker.py")
ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 24
# Prompt lengths 5, 30 and 71: one short, one mid, one longer than the 64-token step
# budget (chunked prefill across steps).
PROMPTS = [[random.Random(n).randrange(4, 500) for _ in range(n)] for n in (5, 30, 71)]
ENGINE = dict(
    max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
    show_progress=False, compilation_cache_dir="",
)
GPT2 = "servax-tiny/gpt2"  # fused block-major q|k|v (c_attn, Conv1D [in, 3 * hidden])
MHA8 = "llama-8-heads"  # 8 query and 8 KV heads: the one model here that splits 8 ways
GQA3 = "llama-12-heads-3-kv"  # 3 KV heads on 4 devices: stored 4 times each, 3 per device

NATIVE_PARAMS = {  # layer 0 of the per-layer weights (runtime/ops/layered.py)
    "q": "layers.q", "k": "layers.k", "v": "layers.v", "o": "layers.o",
    "gate": "layers.mlp.gate", "up": "layers.mlp.up", "down": "layers.mlp.down",
    "embed": "embed", "lm_head": "lm_head",
}
_HF_LLAMA = "layers.0."  # the torchax path steps uniform layers one per call: weights per layer
TORCHAX_LLAMA_PARAMS = {
    "q": _HF_LLAMA + "self_attn.q_proj.weight", "k": _HF_LLAMA + "self_attn.k_proj.weight",
    "v": _HF_LLAMA + "self_attn.v_proj.weight", "o": _HF_LLAMA + "self_attn.o_proj.weight",
    "gate": _HF_LLAMA + "mlp.gate_proj.weight", "up": _HF_LLAMA + "mlp.up_proj.weight",
    "down": _HF_LLAMA + "mlp.down_proj.weight", "embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight",
}
_NEOX = "layers.0."
NEOX_PARAMS = {
    "qkv": _NEOX + "attention.query_key_value.weight", "o": _NEOX + "attention.dense.weight",
    "up": _NEOX + "mlp.dense_h_to_4h.weight", "down": _NEOX + "mlp.dense_4h_to_h.weight",
    "embed": "gpt_neox.embed_in.weight", "lm_head": "lm_head.weight",
}
_GPT2 = "layers.0."
GPT2_PARAMS = {
    "qkv": _GPT2 + "attn.c_attn.weight", "qkv_bias": _GPT2 + "attn.c_attn.bias", "o": _GPT2 + "attn.c_proj.weight",
    "up": _GPT2 + "mlp.c_fc.weight", "down": _GPT2 + "mlp.c_proj.weight",
}


def run_worker(spec: dict, servax_cache: Path) -> dict[tuple[str, int], dict]:
    """Run spmd_worker.py on 8 fake CPU devices; results keyed by (run name, tp). XLA compiles
    there without LLVM's optimizations (a quarter less of CI's time: every engine compiles its
    buckets): the runs compare shardings against one device in the same process, not speed."""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
        JAX_PLATFORMS="cpu",
        SERVAX_CACHE=str(servax_cache), PYTHONPATH=str(ROOT),
    )
    spec = dict(spec, prompts=PROMPTS, max_tokens=MAX_TOKENS, engine=ENGINE)
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["num_devices"] == 8
    return {(r["name"], r["tp"]): r for r in out["results"]}


@pytest.fixture(scope="module")
def native(servax_cache, tmp_path_factory) -> dict[tuple[str, int], dict]:
    from registry.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    mha8 = make_tiny_checkpoint("llama", root / "mha8", num_attention_heads=8, num_key_value_heads=8)
    gqa3 = make_tiny_checkpoint("llama", root / "gqa3", num_attention_heads=12, num_key_value_heads=3, hidden_size=96)
    return run_worker(dict(model_impl="jax", collectives=True, runs=[
        dict(model="servax-tiny/llama", tp=[1, 2, 4], params=NATIVE_PARAMS),  # 4 heads, 2 KV heads
        dict(model="servax-tiny/llama", name="llama-tp8", tp=[8], expect_error=True),
        dict(model=str(mha8), name=MHA8, tp=[1, 8], params=NATIVE_PARAMS),
        dict(model=str(gqa3), name=GQA3, tp=[1, 4], params=NATIVE_PARAMS),
    ]), servax_cache)


@pytest.fixture(scope="module")
def fallback(servax_cache) -> dict[tuple[str, int], dict]:
    return run_worker(dict(model_impl="torchax", collectives=True, runs=[
        dict(model="servax-tiny/gpt_neox", tp=[1, 2, 4], params=NEOX_PARAMS),  # 4 heads = 4 KV heads
        dict(model="servax-tiny/gpt_neox", name="gpt_neox-tp8", tp=[8], expect_error=True),
        dict(model="servax-tiny/llama", name="llama-torchax", tp=[1, 4], params=TORCHAX_LLAMA_PARAMS),
        dict(model=GPT2, tp=[1, 4], params=GPT2_PARAMS),
    ]), servax_cache)


def assert_same_tokens(runs: dict, name: str, tp: int) -> None:
    ref, run = runs[(name, 1)], runs[(name, tp)]
    assert run["mesh"] == {"data": 1, "model": tp}
    for key in ("batched", "alone", "pair"):
        assert all(len(t) >= MAX_TOKENS // 2 for t in ref[key]) and len(ref["batched"][-1]) == MAX_TOKENS
        assert run[key] == ref[key], f"{name} tp={tp}: {key} greedy tokens differ from tp=1"


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_native_greedy_tokens_match_single_device(native, tp):
    assert_same_tokens(native, "servax-tiny/llama", tp)


@pytest.mark.slow
def test_native_eight_way_split_matches_single_device(native):
    assert_same_tokens(native, MHA8, 8)


@pytest.mark.slow
def test_native_kv_heads_not_dividing_tp_match_single_device(native):
    """3 KV heads, tp=4: each KV head is stored 4 times (12 stored heads, 3 per device)."""
    assert_same_tokens(native, GQA3, 4)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_fallback_greedy_tokens_match_single_device(fallback, tp):
    assert_same_tokens(fallback, "servax-tiny/gpt_neox", tp)


@pytest.mark.slow
def test_fallback_gqa_llama_matches_single_device_at_tp4(fallback):
    """2 KV heads on 4 devices: the attention stores each KV head twice, one per device."""
    assert_same_tokens(fallback, "llama-torchax", 4)


@pytest.mark.slow
def test_fallback_fused_qkv_gpt2_matches_single_device_at_tp4(fallback):
    assert_same_tokens(fallback, GPT2, 4)


def check_params(params: dict, expected: dict, tp: int) -> None:
    """expected: name -> (spec, per-device shard shape)."""
    for name, (spec, shard_shape) in expected.items():
        p = params[name]
        assert (p["spec"], tuple(p["shard_shape"])) == (spec, shard_shape), f"{name}: {p}"
        assert p["num_devices"] == tp, f"{name}: {p}"


@pytest.mark.slow
def test_native_params_are_sharded_at_tp4(native):
    # tiny llama: 2 layers, hidden 64, 4 heads x 16, 2 KV heads, intermediate 128, vocab 512.
    # Layers are served one per call from per-layer arrays (runtime/ops/layered.py): layer 0's.
    check_params(native[("servax-tiny/llama", 4)]["params"], {
        "q": ("P(None, 'model', None)", (64, 1, 16)),  # [in, heads, head_dim], one head per device
        # 2 KV heads stored twice each ([64, 4, 16]): each device holds the KV head its query head reads
        "k": ("P(None, 'model', None)", (64, 1, 16)),
        "v": ("P(None, 'model', None)", (64, 1, 16)),
        "o": ("P('model', None, None)", (1, 16, 64)),  # [heads, head_dim, out]
        "gate": ("P(None, 'model')", (64, 32)),
        "up": ("P(None, 'model')", (64, 32)),
        "down": ("P('model', None)", (32, 64)),
        "embed": ("P('model', None)", (128, 64)),  # vocab split
        "lm_head": ("P(None, 'model')", (64, 128)),
    }, 4)
    # where KV heads do divide the axis, k and v are split by head too
    check_params(native[("servax-tiny/llama", 2)]["params"], {
        "k": ("P(None, 'model', None)", (64, 1, 16)), "v": ("P(None, 'model', None)", (64, 1, 16)),
    }, 2)
    # One device serves q/k/v and gate/up joined (models_jax.llama.fuse_layer); split, they stay apart.
    assert native[("servax-tiny/llama", 1)]["joined"]
    assert not native[("servax-tiny/llama", 2)]["joined"] and not native[("servax-tiny/llama", 4)]["joined"]


@pytest.mark.slow
def test_fallback_params_are_sharded_at_tp4(fallback):
    # HF nn.Linear weights are [out, in]: column-parallel splits dim 0, row-parallel dim 1.
    llama = fallback[("llama-torchax", 4)]["params"]
    check_params(llama, {
        "q": ("P('model', None)", (16, 64)),
        # 2 KV heads do not split 4 ways: k/v are whole on every device, and the attention
        # repeats their heads so that the cache splits by head (see the KV cache tests)
        "k": ("P()", (32, 64)),
        "v": ("P()", (32, 64)),
        "o": ("P(None, 'model')", (64, 16)),
        "gate": ("P('model', None)", (32, 64)),
        "up": ("P('model', None)", (32, 64)),
        "down": ("P(None, 'model')", (64, 32)),
        "embed": ("P('model', None)", (128, 64)),
        "lm_head": ("P('model', None)", (128, 64)),
    }, 4)
    check_params(fallback[("servax-tiny/gpt_neox", 4)]["params"], {
        "qkv": ("P('model', None)", (48, 64)),  # fused [heads * 3 * head_dim, in], head-major
        "o": ("P(None, 'model')", (64, 16)),
        "up": ("P('model', None)", (32, 64)),
        "down": ("P(None, 'model')", (64, 32)),
        "embed": ("P('model', None)", (128, 64)),
        "lm_head": ("P('model', None)", (128, 64)),
    }, 4)
    # GPT-2's c_attn is [in, q | k | v]: a column split would cut blocks, not heads
    check_params(fallback[(GPT2, 4)]["params"], {
        "qkv": ("P()", (64, 192)),
        "qkv_bias": ("P()", (192,)),
        "o": ("P('model', None)", (16, 64)),  # Conv1D [in, out]: row-parallel splits dim 0
        "up": ("P(None, 'model')", (64, 64)),
        "down": ("P('model', None)", (64, 64)),
    }, 4)


@pytest.mark.slow
@pytest.mark.parametrize("path,name,tp,kv_heads_per_device", [
    ("native", "servax-tiny/llama", 2, 1),
    ("native", "servax-tiny/llama", 4, 1),  # 2 KV heads, each stored twice
    ("native", MHA8, 8, 1),
    ("native", GQA3, 4, 3),  # 3 KV heads, each stored 4 times
    ("fallback", "servax-tiny/gpt_neox", 2, 2),
    ("fallback", "servax-tiny/gpt_neox", 4, 1),
    ("fallback", "llama-torchax", 4, 1),  # 2 KV heads, each stored twice
    ("fallback", GPT2, 4, 1),
])
def test_kv_cache_is_sharded_on_kv_heads(request, path, name, tp, kv_heads_per_device):
    """Both paths always split the cache (repeating KV heads where tp does not divide them)."""
    run = request.getfixturevalue(path)[(name, tp)]
    kv = run["kv"]  # the stacked K cache, [layers, blocks, kv_heads, block_size, head_dim]
    assert run["kv_heads"] == kv_heads_per_device * tp
    assert kv["partition_spec"] == "P(None, None, 'model', None, None)"
    num_layers, num_blocks, _, block_size, head_dim = kv["shape"]
    assert kv["shard_shape"] == [num_layers, num_blocks, kv_heads_per_device, block_size, head_dim]
    assert kv["num_devices"] == tp


@pytest.mark.slow
def test_native_kv_heads_are_repeated_when_fewer_than_devices(native):
    """2 KV heads on 4 devices: stored 4 times in all, one per device, tokens unchanged."""
    assert native[("servax-tiny/llama", 1)]["kv_heads"] == 2
    run = native[("servax-tiny/llama", 4)]
    assert run["kv_heads"] == 4 and run["kv"]["shape"][2] == 4 and run["kv"]["shard_shape"][2] == 1
    assert native[(GQA3, 1)]["kv_heads"] == 3 and native[(GQA3, 4)]["kv_heads"] == 12


@pytest.mark.slow
def test_fallback_kv_heads_are_repeated_when_fewer_than_devices(fallback):
    """As on the native path: 2 KV heads on 4 devices are stored 4 times in all, one per device."""
    assert fallback[("llama-torchax", 1)]["kv_heads"] == 2
    run = fallback[("llama-torchax", 4)]
    assert run["kv_heads"] == 4 and run["kv"]["shape"][2] == 4 and run["kv"]["shard_shape"][2] == 1
    assert run["batched"] == fallback[("llama-torchax", 1)]["batched"]


@pytest.mark.slow
@pytest.mark.parametrize("path,name,tp,per_layer", [
    # the embedding's, + (attention out, MLP down) per layer, in the layer program (both paths
    # step their uniform layers a few per call: all of the tiny models' 2 layers in one)
    ("native", "servax-tiny/llama", 2, 2),
    ("native", "servax-tiny/llama", 4, 2),
    ("native", GQA3, 4, 2),
    ("fallback", "servax-tiny/gpt_neox", 4, 1),  # parallel residual: one per layer
    # before KV heads were repeated: + 20 all-gathers (each layer's K/V cache), 10 all-to-alls
    # and 4 collective-permutes (k/v split mid-head)
    ("fallback", "llama-torchax", 4, 2),
    ("fallback", GPT2, 4, 2),  # before c_attn was kept whole: + 14 collective-permutes
])
def test_step_communicates_only_megatron_all_reduces(request, path, name, tp, per_layer):
    """All-reduces: the embedding's and per_layer per decoder layer in the programs; one
    all-gather, of the logits (split by vocabulary) for the sampler; in particular the KV cache
    is never gathered (it was, when replicated).

    Nor any collective-permute: q, k and v never move between devices.
    """
    run = request.getfixturevalue(path)[(name, tp)]
    assert run["layers_per_call"] == 2
    assert run["collectives"] == {"all-reduce": 1 + per_layer * run["layers_per_call"], "all-gather": 1}


@pytest.mark.slow
@pytest.mark.parametrize("path,name", [("native", "llama-tp8"), ("fallback", "gpt_neox-tp8")])
def test_tp_that_does_not_divide_heads_fails_at_startup(request, path, name):
    run = request.getfixturevalue(path)[(name, 8)]
    assert run["error_type"] == "ModelLoadError"
    assert "num_attention_heads=4 is not divisible by the model axis size 8" in run["error"]
    assert "pick a tensor_parallel_size that divides 4: 1, 2, 4" in run["error"]


def test_tp_larger_than_device_count_fails_at_startup():
    import jax

    from app import LLM

    n, platform = len(jax.devices()), jax.devices()[0].platform
    message = rf"tensor_parallel_size={2 * n} .* but {n} {platform} device\(s\) are available"
    with pytest.raises(ValueError, match=message):
        LLM("servax-tiny/llama", tensor_parallel_size=2 * n, **ENGINE)


@pytest.mark.slow
def test_no_compilations_after_warmup_with_tp(native, fallback):
    """Three generate calls per engine (batch 3, batch 1 per prompt, batch 2 of mixed lengths)."""
    runs = {**native, **fallback}
    served = {key: r for key, r in runs.items() if "error" not in r}
    assert len(served) == 14
    assert {key: r["compilations_since_warmup"] for key, r in served.items()} == {key: 0 for key in served}


def test_registry_refuses_tp_that_does_not_divide_heads_before_loading(servax_cache):
    """The check sits in registry.load, ahead of both paths, so no weights are read first."""
    import registry

    resolved = registry.resolve("servax-tiny/llama")
    with pytest.raises(ModelLoadError, match="num_attention_heads=4 is not divisible by the model axis size 3"):
        registry.check_tensor_parallel(resolved, 3)
    registry.check_tensor_parallel(resolved, 4)  # divides: no error


def test_kv_repeat_stores_lcm_of_kv_heads_and_tp():
    from registry.native import kv_repeat

    cases = [(2, 1), (2, 2), (2, 4), (8, 4), (3, 4), (6, 4), (1, 8)]  # (num_kv_heads, tp)
    assert [kv_repeat(kv, tp) for kv, tp in cases] == [1, 1, 2, 1, 4, 2, 8]


def test_sharding_rules_map_logical_axes_to_the_model_axis():
    """One table: heads, MLP features and vocab split on "model"; what does not divide stays whole."""
    from jax.sharding import AbstractMesh, PartitionSpec as P

    from runtime.ops.mesh import SHARDING_RULES, check_mesh, logical_axis_size, logical_to_spec, num_shards
    from runtime.ops.step import KV_CACHE_AXES, KVCacheSpec

    mesh = AbstractMesh((2, 4), ("data", "model"))
    assert logical_to_spec(("embed", "q_heads", "head_dim"), (64, 8, 16), mesh) == P(None, "model", None)
    assert logical_to_spec(("q_heads", "head_dim", "embed"), (8, 16, 64), mesh) == P("model", None, None)
    assert logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P(None, "model")
    assert logical_to_spec(("vocab", "embed"), (512, 64), mesh) == P("model", None)
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 6, 16), mesh) == P()  # 6 heads, 4 devices
    assert logical_to_spec(("embed",), (64,), mesh) == P()
    assert logical_to_spec(("vocab", "mlp"), (512, 128), mesh) == P("model", None)  # a mesh axis splits once
    assert logical_to_spec(("column", None), (32, 64), mesh) == P("model", None)  # torchax roles
    assert logical_to_spec((None, "row"), (64, 32), mesh) == P(None, "model")
    assert logical_axis_size("q_heads", mesh) == 4 and logical_axis_size("embed", mesh) == 1
    with pytest.raises(KeyError, match="unknown logical axis 'heads'"):
        logical_to_spec(("heads",), (8,), mesh)
    # the KV cache: kv heads on the model axis, split only where they divide it
    assert KV_CACHE_AXES[2] == "kv_heads" and SHARDING_RULES["kv_heads"] == "model"
    assert KV_CACHE_AXES[0] == "layers" and SHARDING_RULES["layers"] is None  # scanned, never split
    spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=16, dtype=np.float32).partition_spec(mesh)
    assert spec == P(None, None, "model", None, None) and num_shards(spec, mesh) == 4
    assert KVCacheSpec(2, 2, 16, np.float32).partition_spec(mesh) == P()
    with pytest.raises(ValueError, match=r"must have the axes \['model'\]"):
        check_mesh(AbstractMesh((4,), ("tp",)))
