"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama decoder with a mixture of experts as its MLP.

Attention, rotary embeddings, norms, the embedding and the LM head are the Llama family's
(models_jax/llama.py, with its flags: Qwen2's q/k/v biases, Qwen3's q/k norms, Mixtral's
sliding window); every decoder layer's MLP is the one MoE block (models_jax/moe.py): softmax
routing to the top-k experts, Qwen2-MoE's shared expert with its sigmoid gate beside them.

Layers must all be MoE layers (Qwen's `decoder_sparse_step` 1 and no `mlp_only_layers`, as
the released Qwen2-MoE and Qwen3-MoE checkpoints are): the decoder is one layer scanned or
stepped layer by layer, so its layers share one weight layout. LoRA adapters are not served
on these models (their MLP is the experts).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from models_jax import ModelEntry, layers, llama, moe
from models_jax.weights import joined_projections, linear
from runtime.ops.matmul import PackedExperts, pack_matrix
from runtime.ops.step import KVCache, StepInput


@dataclasses.dataclass(frozen=True)
class MoeArgs(llama.LlamaArgs):
    """The Llama family's hyperparameters plus the experts' (hashable)."""

    moe: moe.MoeConfig | None = None
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # HF (gate, up, down)
    moe_prefix: str = "mlp"  # HF module of a layer's MoE block ("block_sparse_moe" for Mixtral)

    @classmethod
    def from_hf(cls, cfg: Any) -> "MoeArgs":
        """Raises ValueError on config features these models do not implement."""
        base = llama.LlamaArgs.from_hf(cfg)
        arch = (cfg.architectures or ["MixtralForCausalLM"])[0]
        # transformers names the expert count num_local_experts in to_dict() (num_experts an alias)
        num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        if arch == "MixtralForCausalLM":
            config = moe.MoeConfig(num_experts=num_experts, top_k=cfg.num_experts_per_tok,
                                   intermediate_size=cfg.intermediate_size, norm_topk_prob=True)
            return cls(**vars(base), moe=config, expert_names=("w1", "w3", "w2"), moe_prefix="block_sparse_moe")
        mlp_only = list(getattr(cfg, "mlp_only_layers", None) or [])
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        if mlp_only or step != 1:
            raise ValueError(f"dense layers among the MoE layers (mlp_only_layers={mlp_only}, decoder_sparse_step="
                             f"{step}) are not served natively; use model_impl='torchax'")
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        config = moe.MoeConfig(
            num_experts=num_experts, top_k=cfg.num_experts_per_tok, intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)), shared_intermediate_size=shared,
            shared_expert_gate=shared > 0,
        )
        return cls(**vars(base), moe=config)


def weight_table(a: MoeArgs) -> dict:
    """The Llama family's table with each layer's MLP replaced by the MoE block's weights."""
    d, m = a.hidden_size, a.moe
    normal = jax.nn.initializers.normal(a.initializer_range)
    pre = f"model.layers.{{layer}}.{a.moe_prefix}."
    block = {
        "router": moe.router_weight(pre + "gate.weight", d, m.num_experts, normal),
        "experts": moe.expert_weights(pre + "experts", a.expert_names, d, m.intermediate_size, m.num_experts,
                                      normal, m.expert_parallel),
    }
    if m.shared_intermediate_size:
        f, shared = m.shared_intermediate_size, pre + "shared_expert."
        block["shared"] = {
            "gate": linear(shared + "gate_proj.weight", d, f, ("embed", "mlp"), normal),
            "up": linear(shared + "up_proj.weight", d, f, ("embed", "mlp"), normal),
            "down": linear(shared + "down_proj.weight", f, d, ("mlp", "embed"), normal),
        }
    if m.shared_expert_gate:
        block["shared_gate"] = moe.shared_gate_weight(pre + "shared_expert_gate.weight", d)
    return llama.weight_table(a, {**llama.layer_table(a), "mlp": block})


def mlp(x: jax.Array, p: dict, a: MoeArgs, batch: StepInput) -> jax.Array:
    """The MoE block of one layer: x [T, D] -> [T, D]."""
    shared = (functools.partial(layers.gated_mlp, p=p["shared"], rows=batch.num_tokens) if "shared" in p
              else None)
    return moe.moe_block(x, p, a.moe, batch.num_tokens, shared)


def decoder_layer(p: dict, carry: tuple, kv_cache: KVCache, i: jax.Array, batch: StepInput, *,
                  args: MoeArgs) -> tuple[tuple, KVCache]:
    """Decoder layer `i`: attention as the Llama family's, then the MoE block."""
    x, cos, sin = carry
    window, windows = llama.layer_windows(args)
    h = layers.rms_norm(x, p["input_norm"], args.rms_norm_eps)
    h, kv_cache = llama.attention_block(h, p, kv_cache, i, batch, cos, sin, args,
                                        window if windows is None else windows[i])
    x = x + h
    with jax.named_scope("moe"):
        x = x + mlp(layers.rms_norm(x, p["post_attn_norm"], args.rms_norm_eps), p["mlp"], args, batch)
    return (x, cos, sin), kv_cache


# One serving step: the Llama family's prologue, these decoder layers under a scan, its epilogue.
forward = functools.partial(llama.forward, layer_fn=decoder_layer)


def fuse_layer(p: dict) -> dict:
    """Attention's q/k/v joined as the Llama family joins them; each expert's gate and up
    joined side by side ([E, D, 2F]: one grouped product where there were two)."""
    p = joined_projections(p, ("q", "k", "v"), "qkv")
    experts = p["mlp"]["experts"]
    if "gate" in experts and all(_float32(experts[n]) for n in ("gate", "up")):
        joined = jax.numpy.concatenate([experts["gate"], experts["up"]], axis=-1)
        experts = {"gate_up": joined, "down": experts["down"]}
    mlp_p = {**p["mlp"], "experts": experts}
    if "shared" in mlp_p:
        mlp_p["shared"] = joined_projections(mlp_p["shared"], ("gate", "up"), "gate_up")
    return {**p, "mlp": mlp_p}


def _float32(w: object) -> bool:
    """Whether w is float32 weights (what the experts' grouped kernel multiplies)."""
    return isinstance(w, jax.Array) and w.dtype == jax.numpy.float32


def pack_layer(p: dict) -> dict:
    """Attention's joined projections (as the Llama family packs them) and the experts as packed
    weights for the CPU kernels."""
    return {**llama.pack_layer(p), "mlp": pack_moe_block(p["mlp"])}


def pack_moe_block(block: dict) -> dict:
    """A MoE block (joined by fuse_layer) with its float32 experts as PackedExperts and its
    shared expert's joined matrices as PackedWeight; the router and biases as they are."""
    block = dict(block)
    block["experts"] = {k: PackedExperts.pack(w) if _float32(w) and w.ndim == 3 else w  # biases stay
                        for k, w in block["experts"].items()}
    if "shared" in block and "gate_up" in block["shared"]:
        block["shared"] = {**block["shared"], "gate_up": pack_matrix(block["shared"]["gate_up"]),
                           "down": pack_matrix(block["shared"]["down"])}
    return block


ENTRY = ModelEntry(
    architectures=("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    config_from_hf=MoeArgs.from_hf,
    weight_table=weight_table,
    forward=forward,
    stages=(llama.prologue, decoder_layer, llama.epilogue),
    fuse_layer=fuse_layer,
    pack_layer=pack_layer,
    pack_head=llama.pack_head,
)
