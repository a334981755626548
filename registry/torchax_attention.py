"""Route a transformers model's attention (and MoE experts) to servax's JAX kernels.

transformers looks attention up by name in `AttentionInterface`; a model loaded with
`attn_implementation=ATTN_IMPLEMENTATION` calls `paged_attention_interface` once per
layer with that layer's module (which carries `layer_idx`). The function cannot take the
paged cache as an argument, so the step function opens a `StepContext` around the traced
call: it holds the batch and the stacked KV cache (runtime.ops.step.KVCache, tracers under
jit), which each layer updates at its own `layer_idx` (a static index into the stacked
arrays) and hands on to the next; the step function then returns the last one.

Traced whole, the HF model's own Python loop over its layers is unrolled: the program grows
with depth. registry.torchax_layers steps uniform layers a few per call instead; the context's
`layer` then names the (traced) KV layer in place of the module's layer_idx.

Mixture-of-experts blocks that use transformers' `@use_experts_implementation` are loaded
with `experts_implementation=EXPERTS_IMPLEMENTATION`: the stock "eager" loop picks experts
with data-dependent shapes (`nonzero`), which cannot be traced. Ours has static shapes.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from runtime.ops.attention import paged_attention
from runtime.ops.step import KVCache, StepInput

ATTN_IMPLEMENTATION = "servax_paged"
EXPERTS_IMPLEMENTATION = "servax_static"

_local = threading.local()


class StepContext:
    """The paged-attention state of one traced model call.

    Attributes:
        batch: the StepInput of this call.
        kv_cache: the stacked cache: going in, then after each layer's write (None: record
            shapes only).
        kv_repeat: how many times each KV head is stored in the cache (registry.native.kv_repeat):
            > 1 when the model axis has more devices than a multiple of the KV heads, so that
            each device holds the KV heads its query heads read.
        qkv_sharding: if set, q, k and v are constrained to it as they arrive (replicated, for
            models whose fused q|k|v projection is replicated: see registry.torchax_model).
        updated: the layer indices that wrote their K/V in this call.
        seen: layer index -> (num_heads, num_kv_heads, head_dim, dtype) of the Q and K each layer
            produced (the model's own KV heads, before any repeat).
        unsupported: why a layer cannot be served (bidirectional, attention sinks), by layer.
        layer: the KV layer to write and read, overriding the module's layer_idx (a traced
            index: one decoder layer's program run for every layer, registry.torchax_layers).
    """

    def __init__(
        self, batch: StepInput | None, kv_cache: KVCache | None, kv_repeat: int = 1,
        qkv_sharding: jax.sharding.NamedSharding | None = None, layer: jax.Array | None = None,
    ):
        self.batch = batch
        self.kv_cache = kv_cache
        self.kv_repeat = kv_repeat
        self.qkv_sharding = qkv_sharding
        self.layer = layer
        self.updated: set[int] = set()
        self.seen: dict[int, tuple[int, int, int, Any]] = {}
        self.unsupported: dict[int, str] = {}

    def collect(self) -> KVCache:
        """The updated cache; every layer must have run exactly once."""
        if self.kv_cache is None:
            raise RuntimeError("collect() on a shape-probe StepContext (it has no KV cache)")
        missing = [i for i in range(self.kv_cache.num_layers) if i not in self.updated]
        if missing:
            raise RuntimeError(f"attention of layers {missing} was not routed through {ATTN_IMPLEMENTATION}")
        return self.kv_cache


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Make `ctx` the one the attention function reads while the model runs."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def paged_attention_interface(
    module: Any,
    query: Any,  # torch view of [1, num_heads, T, head_dim]
    key: Any,  # [1, num_kv_heads, T, head_dim]
    value: Any,  # [1, num_kv_heads, T, head_dim]
    attention_mask: Any,  # ignored: causality, raggedness and padding come from the batch
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention function: write K/V to the paged cache, attend, return [1, T, H, D]."""
    from torchax.interop import jax_view, torch_view

    ctx: StepContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called outside a servax step")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx; cannot pick its KV cache")
    q, k, v = (jax_view(x)[0].swapaxes(0, 1) for x in (query, key, value))  # [T, heads, D]
    ctx.seen[layer] = (q.shape[1], k.shape[1], k.shape[2], k.dtype)
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        ctx.unsupported[layer] = "bidirectional (non-causal) attention"
    if kwargs.get("s_aux") is not None:
        ctx.unsupported[layer] = "attention sinks (s_aux)"
    if ctx.kv_cache is None:  # shape probe: no cache, no kernel
        return torch_view(jnp.zeros_like(q)[None]), None
    if layer in ctx.unsupported:
        raise NotImplementedError(f"layer {layer}: {ctx.unsupported[layer]} is not supported by the paged kernel")
    if layer in ctx.updated:
        raise RuntimeError(f"layer {layer} attended twice in one step (shared layer_idx?)")
    if ctx.qkv_sharding is not None:
        q, k, v = (jax.lax.with_sharding_constraint(x, ctx.qkv_sharding) for x in (q, k, v))
    if ctx.kv_repeat > 1:
        # Copies of a head stay adjacent: cache head j holds KV head j // kv_repeat, and query
        # head h, reading cache head h // (H / (kv * r)), reads KV head h // (H / kv) as in GQA.
        k, v = (jnp.repeat(x, ctx.kv_repeat, axis=1) for x in (k, v))  # [T, kv * r, D]
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    out, ctx.kv_cache = paged_attention(
        q, k, v, ctx.kv_cache, ctx.batch, layer=layer if ctx.layer is None else ctx.layer,
        scale=scale,
        sliding_window=int(sliding_window) if sliding_window else None,
        logit_soft_cap=float(softcap) if softcap else None,
    )
    ctx.updated.add(layer)
    return torch_view(out[None]), None


def static_experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """MoE experts with static shapes, for `@use_experts_implementation` expert blocks.

    hidden_states [N, H], top_k_index / top_k_weights [N, k] -> [N, H]. When N * k is below
    the number of experts, gather the chosen experts' weights per (token, expert) pair
    (transformers' "batched_mm"); otherwise run every expert on every token and combine
    with the routing weights (zero for unchosen experts): reading all experts once is then
    cheaper than gathering a copy per pair.
    """
    import torch

    from transformers.integrations.moe import batched_mm_experts_forward

    num_tokens, num_top_k = top_k_index.shape
    if num_tokens * num_top_k < self.num_experts:
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    up_weight = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    pattern_w = "nh,eho->neo" if self.is_transposed else "nh,eoh->neo"
    out = torch.einsum(pattern_w, hidden_states, up_weight)  # [N, E, up_out]
    if up_bias is not None:
        out = out + up_bias
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)  # [N, E, I]
    pattern_d = "nei,eih->neh" if self.is_transposed else "nei,ehi->neh"
    out = torch.einsum(pattern_d, out, self.down_proj)  # [N, E, H]
    if self.has_bias:
        out = out + self.down_proj_bias
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    one_hot = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts)  # [N, k, E]
    combine = (one_hot.to(top_k_weights.dtype) * top_k_weights[..., None]).sum(dim=1)  # [N, E]
    out = (out * combine[..., None].to(out.dtype)).sum(dim=1)
    return out.to(hidden_states.dtype)


_registered = False


def register_implementations() -> None:
    """Register the attention and experts functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_interface)
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, static_experts_forward)
    _registered = True
