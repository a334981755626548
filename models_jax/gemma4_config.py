"""Gemma 4's configuration: `Gemma4Args` read from the Hugging Face config (gemma4_text), the
per-layer facts derived from it (layer kinds, KV-shared layers and their source layers, the
cache's head shape), each layer type's rotary table, and the layers' runs by kind.

What each part means and what is refused: models_jax/gemma4.py's docstring.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import numpy as np

from models_jax import layers, moe

ACTIVATION = "gelu_pytorch_tanh"
ROPE_TYPES = ("default", "proportional")
SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Gemma4Args:
    """Gemma 4's hyperparameters (hashable: closed over by the jitted step).

    num_kv_heads / head_dim are the sliding layers', global_kv_heads / global_head_dim the
    global layers'; kv_repeat multiplies the cache's heads to split over the mesh (set by
    registry.native)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    global_kv_heads: int
    global_head_dim: int
    rms_norm_eps: float
    rope: layers.RopeConfig  # global layers
    local_rope: layers.RopeConfig  # sliding layers
    sliding: tuple[bool, ...]  # per layer: a sliding-window layer
    sliding_window: int
    values_from_keys: bool = False  # attention_k_eq_v: the global layers have no v projection
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_dim: int = 0  # hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_vocab: int = 0
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    moe: moe.MoeConfig | None = None
    kv_repeat: int = 1

    @classmethod
    def from_hf(cls, cfg: Any) -> "Gemma4Args":
        """Raises ValueError on config features this module does not implement."""
        act = getattr(cfg, "hidden_activation", None) or ACTIVATION
        if act != ACTIVATION:
            raise ValueError(f"hidden_activation {act!r} is not supported (only {ACTIVATION})")
        if getattr(cfg, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention is not supported (servax attends causally); "
                             "use model_impl='torchax'")
        if getattr(cfg, "attention_bias", False):
            raise ValueError("attention_bias is not supported on Gemma 4 (no released checkpoint has biases)")
        n = cfg.num_hidden_layers
        types_ = list(cfg.layer_types)
        if len(types_) != n or not set(types_) <= {SLIDING, GLOBAL}:
            raise ValueError(f"layer_types {types_} must name {n} layers, each one of {SLIDING}, {GLOBAL}")
        shapes = {t: _per_layer(cfg, types_.index(t)) if t in types_ else None for t in (SLIDING, GLOBAL)}
        heads = cfg.num_attention_heads
        (kv, hd), (gkv, ghd) = (shapes[t] or shapes[SLIDING] or shapes[GLOBAL] for t in (SLIDING, GLOBAL))
        if any(_per_layer(cfg, i) != shapes[t] for i, t in enumerate(types_)):
            raise ValueError("per_layer_config gives layers of one type different head shapes")
        moe_config = None
        if getattr(cfg, "enable_moe_block", False):
            moe_config = moe.MoeConfig(num_experts=cfg.num_experts, top_k=cfg.top_k_experts,
                                       intermediate_size=cfg.moe_intermediate_size, activation="gelu_tanh")
        per_layer_dim = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
        if set(types_[n - shared:]) - set(types_[:n - shared]):
            raise ValueError(f"the last {shared} layers share K/V, but not every type of them has an earlier layer "
                             "of its type to read from")
        cap = getattr(cfg, "final_logit_softcapping", None)
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=n, num_heads=heads, num_kv_heads=kv, head_dim=hd, global_kv_heads=gkv, global_head_dim=ghd,
            rms_norm_eps=cfg.rms_norm_eps, rope=_rope(cfg, GLOBAL, ghd), local_rope=_rope(cfg, SLIDING, hd),
            sliding=tuple(t == SLIDING for t in types_), sliding_window=int(cfg.sliding_window),
            values_from_keys=bool(getattr(cfg, "attention_k_eq_v", False)), num_kv_shared_layers=shared,
            double_wide_mlp=bool(getattr(cfg, "use_double_wide_mlp", False)), per_layer_dim=per_layer_dim,
            per_layer_vocab=int(getattr(cfg, "vocab_size_per_layer_input", 0) or cfg.vocab_size),
            final_logit_softcap=float(cap) if cap else None,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
            initializer_range=float(getattr(cfg, "initializer_range", 0.02)), moe=moe_config,
        )

    # ---- derived per-layer facts ------------------------------------------------------------

    @property
    def num_cache_layers(self) -> int:
        """The layers that own K/V in the cache: all but the KV-shared tail."""
        return self.num_layers - self.num_kv_shared_layers

    def shared(self, i: int) -> bool:
        return i >= self.num_cache_layers

    def kv_source(self, i: int) -> int:
        """The layer whose K/V layer i attends over: itself, or for a KV-shared layer the last
        earlier layer of its type that owns a cache (transformers' "store" layer)."""
        if not self.shared(i):
            return i
        return max(j for j in range(self.num_cache_layers) if self.sliding[j] == self.sliding[i])

    def stack_key(self, i: int) -> str:
        return ("shared_" if self.shared(i) else "") + ("sliding" if self.sliding[i] else "global")

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if s else None for s in self.sliding)

    @property
    def cache_head_dim(self) -> int:
        return max(self.head_dim, self.global_head_dim)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads each cache row stores: both layer types' counts repeated to their lcm, times kv_repeat."""
        return math.lcm(self.num_kv_heads, self.global_kv_heads) * self.kv_repeat


def _per_layer(cfg: Any, i: int) -> tuple[int, int]:
    """(KV heads, head size) of layer i, with its per_layer_config overrides (global layers)."""
    overrides = getattr(cfg, "per_layer_config", None)
    if overrides is not None and not isinstance(overrides, dict):  # transformers' per-layer view of a config
        return int(overrides[i].num_key_value_heads), int(overrides[i].head_dim)
    layer = (overrides or {}).get(str(i)) or (overrides or {}).get(i) or {}  # as to_dict() writes it
    return int(layer.get("num_key_value_heads", cfg.num_key_value_heads)), int(layer.get("head_dim", cfg.head_dim))


def _rope(cfg: Any, layer_type: str, head_dim: int) -> layers.RopeConfig:
    """One layer type's rotary table: default (or another type models_jax.layers reads), or
    proportional (transformers' `_compute_proportional_rope_parameters`: the first
    partial_rotary_factor * head_dim / 2 frequencies of a head_dim-sized rope, zeros after)."""
    params = dict((getattr(cfg, "rope_parameters", None) or {}).get(layer_type) or {"rope_type": "default"})
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} ({layer_type}) is not supported on Gemma 4 (only {ROPE_TYPES})")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        one = types.SimpleNamespace(rope_parameters=params, max_position_embeddings=cfg.max_position_embeddings)
        return layers.RopeConfig.from_hf(one, head_dim)
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv_freq = np.zeros(head_dim // 2, np.float32)
    inv_freq[:angles] = layers.default_inv_freq(theta, head_dim)[:angles]
    inv_freq /= np.float32(params.get("factor", 1.0))
    return layers.RopeConfig("proportional", head_dim, theta, tuple(inv_freq.tolist()))


def layer_stacks(a: Gemma4Args) -> tuple[tuple[str, int], ...]:
    """Runs of consecutive layers of one kind, in layer order (LayerStages.stacks)."""
    runs: list[tuple[str, int]] = []
    for i in range(a.num_layers):
        key = a.stack_key(i)
        if runs and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1] + 1)
        else:
            runs.append((key, 1))
    return tuple(runs)

