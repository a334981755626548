"""GGUF tensors in Hugging Face form: which architectures map onto which transformers model,
tensor names, shapes and layout (Q/K rows un-permuted), dequantization, Q8_0 tensors as
stored, and the safetensors file they are written to (registry/gguf.py runs the conversion).

Mixture-of-experts files store each layer's experts merged, as llama.cpp's converter writes
them: `blk.N.ffn_{gate,up,down}_exps.weight` of GGUF shape [in, out, experts] (numpy
[experts, out, in]); each expert's slice becomes its own Hugging Face tensor, read from the
file's own bytes (a quantized tensor's blocks never cross an expert), so one expert is
dequantized at a time.
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
    required: tuple[str, ...] = ()  # of those, the ones every layer must have (default: the Llama block)
    moe_prefix: str = ""  # the HF module of a layer's experts ("mlp", Mixtral's "block_sparse_moe"); "": dense
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # HF (gate, up, down) per expert
    norm_topk_prob: bool = False  # what llama.cpp's graph does when the file has no expert_weights_norm

    @property
    def required_tensors(self) -> tuple[str, ...]:
        return self.required or _LLAMA_BLOCK


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
_ATTENTION_BLOCK = _LLAMA_BLOCK[:6]  # attn_norm .. ffn_norm
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # merged experts, in expert_names' order
_MOE_BLOCK = tuple(f"{kind}.weight" for kind in ("ffn_gate_inp", *_EXPERTS))
_SHARED_EXPERT = tuple(f"{kind}.weight" for kind in (
    "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"
))
_MOE_TENSORS = {  # GGUF kind -> Hugging Face module under the MoE block (moe_prefix)
    "ffn_gate_inp": "gate",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}
# llama.cpp writes Mixtral as "llama" with {arch}.expert_count set (see `architecture`).
MIXTRAL = GGUFArchitecture(
    "MixtralConfig", "MixtralForCausalLM", True, _ATTENTION_BLOCK + _MOE_BLOCK, _ATTENTION_BLOCK + _MOE_BLOCK,
    moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"), norm_topk_prob=True,
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
    "qwen2moe": GGUFArchitecture(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", False,
        _ATTENTION_BLOCK + _MOE_BLOCK + _SHARED_EXPERT + ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
        _ATTENTION_BLOCK + _MOE_BLOCK + _SHARED_EXPERT, moe_prefix="mlp",
    ),
    # llama.cpp's qwen3moe graph always renormalizes the top-k weights (norm_topk_prob)
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", False,
        _ATTENTION_BLOCK + _MOE_BLOCK + ("attn_q_norm.weight", "attn_k_norm.weight"),
        _ATTENTION_BLOCK + _MOE_BLOCK, moe_prefix="mlp", norm_topk_prob=True,
    ),
}


def architecture(arch_name: str, num_experts: int) -> GGUFArchitecture | None:
    """The architecture a file's `general.architecture` and `{arch}.expert_count` name (None: unsupported)."""
    if arch_name == "llama" and num_experts:
        return MIXTRAL
    return ARCHITECTURES.get(arch_name)


@dataclasses.dataclass(frozen=True)
class TensorPart:
    """The part of a GGUF tensor that is one Hugging Face tensor: one expert of merged experts,
    or a tensor given another shape. Quacks like the reader's tensors (name, tensor_type, shape
    innermost first, data)."""

    name: str
    tensor_type: Any
    shape: np.ndarray  # GGUF order, innermost first
    data: np.ndarray


def expert_part(tensor, expert: int) -> TensorPart:
    """Expert `expert` of a merged [experts, out, in] tensor (its own rows of the file's bytes)."""
    return TensorPart(tensor.name, tensor.tensor_type, tensor.shape[:-1], tensor.data[expert])


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


def hf_names(gguf_file: Path, arch_name: str, arch: GGUFArchitecture, tensors: dict, config) -> dict[str, Any]:
    """Hugging Face name -> the GGUF tensor (or TensorPart) it is read from, refusing any
    tensor without a counterpart; merged experts give one entry per expert."""
    names: dict[str, Any] = {}
    for name, tensor in tensors.items():
        base, _, suffix = name.rpartition(".")
        if base in _GLOBAL_TENSORS and suffix == "weight":
            names[f"{_GLOBAL_TENSORS[base]}.weight"] = tensor
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in arch.layer_tensors:
            kind, suffix = parts[2].rsplit(".", 1)
            layer = f"model.layers.{parts[1]}"
            if kind in _EXPERTS:
                names.update(_expert_names(gguf_file, tensor, f"{layer}.{arch.moe_prefix}.experts",
                                           arch.expert_names[_EXPERTS.index(kind)], config))
            elif kind in _MOE_TENSORS:
                names[f"{layer}.{arch.moe_prefix}.{_MOE_TENSORS[kind]}.{suffix}"] = _as_matrix(tensor)
            else:
                names[f"{layer}.{_BLOCK_TENSORS[kind]}.{suffix}"] = tensor
            continue
        raise ModelLoadError(
            f"{gguf_file.name}: tensor {name} has no counterpart in {arch.hf_architecture} "
            f"(GGUF architecture {arch_name}); other variants of it are not supported"
        )
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{kind}" for i in range(config.num_hidden_layers) for kind in arch.required_tensors
    }
    missing = sorted(expected - set(tensors))
    if missing:
        raise ModelLoadError(f"{gguf_file.name}: {len(missing)} tensors missing, e.g. {', '.join(missing[:4])}")
    return names


def _expert_names(gguf_file: Path, tensor, prefix: str, module: str, config) -> dict[str, TensorPart]:
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    if len(tensor.shape) != 3 or int(tensor.shape[-1]) != experts:
        raise ModelLoadError(f"{gguf_file.name}: tensor {tensor.name} has GGUF shape {tensor.shape.tolist()}; "
                             f"merged experts are [in, out, {experts}] (expert_count {experts})")
    return {f"{prefix}.{e}.{module}.weight": expert_part(tensor, e) for e in range(experts)}


def _as_matrix(tensor) -> Any:
    """A 1-D GGUF tensor that Hugging Face stores as a [1, n] matrix (Qwen2-MoE's shared expert
    gate; llama.cpp's converter may write it either way)."""
    if len(tensor.shape) != 1:
        return tensor
    return TensorPart(tensor.name, tensor.tensor_type, np.array([int(tensor.shape[0]), 1]),
                      np.asarray(tensor.data).reshape(1, -1))


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


FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # kept as stored by quantization="gguf" (4-bit values, scale, offset)
FIVE_BIT_TYPES = ("Q5_0", "Q5_1", "Q5_K")  # likewise, 5-bit values
SIX_BIT_TYPES = ("Q6_K",)  # likewise, 6-bit values -32..31 and a scale per 16 inputs


def q8_0_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights w [.., in] as Q8_0 stores them: int8 values [.., in] and a float16 scale per 32
    inputs [.., in / 32], the block's largest |weight| / 127 (values rounded against it)."""
    w = np.asarray(w, np.float32)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    scale = (np.abs(blocks).max(axis=-1) / 127).astype(np.float16)
    step = scale.astype(np.float32)[..., None]
    values = np.clip(np.rint(np.divide(blocks, step, out=np.zeros_like(blocks), where=step > 0)), -127, 127)
    return values.astype(np.int8).reshape(w.shape), scale


def four_bit_parts(tensor, config, arch: GGUFArchitecture) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0, Q4_1 or Q4_K tensor as stored, in Hugging Face layout: its 4-bit values as uint8
    [.., in] and a float32 scale and offset per 32 inputs [.., in / 32], value * scale + offset
    being what llama.cpp dequantizes (Q4_0: scale d, offset -8 d; Q4_1: d and m; Q4_K: each
    32-block's d * scale code and -dmin * min code from its 256-value super-block)."""
    kind = tensor.tensor_type.name
    raw = np.asarray(tensor.data).reshape(-1)
    if kind in ("Q4_0", "Q4_1"):
        head, blocks, scale, offset = _block_scales(raw, kind == "Q4_1", 16, centre=8)
        qs = blocks[:, head:]
        values = np.concatenate([qs & 15, qs >> 4], axis=1)  # 32 values: low nibbles, then high ones
    elif kind == "Q4_K":
        blocks = raw.reshape(-1, 144)
        scale, offset = _k_scales(blocks)
        qs = blocks[:, 16:].reshape(-1, 4, 32)
        values = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256)  # 64-value chunks: low, then high nibbles
    else:
        raise ValueError(f"{tensor.name}: {kind} is not a 4-bit type kept as stored ({', '.join(FOUR_BIT_TYPES)})")
    return _parts_in_hf_layout(tensor, config, arch, values, scale, offset)


def five_bit_parts(tensor, config, arch: GGUFArchitecture) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q5_0, Q5_1 or Q5_K tensor as stored, in Hugging Face layout: its 5-bit values as uint8
    [.., in] (4 bits from the nibbles, the fifth from the block's high-bit field) and a float32
    scale and offset per 32 inputs [.., in / 32], as `four_bit_parts` (Q5_0: d and -16 d; Q5_1: d
    and m; Q5_K: each 32-block's d * scale code and -dmin * min code, coded as Q4_K's)."""
    kind = tensor.tensor_type.name
    raw = np.asarray(tensor.data).reshape(-1)
    if kind in ("Q5_0", "Q5_1"):
        head, blocks, scale, offset = _block_scales(raw, kind == "Q5_1", 20, centre=16)
        high = blocks[:, head:head + 4].copy().view(np.uint32)  # bit j: value j's fifth bit
        qs = blocks[:, head + 4:]
        fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        values = np.concatenate([qs & 15, qs >> 4], axis=1) | (fifth << 4)  # values 0-15: low nibbles, 16-31: high
    elif kind == "Q5_K":
        blocks = raw.reshape(-1, 176)
        scale, offset = _k_scales(blocks)
        qh, qs = blocks[:, 16:48], blocks[:, 48:].reshape(-1, 4, 32)
        nibbles = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)  # 32-value blocks: chunk c's low, high
        fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # block s: bit s of qh[l]
        values = (nibbles | (fifth << 4)).reshape(-1, 256)
    else:
        raise ValueError(f"{tensor.name}: {kind} is not a 5-bit type kept as stored ({', '.join(FIVE_BIT_TYPES)})")
    return _parts_in_hf_layout(tensor, config, arch, values, scale, offset)


def six_bit_parts(tensor, config, arch: GGUFArchitecture) -> tuple[np.ndarray, np.ndarray]:
    """A Q6_K tensor as stored, in Hugging Face layout: its 6-bit values less 32 as int8 [.., in]
    (4 bits from ql, 2 from qh) and a float32 scale per 16 inputs [.., in / 16] (the super-block's
    float16 d times the 16-value block's int8 scale), value * scale being what llama.cpp dequantizes."""
    if tensor.tensor_type.name not in SIX_BIT_TYPES:
        raise ValueError(f"{tensor.name}: {tensor.tensor_type.name} is not a 6-bit type kept as stored (Q6_K)")
    blocks = np.asarray(tensor.data).reshape(-1, 210)
    ql, qh = blocks[:, :128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)  # two halves of 128 values
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    low = (ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4)  # values l, l + 32, ...
    values = np.stack([low[c] | (((qh >> (2 * c)) & 3) << 4) for c in range(4)], axis=2).reshape(-1, 256)
    return _parts_in_hf_layout(tensor, config, arch, values.astype(np.int16) - 32, d * sc, None)


K_QUANT_SUPERS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, None)}  # bytes, d's and dmin's at


def super_scale_parts(tensor, config, arch: GGUFArchitecture) -> tuple[np.ndarray, np.ndarray | None]:
    """A K-quant tensor's float16 super-scales in Hugging Face layout [.., in / 256]: d, of which its
    scales are the integer codes' multiples (`four_bit_parts`, `five_bit_parts`, `six_bit_parts`),
    and -dmin likewise of its offsets (None for Q6_K, which has none)."""
    size, at_d, at_dmin = K_QUANT_SUPERS[tensor.tensor_type.name]
    blocks = np.asarray(tensor.data).reshape(-1, size)
    shape, _ = hf_shape_dtype(tensor)
    supers = (*shape[:-1], shape[-1] // 256)
    d = blocks[:, at_d:at_d + 2].copy().view(np.float16).reshape(supers)
    dmin = None if at_dmin is None else -blocks[:, at_dmin:at_dmin + 2].copy().view(np.float16).reshape(supers)
    return tuple(None if a is None else _rows_in_hf_order(a, tensor, config, arch) for a in (d, dmin))


def _block_scales(raw: np.ndarray, with_min: bool, body: int, centre: int) -> tuple[int, np.ndarray, np.ndarray,
                                                                                  np.ndarray]:
    """The blocks of 32 values of a Q4_0/Q4_1/Q5_0/Q5_1 tensor: (header bytes, blocks [n, header + body],
    scales [n, 1], offsets [n, 1]): a float16 scale d, then with_min a float16 offset m, else -centre d."""
    head = 4 if with_min else 2
    blocks = raw.reshape(-1, head + body)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if with_min else -centre * d
    return head, blocks, d, m


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales and offsets [super-blocks, 8] of Q4_K / Q5_K super-blocks [n, bytes]: d and dmin
    (float16) times the eight 32-value blocks' 6-bit scale and min codes packed in 12 bytes."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    codes = blocks[:, 4:16].astype(np.int32)
    low = [codes[:, j] & 63 for j in range(4)], [codes[:, j + 4] & 63 for j in range(4)]
    high = ([(codes[:, j + 4] & 15) | ((codes[:, j - 4] >> 6) << 4) for j in range(4, 8)],
            [(codes[:, j + 4] >> 4) | ((codes[:, j] >> 6) << 4) for j in range(4, 8)])
    sc, mn = np.stack(low[0] + high[0], axis=1), np.stack(low[1] + high[1], axis=1)  # [blocks, 8]
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _parts_in_hf_layout(tensor, config, arch: GGUFArchitecture, values: np.ndarray, scale: np.ndarray,
                        offset: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Blocks' values [n, v] and their scales (and offsets) [n, g] as Hugging Face's [.., in] and
    [.., in / (v / g)]: uint8 values where there are offsets, else int8 ones (no offsets)."""
    shape, _ = hf_shape_dtype(tensor)
    groups = (*shape[:-1], shape[-1] // (values.shape[-1] // scale.shape[-1]))
    parts = (values.astype(np.int8 if offset is None else np.uint8).reshape(shape), scale.reshape(groups),
             *(() if offset is None else (offset.reshape(groups),)))
    return tuple(_rows_in_hf_order(a, tensor, config, arch) for a in parts)


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


_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}


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
