"""The mixture-of-experts block, one for every MoE model: route, group, multiply, combine.

    router -> top-k experts per token -> the (token, expert) pairs sorted by expert
           -> grouped matmuls over each expert's own tokens only -> weighted sum per token
    (+ a shared expert beside it, gated by a sigmoid where the architecture gates it)

The router's variants are read from the config (MoeConfig.routing): softmax then top-k
(Mixtral, Qwen, DeepSeek-V2), top-k logits then softmax (gpt-oss), or sigmoid scores chosen
with a correction bias that does not weight them (DeepSeek-V3); DeepSeek's choice may be
limited to the best groups of experts, and its weights scaled by a constant.

The grouped matmul multiplies each expert's weights by exactly the rows routed to it: the
C++ kernel on packed weights on XLA:CPU (`runtime.ops.matmul.PackedExperts`), else
`jax.lax.ragged_dot` (a grouped-matmul kernel on TPU/GPU). There is no capacity factor and no
token is dropped: the result equals transformers' loop over experts.

Sharding (the weight table names the axes, runtime/ops/mesh.py maps them): with tensor
parallelism each device holds every expert's slice of the intermediate features
("moe_mlp"); with expert parallelism (`enable_expert_parallel`) each device holds whole
experts ("expert"). Either way the block runs under `shard_map`: the tokens and their
routing are replicated (as the attention output is), each device computes what its
weights give (its experts' rows, or its feature slice of every row), and one all-reduce
sums the partial outputs. Dispatching rows to the device of their expert by all-to-all
would move fewer bytes at many devices; at the sizes tested here the replicated tokens
cost less than a second collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from models_jax.weights import WeightSpec, linear, zeros
from runtime.ops.matmul import PackedExperts
from runtime.ops.mesh import MODEL_AXIS
from runtime.ops.quantization import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The routed experts of one MoE layer (hashable: closed over by the jitted step).

    Attributes:
        num_experts / top_k: experts, and how many each token is routed to.
        intermediate_size: each expert's hidden features.
        norm_topk_prob: renormalize the top-k probabilities to sum to 1 (Mixtral always does).
        shared_intermediate_size: a shared expert every token passes through (Qwen2-MoE), 0: none.
        shared_expert_gate: the shared expert's output is scaled by sigmoid(x @ gate).
        routing: "softmax_topk" (softmax over all experts, then the top k: Mixtral, Qwen,
            DeepSeek-V2), "topk_softmax" (the top k logits, then a softmax over them: gpt-oss) or
            "sigmoid_topk" (sigmoid scores; the top k of scores + p["correction_bias"], weighted by
            the scores alone: DeepSeek-V3's e_score_correction_bias).
        num_groups / topk_groups: DeepSeek's group-limited routing (n_group, topk_group): the
            experts in num_groups equal groups, a token's k chosen among the topk_groups best
            groups only; 1 / 1: no groups.
        routed_scaling_factor: the routing weights are multiplied by it (DeepSeek).
        activation: "silu" (SwiGLU, gate and up side by side), "gelu_tanh" (GeGLU, likewise: Gemma 4)
            or "clamped_swiglu" (gpt-oss: gate and up interleaved in one matrix, clamped at
            `swiglu_limit`, (up + 1) * gate * sigmoid(alpha gate)).
        expert_parallel: experts split over the model axis instead of their features.
        mesh: the mesh the weights live on (None: one device, no collective).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    routing: str = "softmax_topk"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_parallel: bool = False
    mesh: Mesh | None = None

    @property
    def axes(self) -> tuple[str | None, str | None]:
        """The logical axes of (the expert index, an expert's intermediate features)."""
        return ("expert", None) if self.expert_parallel else (None, "moe_mlp")


def expert_weights(prefix: str, names: tuple[str, str, str], d: int, f: int, num_experts: int, init: Any,
                   expert_parallel: bool) -> dict[str, WeightSpec]:
    """The routed experts' gate, up and down projections, each stacked over experts:
    gate/up [E, D, F] from HF "{prefix}.{e}.{gate}.weight" [F, D], down [E, F, D].

    names: the HF module names of (gate, up, down): ("gate_proj", "up_proj", "down_proj"), or
    Mixtral's ("w1", "w3", "w2")."""
    expert_axis, feature_axis = MoeConfig(0, 0, 0, expert_parallel=expert_parallel).axes
    pattern = prefix + ".{expert}.{name}.weight"

    def one(name: str, d_in: int, d_out: int, axes: tuple) -> WeightSpec:
        w = linear(pattern.replace("{name}", name), d_in, d_out, axes, init)
        return dataclasses.replace(w, num_experts=num_experts, logical_axes=(expert_axis, *w.logical_axes))

    gate, up, down = names
    return {
        "gate": one(gate, d, f, ("embed", feature_axis)),
        "up": one(up, d, f, ("embed", feature_axis)),
        "down": one(down, f, d, (feature_axis, "embed")),
    }


def router_weight(hf_name: str, d: int, num_experts: int, init: Any) -> WeightSpec:
    """The router [D, E] (HF [E, D]), whole on every device."""
    return linear(hf_name, d, num_experts, ("embed", None), init)


def shared_gate_weight(hf_name: str, d: int) -> WeightSpec:
    return linear(hf_name, d, 1, ("embed", None), zeros)


def route(x: jax.Array, p: dict, cfg: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] in x's dtype, expert ids [T, k] int32) of each token's experts."""
    logits = jnp.einsum("td,de->te", x, p["router"], preferred_element_type=jnp.float32)
    if "router_bias" in p:
        logits = logits + p["router_bias"].astype(jnp.float32)
    if cfg.routing == "topk_softmax":
        top, ids = jax.lax.top_k(logits.astype(x.dtype), cfg.top_k)
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    scores = jax.nn.sigmoid(logits) if cfg.routing == "sigmoid_topk" else jax.nn.softmax(logits, axis=-1)  # [T, E]
    choice = scores + p["correction_bias"].astype(jnp.float32) if "correction_bias" in p else scores
    if cfg.num_groups > 1:
        choice = best_groups_only(choice, cfg)
    _, ids = jax.lax.top_k(choice, cfg.top_k)
    top = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)  # (sigmoid scores of k experts may all be ~0)
    if cfg.routed_scaling_factor != 1.0:
        top = top * cfg.routed_scaling_factor
    return top.astype(x.dtype), ids.astype(jnp.int32)


def best_groups_only(choice: jax.Array, cfg: MoeConfig) -> jax.Array:
    """DeepSeek's group-limited routing: `choice` [T, E] with -inf outside each token's
    cfg.topk_groups best groups (of cfg.num_groups equal groups of experts). A group ranks by its
    best expert under softmax scores (DeepSeek-V2's group_limited_greedy), by the sum of its
    best two under sigmoid scores (V3)."""
    t, e = choice.shape
    grouped = choice.reshape(t, cfg.num_groups, e // cfg.num_groups)
    if cfg.routing == "sigmoid_topk":
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
    else:
        group_scores = jnp.max(grouped, axis=-1)
    _, best = jax.lax.top_k(group_scores, cfg.topk_groups)  # [T, topk_groups]
    kept = jnp.any(best[:, :, None] == jnp.arange(cfg.num_groups), axis=1)  # [T, G]
    return jnp.where(jnp.repeat(kept, e // cfg.num_groups, axis=1), choice, -jnp.inf)


def grouped_matmul(x: jax.Array, w: Any, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] (rows sorted by group) @ w[group] -> [M, N]; rows past sum(group_sizes) are 0.

    w: [G, K, N] (jax.lax.ragged_dot), PackedExperts (the C++ kernel) or a QuantizedWeight
    ([G, K, N] int8 with its scales: `quantization="int8"` or GGUF's Q8_0)."""
    if isinstance(w, PackedExperts):
        return w.grouped_matmul(x, group_sizes)
    if isinstance(w, QuantizedWeight):
        # Dequantized to the activations' dtype, then the float grouped matmul: correct, and the
        # int8 bytes are what stays in memory, but each step writes the float experts out once. A
        # grouped int8 kernel (int8 rows of each expert read, the scale applied to the product)
        # would be the fast path.
        w = w.dequantize().astype(x.dtype)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)


def _activation(h: jax.Array, rows_expert: jax.Array, p: dict, cfg: MoeConfig) -> jax.Array:
    """The experts' hidden activations [M, F] from their gate/up products (see MoeConfig.activation)."""
    if cfg.activation == "clamped_swiglu":
        if "gate_up_bias" in p:
            h = h + p["gate_up_bias"][rows_expert].astype(jnp.float32)
        gate, up = h[:, ::2], h[:, 1::2]
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))
    gate, up = jnp.split(h, 2, axis=-1)
    if cfg.activation == "gelu_tanh":  # GeGLU (Gemma 4)
        return jax.nn.gelu(gate, approximate=True) * up
    return jax.nn.silu(gate) * up


def _experts_mlp(x: jax.Array, weights: jax.Array, ids: jax.Array, p: dict, cfg: MoeConfig, num_tokens: jax.Array,
                 first_expert: jax.Array | int, num_local: int) -> jax.Array:
    """The experts [first_expert, first_expert + num_local) on the tokens routed to them,
    weighted and summed per token ([T, D] float32; 0 where no local expert)."""
    t, k = ids.shape
    local = ids - first_expert
    real = (jnp.arange(t) < num_tokens)[:, None]
    local = jnp.where(real & (local >= 0) & (local < num_local), local, num_local).reshape(-1)  # [T k]
    order = jnp.argsort(local, stable=True)  # pairs grouped by expert, the rest (num_local) last
    group_sizes = jnp.bincount(local, length=num_local).astype(jnp.int32)  # [E_local]
    rows = x[order // k]  # [T k, D]
    rows_expert = jnp.minimum(local[order], num_local - 1)  # each sorted row's expert (rows past the groups: any)
    if "gate_up" in p:  # one matrix: [gate | up] joined for the kernel, or interleaved (gpt-oss)
        h = grouped_matmul(rows, p["gate_up"], group_sizes)
    else:
        h = jnp.concatenate([grouped_matmul(rows, p["gate"], group_sizes),
                             grouped_matmul(rows, p["up"], group_sizes)], axis=-1)
    h = _activation(h, rows_expert, p, cfg).astype(x.dtype)
    y = grouped_matmul(h, p["down"], group_sizes)  # [T k, D]; rows past the groups are 0
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32))


def _spec(name: str, ndim: int, expert_parallel: bool) -> P:
    """How an expert tensor lies on the model axis (as its weight table's logical axes say)."""
    if expert_parallel:
        return P(MODEL_AXIS)  # whole experts
    if name == "down":  # [E, F, D]: features in
        return P(None, MODEL_AXIS, None)
    return P(*([None] * (ndim - 1)), MODEL_AXIS)  # [E, D, F] / [E, D, 2F] / bias [E, 2F]: features out


def routed_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, p: dict, cfg: MoeConfig,
                   num_tokens: jax.Array) -> jax.Array:
    """The routed experts' output [T, D] (float32), sharded as their weights are."""
    mesh = cfg.mesh
    if mesh is None or mesh.shape[MODEL_AXIS] == 1:
        return _experts_mlp(x, weights, ids, p, cfg, num_tokens, 0, cfg.num_experts)
    ways = mesh.shape[MODEL_AXIS]
    num_local = cfg.num_experts // ways if cfg.expert_parallel else cfg.num_experts
    w_spec = {name: _spec(name, w.ndim, cfg.expert_parallel) for name, w in p.items()}

    def local(x, weights, ids, p, num_tokens):
        first = jax.lax.axis_index(MODEL_AXIS) * num_local if cfg.expert_parallel else 0
        return jax.lax.psum(_experts_mlp(x, weights, ids, p, cfg, num_tokens, first, num_local), MODEL_AXIS)

    replicated = P()
    return jax.shard_map(local, mesh=mesh, check_vma=False,
                         in_specs=(replicated, replicated, replicated, w_spec, replicated),
                         out_specs=replicated)(x, weights, ids, p, num_tokens)


def moe_block(x: jax.Array, p: dict, cfg: MoeConfig, num_tokens: jax.Array, shared_mlp=None) -> jax.Array:
    """The MoE feed-forward of a layer: routed experts, plus the shared expert where there is one.

    x: [T, D]; p: {"router", ("router_bias"), ("correction_bias"), "experts", ("down_bias"), ("shared_gate")};
    shared_mlp: x -> the shared expert's [T, D] output (a dense gated MLP), or None. Returns
    [T, D] in x's dtype."""
    weights, ids = route(x, p, cfg)
    y = routed_experts(x, weights, ids, p["experts"], cfg, num_tokens)
    if "down_bias" in p:  # [E, D], whole on every device: added once, after any all-reduce
        y = y + jnp.einsum("tk,tkd->td", weights.astype(jnp.float32), p["down_bias"][ids].astype(jnp.float32))
    if shared_mlp is not None:
        shared = shared_mlp(x).astype(jnp.float32)
        if cfg.shared_expert_gate:
            shared = shared * jax.nn.sigmoid(jnp.einsum("td,do->to", x, p["shared_gate"],
                                                        preferred_element_type=jnp.float32))
        y = y + shared
    return y.astype(x.dtype)
