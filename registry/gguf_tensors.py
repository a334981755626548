"""GGUF tensors in Hugging Face form: which architectures map onto which transformers model,
tensor names, shapes and layout (Q/K rows un-permuted), dequantization, Q8_0 tensors as
stored, and the safetensors file they are written to (registry/gguf.py runs the conversion).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from registry.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How one `general.architecture` maps onto a transformers model."""

    config_class: str  # transformers config class, e.g. "LlamaConfig"
    hf_architecture: str  # config.architectures[0]
    permuted_qk: bool  # llama.cpp interleaved the Q/K rows for its rotary layout
    layer_tensors: tuple[str, ...]  # allowed `blk.N.<kind>.<weight|bias>` names


_BLOCK_TENSORS = {  # GGUF kind -> Hugging Face module under model.layers.N
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_BLOCK = tuple(
    f"{kind}.weight" for kind in (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"
    )
)
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    # Mistral GGUFs say "llama" too: same tensors, same permutation.
    "llama": GGUFArchitecture("LlamaConfig", "LlamaForCausalLM", True, _LLAMA_BLOCK),
    "qwen2": GGUFArchitecture(
        "Qwen2Config", "Qwen2ForCausalLM", False,
        _LLAMA_BLOCK + ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    ),
    "qwen3": GGUFArchitecture(
        "Qwen3Config", "Qwen3ForCausalLM", False, _LLAMA_BLOCK + ("attn_q_norm.weight", "attn_k_norm.weight"),
    ),
}


def supported_types() -> list[str]:
    """Names of the GGML tensor types that can be dequantized (those the gguf package implements)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    types = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    return [t.name for t in GGMLQuantizationType if t in types]


def check_tensor_types(gguf_file: Path, tensors: list) -> None:
    supported = set(supported_types())
    bad = {t.tensor_type.name: t.name for t in tensors if t.tensor_type.name not in supported}
    if bad:
        kind, example = next(iter(bad.items()))
        raise ModelLoadError(
            f"{gguf_file.name}: tensor type {kind} (e.g. tensor {example}) cannot be dequantized; "
            f"supported types: {', '.join(sorted(supported))}"
        )


def hf_names(gguf_file: Path, arch_name: str, arch: GGUFArchitecture, tensors: dict, config) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, refusing any tensor without a counterpart."""
    names = {}
    for name in tensors:
        base, _, suffix = name.rpartition(".")
        if base in _GLOBAL_TENSORS and suffix == "weight":
            names[name] = f"{_GLOBAL_TENSORS[base]}.weight"
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in arch.layer_tensors:
            kind, suffix = parts[2].rsplit(".", 1)
            names[name] = f"model.layers.{parts[1]}.{_BLOCK_TENSORS[kind]}.{suffix}"
            continue
        raise ModelLoadError(
            f"{gguf_file.name}: tensor {name} has no counterpart in {arch.hf_architecture} "
            f"(GGUF architecture {arch_name}); mixture-of-experts and other variants are not supported"
        )
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{kind}" for i in range(config.num_hidden_layers) for kind in _LLAMA_BLOCK
    }
    missing = sorted(expected - set(tensors))
    if missing:
        raise ModelLoadError(f"{gguf_file.name}: {len(missing)} tensors missing, e.g. {', '.join(missing[:4])}")
    return names


def hf_shape_dtype(tensor) -> tuple[tuple[int, ...], str]:
    """Shape (Hugging Face order) and safetensors dtype that `hf_tensor` gives, without reading data."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    return shape, {"F16": "F16", "BF16": "BF16"}.get(tensor.tensor_type.name, "F32")


def hf_tensor(tensor, config, arch: GGUFArchitecture) -> np.ndarray:
    """One tensor in Hugging Face layout: dequantized (F16/BF16 kept), Q/K rows un-permuted."""
    import ml_dtypes
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    shape, _ = hf_shape_dtype(tensor)
    if tensor.tensor_type == T.F16:
        array = np.asarray(tensor.data)
    elif tensor.tensor_type == T.BF16:
        array = np.asarray(tensor.data).view(ml_dtypes.bfloat16)
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    return _rows_in_hf_order(array.reshape(shape), tensor, config, arch)


def q8_0_parts(tensor, config, arch: GGUFArchitecture) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor as stored, in Hugging Face layout: int8 values [.., in] and float16
    scales [.., in / 32] (a block is 2 bytes of scale, then 32 int8 values; values * scale
    is what `hf_tensor` gives)."""
    shape, _ = hf_shape_dtype(tensor)
    blocks = np.asarray(tensor.data).reshape(-1, 34)
    scales = blocks[:, :2].copy().view(np.float16).reshape(*shape[:-1], shape[-1] // 32)
    values = blocks[:, 2:].view(np.int8).reshape(shape)
    return _rows_in_hf_order(values, tensor, config, arch), _rows_in_hf_order(scales, tensor, config, arch)


def _rows_in_hf_order(array: np.ndarray, tensor, config, arch: GGUFArchitecture) -> np.ndarray:
    if arch.permuted_qk and tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
        heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
        array = unpermute_qk(array, heads)
    return array


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order: each head's rows go from [first half | second half] to interleaved pairs.

    weight: [num_heads * head_dim, ...] (a q_proj or k_proj weight, Hugging Face layout).
    """
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of `permute_qk`: GGUF's interleaved Q/K rows back to Hugging Face's rotate-half order."""
    return weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1}


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]]) -> None:
    """A safetensors file written one tensor at a time, so only one is dequantized in memory at once.

    tensors: (name, shape, safetensors dtype, produce) entries; `produce()` gives the array.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in tensors:
        nbytes = int(np.prod(shape)) * _ST_ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for name, _, _, produce in tensors:
            array = np.ascontiguousarray(produce())
            begin, end = header[name]["data_offsets"]
            if array.nbytes != end - begin:
                raise AssertionError(f"{name}: {array.nbytes} bytes produced, {end - begin} expected")
            fh.write(memoryview(array.reshape(-1).view(np.uint8)))
