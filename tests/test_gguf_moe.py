"""GGUF mixture-of-experts checkpoints (registry.gguf): Mixtral, Qwen2-MoE and Qwen3-MoE.

Small GGUF files are written here from the tiny MoE checkpoints the way llama.cpp's converter
writes them: each layer's experts merged into one [experts, out, in] tensor per projection
(`blk.N.ffn_{gate,up,down}_exps.weight`), the router `ffn_gate_inp` kept float32 (llama.cpp
never quantizes it), Qwen2-MoE's shared expert as `ffn_*_shexp` and its gate as a 1-D
`ffn_gate_inp_shexp`, and Mixtral as architecture "llama" with `llama.expert_count` (Q/K rows
permuted as for Llama). servax converts them back into per-expert Hugging Face tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file
from test_gguf import _add_tokenizer, gguf_name, llama_cpp_permute

from conftest import hf_greedy, hf_model
from registry import resolve

MOE = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}  # tiny name -> GGUF architecture
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KIND = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_MOE_KIND = {"gate": "ffn_gate_inp", "shared_expert.gate_proj": "ffn_gate_shexp",
             "shared_expert.up_proj": "ffn_up_shexp", "shared_expert.down_proj": "ffn_down_shexp",
             "shared_expert_gate": "ffn_gate_inp_shexp"}
PROMPTS = [[(7 * i + 3 * n) % 500 + 4 for i in range(n)] for n in (5, 19, 40)]


def moe_gguf_name(hf_name: str) -> str:
    """A dense or MoE-block tensor's GGUF name (merged experts are named by `write_moe_gguf`)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)\.weight", hf_name)
    if m and m[2] in _MOE_KIND:
        return f"blk.{m[1]}.{_MOE_KIND[m[2]]}.weight"
    return gguf_name(hf_name)


def write_moe_gguf(checkpoint: Path, out: Path, *, weight_type: str = "F32",
                   meta: dict | None = None) -> Path:
    """A GGUF file of a tiny MoE checkpoint as llama.cpp's converter writes it; matrices (the
    merged experts too) in `weight_type`, the router, norms and the shared expert's gate in F32.

    meta: `{arch}.<key>` uint32 values written instead of the checkpoint's."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = MOE[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    num_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w = gguf.GGUFWriter(out, arch)
    p = arch + "."
    w.add_string("general.name", "servax tiny moe test")
    overrides, meta = meta or {}, {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": head_dim,
            "attention.value_length": head_dim, "rope.dimension_count": head_dim,
            "expert_count": num_experts, "expert_used_count": cfg["num_experts_per_tok"]}
    if "moe_intermediate_size" in cfg:
        meta["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if cfg.get("shared_expert_intermediate_size"):
        meta["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    for key, value in {**meta, **overrides}.items():
        w.add_uint32(p + key, value)
    w.add_float32(p + "rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    _add_tokenizer(w, checkpoint)

    def add(name: str, array: np.ndarray) -> None:
        if array.ndim >= 2 and weight_type != "F32" and not name.endswith(".ffn_gate_inp.weight"):
            w.add_tensor(name, gguf.quants.quantize(array, T[weight_type]), raw_dtype=T[weight_type])
        else:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, array in load_file(checkpoint / "model.safetensors").items():
        if m := _EXPERT.fullmatch(hf_name):
            experts.setdefault(f"blk.{m[1]}.{_EXPERT_KIND[m[3]]}.weight", {})[int(m[2])] = array
            continue
        name = moe_gguf_name(hf_name)
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            array = llama_cpp_permute(array, heads if ".attn_q." in name else kv_heads)
        if name.endswith(".ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)  # llama.cpp's graph reads it as [n_embd]
        add(name, array)
    for name, per_expert in experts.items():
        add(name, np.stack([per_expert[e] for e in range(num_experts)]))  # [experts, out, in]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_moe")


def _greedy_params(max_tokens: int = 12):
    from app import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def _llm(model: str, **kw):
    from app import LLM

    return LLM(model=model, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, show_progress=False,
               compilation_cache_dir="", enforce_eager=True, **kw)


@pytest.mark.parametrize("name", list(MOE))
def test_f32_moe_gguf_splits_merged_experts_bit_exactly_with_the_moe_config(tiny_checkpoint, gguf_dir, name):
    ckpt = tiny_checkpoint(name)
    resolved = resolve(str(write_moe_gguf(ckpt, gguf_dir / f"{name}-f32.gguf")))
    want = json.loads((ckpt / "config.json").read_text())
    assert (resolved.architecture, resolved.impl) == (want["architectures"][0], "jax")
    original, converted = load_file(ckpt / "model.safetensors"), load_file(resolved.path / "model.safetensors")
    assert set(converted) == set(original)  # per-expert tensors, the router, the shared expert and its gate
    for hf_name, array in original.items():
        assert converted[hf_name].dtype == np.float32 and np.array_equal(converted[hf_name], array), hf_name
    got = resolved.hf_config
    for key in ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "intermediate_size", "num_hidden_layers"):
        if key in want:
            assert getattr(got, key) == want[key], key


@pytest.mark.parametrize("name", list(MOE))
def test_moe_gguf_greedy_tokens_match_transformers(tiny_checkpoint, gguf_dir, name):
    """The converted GGUF served natively gives transformers' greedy tokens on the tiny checkpoint."""
    ckpt = tiny_checkpoint(name)
    llm = _llm(str(write_moe_gguf(ckpt, gguf_dir / f"{name}-f32.gguf")))
    assert llm.engine.model.impl == "jax"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy_params(), use_tqdm=False)
    hf = hf_model(ckpt)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in PROMPTS]
    llm.shutdown()


@pytest.mark.parametrize("name", list(MOE))
def test_q8_0_moe_gguf_serves_its_experts_as_stored_int8(tiny_checkpoint, gguf_dir, name):
    """quantization="gguf": each [experts, in, out] expert matrix is int8 with a scale per
    32 inputs, assembled from the per-expert Q8_0 tensors; the tokens are transformers' on the
    dequantized checkpoint (the same weights, exactly)."""
    from registry.weights import open_q8_0
    from runtime.ops.quantization import QuantizedWeight

    ckpt = tiny_checkpoint(name)
    gguf_file = write_moe_gguf(ckpt, gguf_dir / f"{name}-Q8_0.gguf", weight_type="Q8_0")
    resolved = resolve(str(gguf_file))
    stored = open_q8_0(resolved.path)
    experts = [n for n in stored if ".experts." in n]
    cfg = resolved.hf_config
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    assert len(experts) == cfg.num_hidden_layers * num_experts * 3
    assert not any(n.endswith(".gate.weight") for n in stored)  # the router stayed float32

    llm = _llm(str(gguf_file), quantization="gguf", int8_activations=False)  # the stored weights' products exactly
    layers = llm.engine.model.params["layers"]  # the runtime steps layer by layer: a list
    assert len(layers) == cfg.num_hidden_layers
    for layer in layers:
        block = layer["mlp"]["experts"]
        assert set(block) == {"gate", "up", "down"}
        for w in block.values():
            assert isinstance(w, QuantizedWeight) and w.q.dtype == np.int8 and w.group_size == 32
            assert w.q.shape[0] == num_experts and w.scale.shape[-2] * 32 == w.q.shape[-2]  # groups along `in`
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy_params(), use_tqdm=False)
    hf = hf_model(resolved.path)  # the dequantized weights
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in PROMPTS]
    llm.shutdown()


def test_moe_gguf_whose_expert_count_disagrees_with_its_tensors_is_refused(tiny_checkpoint, tmp_path):
    from registry.errors import ModelLoadError

    gguf_file = write_moe_gguf(tiny_checkpoint("qwen3_moe"), tmp_path / "bad.gguf", meta={"expert_count": 4})
    with pytest.raises(ModelLoadError, match=r"ffn_\w+_exps\.weight has GGUF shape \[\d+, \d+, 8\]; merged "
                                             r"experts are \[in, out, 4\] \(expert_count 4\)"):
        resolve(str(gguf_file))


def test_enable_lora_on_a_moe_gguf_is_refused_naming_the_experts(tiny_checkpoint, gguf_dir):
    """The MoE models declare no LoRA targets: enable_lora fails at startup saying why."""
    gguf_file = write_moe_gguf(tiny_checkpoint("qwen3_moe"), gguf_dir / "qwen3_moe-f32.gguf")
    with pytest.raises(ValueError, match="adapters on mixture-of-experts layers are not served") as e:
        _llm(str(gguf_file), enable_lora=True, max_loras=1, max_lora_rank=8)
    assert "Qwen3MoeForCausalLM" in str(e.value) and "enable_lora" in str(e.value)
