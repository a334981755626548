"""gpt-oss: the Llama decoder with attention sinks and a mixture of biased experts.

What differs from models_jax/llama.py, all read from the Hugging Face config:
- attention: q/k/v/o with biases; a learned sink logit per head that joins each softmax's
  denominator (runtime.ops.attention.paged_attention's `sinks`); sliding-window and full
  layers alternate (`layer_types`); YaRN rotary embeddings;
- the MLP is the MoE block (models_jax/moe.py) with gpt-oss's routing (the top-k logits of a
  biased router, then a softmax over them) and experts: gate and up interleaved in one
  [E, D, 2F] matrix with a bias, the clamped SwiGLU `(up + 1) * gate * sigmoid(alpha gate)`,
  and a biased down projection.

The released checkpoints store the experts in MXFP4; this module reads them as float
tensors (bf16/float32 safetensors, as transformers saves a dequantized model).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from models_jax import ModelEntry, llama, moe
from models_jax import llama_moe
from models_jax.llama_moe import pack_layer
from models_jax.weights import WeightSpec, joined_projections, linear, vector, zeros


@dataclasses.dataclass(frozen=True)
class GptOssArgs(llama.LlamaArgs):
    """The Llama family's hyperparameters plus the experts' (hashable)."""

    moe: moe.MoeConfig | None = None

    @classmethod
    def from_hf(cls, cfg: Any) -> "GptOssArgs":
        """Raises ValueError on config features this model does not implement."""
        base = llama.LlamaArgs.from_hf(cfg)
        num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        config = moe.MoeConfig(
            num_experts=num_experts, top_k=cfg.num_experts_per_tok, intermediate_size=cfg.intermediate_size,
            routing="topk_softmax", activation="clamped_swiglu",
            swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)), swiglu_limit=float(getattr(cfg, "swiglu_limit", 7.0)),
        )
        return cls(**{**vars(base), "qkv_bias": True, "o_bias": True}, moe=config)


def weight_table(a: GptOssArgs) -> dict:
    """The Llama family's table with attention sinks and gpt-oss's MoE block in each layer."""
    d, m = a.hidden_size, a.moe
    normal = jax.nn.initializers.normal(a.initializer_range)
    expert_axis, feature_axis = m.axes
    e, f = m.num_experts, m.intermediate_size
    pre = "model.layers.{layer}."
    experts = pre + "mlp.experts."
    layer = {k: v for k, v in llama.layer_table(a).items() if k != "mlp"}
    layer["sinks"] = vector(pre + "self_attn.sinks", a.num_heads, ("q_heads",), normal)
    layer["mlp"] = {
        "router": linear(pre + "mlp.router.weight", d, e, ("embed", None), normal),
        "router_bias": vector(pre + "mlp.router.bias", e, (None,), zeros),
        "experts": {  # stored as transformers keeps them: [E, in, out], gate and up interleaved
            "gate_up": WeightSpec(experts + "gate_up_proj", (e, d, 2 * f), (expert_axis, "embed", feature_axis),
                                  normal),
            "gate_up_bias": WeightSpec(experts + "gate_up_proj_bias", (e, 2 * f), (expert_axis, feature_axis), zeros),
            "down": WeightSpec(experts + "down_proj", (e, f, d), (expert_axis, feature_axis, "embed"), normal),
        },
        "down_bias": WeightSpec(experts + "down_proj_bias", (e, d), (None, "embed"), zeros),
    }
    return llama.weight_table(a, layer)


# The MoE Llama decoder layer serves gpt-oss as it is: attention (with the layer's sinks), then the MoE
# block (no shared expert); the Llama family's prologue and epilogue around it.
decoder_layer = llama_moe.decoder_layer
forward = functools.partial(llama.forward, layer_fn=decoder_layer)


def fuse_layer(p: dict) -> dict:
    """q/k/v (and their biases) joined into one matrix, as the Llama family joins them."""
    return joined_projections(p, ("q", "k", "v"), "qkv")


ENTRY = ModelEntry(
    architectures=("GptOssForCausalLM",),
    config_from_hf=GptOssArgs.from_hf,
    weight_table=weight_table,
    forward=forward,
    stages=(llama.prologue, decoder_layer, llama.epilogue),
    fuse_layer=fuse_layer,
    pack_layer=pack_layer,
    pack_head=llama.pack_head,
)
