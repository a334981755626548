"""Gemma 4's weight table: one table per kind of decoder layer (sliding or global, owning K/V
or KV-shared), stacked over the checkpoint layers of that kind, plus the embeddings and the
per-layer input tables; the experts' joined gate and up read as two halves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from models_jax import moe
from models_jax.gemma4_config import Gemma4Args, layer_stacks
from models_jax.weights import WeightSpec, embedding, linear, linear_from_heads, linear_to_heads, ones, vector


@dataclasses.dataclass(frozen=True)
class _Gemma4Weight(WeightSpec):
    """A WeightSpec stacked over the checkpoint layers `layer_ids` (a stack of one kind of the
    interleaved layers), or one of `parts` equal slices of its checkpoint tensor along
    `part_axis` (the experts keep gate and up in one [E, 2F, D] tensor; apart, each splits over
    the mesh by its own features)."""

    layer_ids: tuple[int, ...] = ()
    part: int = 0
    parts: int = 1
    part_axis: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        if self.parts == 1:
            return super().shape
        hf = list(self.hf_shape)
        hf[self.part_axis] //= self.parts
        return dataclasses.replace(self, hf_shape=tuple(hf), parts=1).shape

    @property
    def hf_names(self) -> list[str]:
        if not self.layer_ids or self.num_layers is None:
            return super().hf_names
        return [self.hf_name.replace("{layer}", str(i)) for i in self.layer_ids]

    def to_native(self, tensor: Any) -> Any:
        if self.parts > 1:
            size = tensor.shape[self.part_axis] // self.parts
            index = [slice(None)] * tensor.ndim
            index[self.part_axis] = slice(self.part * size, (self.part + 1) * size)
            tensor = tensor[tuple(index)]
        return super().to_native(tensor)


def _stacked_at(table: dict, layer_ids: tuple[int, ...]) -> dict:
    """One layer's table stacked over the checkpoint's layers `layer_ids` (a leading "layers" axis)."""
    def stack(w: WeightSpec) -> WeightSpec:
        fields = {**vars(w), "num_layers": len(layer_ids), "logical_axes": ("layers", *w.logical_axes)}
        return _Gemma4Weight(**{**fields, "layer_ids": layer_ids})

    return jax.tree.map(stack, table, is_leaf=lambda x: isinstance(x, WeightSpec))


def layer_table(a: Gemma4Args, sliding: bool, shared: bool) -> dict:
    """One decoder layer's WeightSpecs of a kind (hf names with `{layer}`); norms plain weights."""
    d, hd = a.hidden_size, a.head_dim if sliding else a.global_head_dim
    kv = a.num_kv_heads if sliding else a.global_kv_heads
    f = a.intermediate_size * (2 if shared and a.double_wide_mlp else 1)
    normal = jax.nn.initializers.normal(a.initializer_range)
    pre = "model.layers.{layer}."
    attn, mlp = pre + "self_attn.", pre + "mlp."
    norm = lambda name, size=d, axes=("embed",): vector(pre + name + ".weight", size, axes)  # noqa: E731
    w = {
        "input_norm": norm("input_layernorm"),
        "q": linear_to_heads(attn + "q_proj.weight", d, a.num_heads, hd, "q_heads", normal),
        "q_norm": vector(attn + "q_norm.weight", hd, ("head_dim",)),
        "o": linear_from_heads(attn + "o_proj.weight", a.num_heads, hd, d, normal),
        "post_attn_norm": norm("post_attention_layernorm"),
        "pre_ffw_norm": norm("pre_feedforward_layernorm"),
        "post_ffw_norm": norm("post_feedforward_layernorm"),
        "mlp": {
            "gate": linear(mlp + "gate_proj.weight", d, f, ("embed", "mlp"), normal),
            "up": linear(mlp + "up_proj.weight", d, f, ("embed", "mlp"), normal),
            "down": linear(mlp + "down_proj.weight", f, d, ("mlp", "embed"), normal),
        },
        "layer_scalar": WeightSpec(pre + "layer_scalar", (1,), (None,), ones),
    }
    if not shared:  # KV-shared layers read an earlier layer's K/V
        w["k"] = linear_to_heads(attn + "k_proj.weight", d, kv, hd, "kv_heads", normal)
        w["k_norm"] = vector(attn + "k_norm.weight", hd, ("head_dim",))
        if sliding or not a.values_from_keys:
            w["v"] = linear_to_heads(attn + "v_proj.weight", d, kv, hd, "kv_heads", normal)
    if a.per_layer_dim:
        w["per_layer_gate"] = linear(pre + "per_layer_input_gate.weight", d, a.per_layer_dim, ("embed", None), normal)
        w["per_layer_proj"] = linear(pre + "per_layer_projection.weight", a.per_layer_dim, d, (None, "embed"), normal)
        w["post_per_layer_norm"] = norm("post_per_layer_input_norm")
    if a.moe is not None:
        m = a.moe
        expert_axis, feature_axis = m.axes
        e, fm = m.num_experts, m.intermediate_size
        gate_up = dict(hf_name=pre + "experts.gate_up_proj", hf_shape=(e, 2 * fm, d),
                       logical_axes=(expert_axis, "embed", feature_axis), init=normal, perm=(0, 2, 1), parts=2,
                       part_axis=1)
        w["router"] = {"proj": moe.router_weight(pre + "router.proj.weight", d, e, normal),
                       "scale": vector(pre + "router.scale", d, ("embed",)),
                       "per_expert_scale": vector(pre + "router.per_expert_scale", e)}
        w["experts"] = {  # [E, D, F] each, down [E, F, D]
            "gate": _Gemma4Weight(**gate_up, part=0), "up": _Gemma4Weight(**gate_up, part=1),
            "down": WeightSpec(pre + "experts.down_proj", (e, d, fm), (expert_axis, feature_axis, "embed"), normal,
                               perm=(0, 2, 1)),
        }
        w["post_ffw_norm_1"] = norm("post_feedforward_layernorm_1")  # the dense MLP's output
        w["pre_ffw_norm_2"] = norm("pre_feedforward_layernorm_2")  # the experts' input
        w["post_ffw_norm_2"] = norm("post_feedforward_layernorm_2")  # the experts' output
    return w



def weight_table(a: Gemma4Args) -> dict:
    """The params tree as WeightSpecs: embeddings, per-layer input tables, one stack per kind of
    layer. Sharded as the Llama family's (models_jax/llama.py: heads, MLP features, vocabulary);
    the per-layer input tables and projections whole on every device."""
    d = a.hidden_size
    normal = jax.nn.initializers.normal(a.initializer_range)
    table = {
        "embed": embedding("model.embed_tokens.weight", a.vocab_size, d, normal),
        "final_norm": vector("model.norm.weight", d, ("embed",)),
    }
    for key in dict(layer_stacks(a)):
        ids = tuple(i for i in range(a.num_layers) if a.stack_key(i) == key)
        table[key] = _stacked_at(layer_table(a, a.sliding[ids[0]], a.shared(ids[0])), ids)
    if a.per_layer_dim:
        width = a.num_layers * a.per_layer_dim
        table["per_layer_embed"] = WeightSpec("model.embed_tokens_per_layer.weight", (a.per_layer_vocab, width),
                                              (None, None), normal)
        table["per_layer_model_proj"] = linear("model.per_layer_model_projection.weight", d, width, ("embed", None),
                                               normal)
        table["per_layer_proj_norm"] = vector("model.per_layer_projection_norm.weight", a.per_layer_dim)
    if not a.tie_word_embeddings:
        table["lm_head"] = linear("lm_head.weight", d, a.vocab_size, ("embed", "vocab"), normal)
    return table
