"""Layers shared by the native models: RMSNorm, rotary embeddings, gated MLP, attention projections.

Plain functions of einsums on a flat ragged token axis T. They compute in the dtype of
their weights and follow the Hugging Face reference numerics (norms and rotary angles
in float32), so that float32 logits match transformers to ~1e-5.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime.ops.matmul import PackedWeight

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32 (as transformers does). x: [..., D]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


# ---- rotary embeddings ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings read from a HF config (its `rope_parameters` / `rope_scaling`).

    rope_type: default | linear | dynamic | llama3 | yarn (transformers' names).
    inv_freq: [head_dim // 2] inverse frequencies after static scaling (float64 numpy, as a tuple).
    dynamic_factor / max_position: dynamic NTK only; the base grows with the sequence length.
    attention_scaling: cos and sin are multiplied by it (YaRN's attention factor; 1 otherwise).
    """

    rope_type: str
    head_dim: int
    theta: float
    inv_freq: tuple[float, ...]
    dynamic_factor: float = 1.0
    max_position: int = 0
    attention_scaling: float = 1.0

    @classmethod
    def from_hf(cls, hf_config: Any, head_dim: int) -> "RopeConfig":
        """Raises ValueError on a rope type or partial rotary factor this module does not implement."""
        # transformers 5 names it rope_parameters (with rope_theta inside); older configs rope_scaling.
        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported by the native JAX models; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)} (use model_impl='torchax' for others)"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported by the native JAX models")
        inv_freq = default_inv_freq(theta, head_dim)
        dynamic_factor, max_position, scaling = 1.0, 0, 1.0
        if rope_type == "yarn":
            inv_freq, scaling = yarn_inv_freq(theta, head_dim, params, int(hf_config.max_position_embeddings))
        elif rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, params)
        elif rope_type == "dynamic":
            dynamic_factor, max_position = float(params["factor"]), int(hf_config.max_position_embeddings)
        return cls(rope_type, head_dim, theta, tuple(inv_freq.tolist()), dynamic_factor, max_position, scaling)


def default_inv_freq(theta: float, head_dim: int) -> np.ndarray:  # [head_dim // 2] float32
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    return (1.0 / (theta**exponents)).astype(np.float32)


def llama3_inv_freq(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    """Llama 3.1 frequency-dependent scaling (transformers' `_compute_llama3_parameters`)."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_inv_freq(theta: float, head_dim: int, params: dict, max_position: int) -> tuple[np.ndarray, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): inverse frequencies blended between
    interpolated and extrapolated by a linear ramp over the dimensions, and the attention
    factor that scales cos and sin (from `factor`, or DeepSeek's mscale / mscale_all_dim)."""
    factor = params.get("factor") or max_position / params["original_max_position_embeddings"]
    original = params["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    scaling = params.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        scaling = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                   else get_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float32)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(scaling)


def rope_cos_sin(
    rope: RopeConfig,
    positions: jax.Array,  # [T] int32
    seq_len: jax.Array,  # [T] int32, context length of each token's sequence (dynamic NTK only)
) -> tuple[jax.Array, jax.Array]:  # cos, sin: [T, head_dim] float32
    inv_freq = jnp.asarray(rope.inv_freq, jnp.float32)[None, :]  # [1, head_dim // 2]
    if rope.rope_type == "dynamic":
        # transformers recomputes the base from the current length once it exceeds
        # max_position_embeddings; per token, that length is its sequence's.
        d, f, m = rope.head_dim, rope.dynamic_factor, rope.max_position
        length = jnp.maximum(seq_len, m).astype(jnp.float32)[:, None]
        base = rope.theta * ((f * length / m) - (f - 1)) ** (d / (d - 2))
        exponents = jnp.arange(0, d, 2, dtype=jnp.float32) / d
        inv_freq = 1.0 / base**exponents  # [T, head_dim // 2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if rope.attention_scaling != 1.0:
        cos, sin = cos * rope.attention_scaling, sin * rope.attention_scaling
    # Computed once: XLA would otherwise fuse the cos and sin into each layer's q and k rotations,
    # once per head and layer (in a one-program decode step; benchmarks/RESULTS.md, stop 63).
    return jax.lax.optimization_barrier((cos, sin))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF "rotate half" rotary embedding. x: [T, heads, head_dim]; cos, sin: [T, head_dim]."""
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# ---- projections -----------------------------------------------------------------------


def project_to_heads(x: jax.Array, w: Any, b: jax.Array | None = None, rows: jax.Array | None = None,
                     head_dim: int | None = None) -> jax.Array:
    """x: [T, D] @ w: [D, heads, head_dim] (or that as a PackedWeight [D, heads * head_dim] with
    `head_dim`; rows: see `matmul`) (+ b: [heads, head_dim]) -> [T, heads, head_dim]."""
    if isinstance(w, PackedWeight):
        y = w.matmul(x, rows).reshape(x.shape[0], -1, head_dim)
    else:
        y = jnp.einsum("td,dhk->thk", x, w)
    return y if b is None else y + b


def matmul(x: jax.Array, w: Any, rows: jax.Array | None = None) -> jax.Array:
    """x [T, in] @ w [in, out] (an array, or a runtime.ops.matmul.PackedWeight, which then
    multiplies only the first `rows` rows of x: a step's real tokens; the rest give zeros)."""
    if isinstance(w, PackedWeight):
        return w.matmul(x, rows)
    return x @ w


def project_to_joined_heads(
    x: jax.Array, w: Any, b: jax.Array | None, heads: tuple[int, ...], head_dim: int,
    rows: jax.Array | None = None,
) -> list[jax.Array]:
    """x: [T, D] @ w: [D, sum(heads) * head_dim] (+ b) -> one [T, h, head_dim] per entry of
    `heads`: projections whose weights were joined side by side (models_jax.weights.join_outputs).
    rows: see `matmul`."""
    return split_joined_heads(matmul(x, w, rows), b, heads, head_dim)


def split_joined_heads(y: jax.Array, b: jax.Array | None, heads: tuple[int, ...], head_dim: int) -> list[jax.Array]:
    """y [T, sum(heads) * head_dim], a joined projection's output (+ b), as one [T, h, head_dim]
    per entry of `heads`."""
    y = y if b is None else y + b
    bounds = np.cumsum([h * head_dim for h in heads])[:-1].tolist()
    return [part.reshape(y.shape[0], h, head_dim) for part, h in zip(jnp.split(y, bounds, axis=-1), heads)]


def project_from_heads(x: jax.Array, w: Any, b: jax.Array | None = None, rows: jax.Array | None = None) -> jax.Array:
    """x: [T, heads, head_dim] @ w: [heads, head_dim, D] (or that as a PackedWeight
    [heads * head_dim, D]; rows: see `matmul`) (+ b: [D]) -> [T, D]."""
    if isinstance(w, PackedWeight):
        y = w.matmul(x.reshape(x.shape[0], -1), rows)
    else:
        y = jnp.einsum("thk,hkd->td", x, w)
    return y if b is None else y + b


def gated_mlp(x: jax.Array, p: dict, lora: Any = None, rows: jax.Array | None = None,
              activation: Any = jax.nn.silu) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)). x: [T, D]; p: gate/up [D, F] (or gate_up [D, 2F]),
    down [F, D] (joined ones also as runtime.ops.matmul.PackedWeight), optional biases.

    lora: a LoRA delta function (name, input) -> [T, out] or None (see lora_delta).
    rows: see `matmul`.
    activation: applied to the gate (`gelu_tanh` makes it Gemma's GeGLU).
    """
    if "gate_up" in p:  # gate and up joined side by side: [D, 2F]
        gate_up = matmul(x, p["gate_up"], rows)
        gate, up = jnp.split(gate_up if "gate_up_bias" not in p else gate_up + p["gate_up_bias"], 2, axis=-1)
    else:
        gate = jnp.einsum("td,df->tf", x, p["gate"])
        up = jnp.einsum("td,df->tf", x, p["up"])
        if "gate_bias" in p:
            gate, up = gate + p["gate_bias"], up + p["up_bias"]
    if lora is not None:
        gate, up = add_delta(gate, lora("gate_proj", x)), add_delta(up, lora("up_proj", x))
    h = activation(gate) * up
    y = matmul(h, p["down"], rows)
    if lora is not None:
        y = add_delta(y, lora("down_proj", h))
    return y + p["down_bias"] if "down_bias" in p else y


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (transformers' "gelu_pytorch_tanh")."""
    return jax.nn.gelu(x, approximate=True)


def add_delta(y: jax.Array, delta: jax.Array | None) -> jax.Array:
    """y + delta (reshaped to y; None adds nothing)."""
    return y if delta is None else y + delta.reshape(y.shape).astype(y.dtype)


def lora_delta(slots: dict, slot_of_token: jax.Array) -> Any:
    """The LoRA delta function of one layer: (name, x [T, in]) -> [T, out], or None where no
    adapter slot table exists for `name`.

    slots: {PEFT module name: {"a": [S, in, r], "b": [S, r, out]}} (runtime/ops/lora.py; slot 0
    is zeros); slot_of_token: [T] int32. Each token's x @ a[s] is kept for its own slot only
    and the result meets b as one matmul over (slot, rank): two dense matmuls per projection
    whatever mix of adapters the step holds.
    """
    num_slots = next(iter(slots.values()))["a"].shape[0]
    onehot = slot_of_token[:, None] == jnp.arange(1, num_slots)[None, :]  # [T, S - 1]; slot 0 adds nothing
    any_adapter = jnp.any(slot_of_token > 0)

    def delta(name: str, x: jax.Array) -> jax.Array | None:
        if name not in slots:
            return None
        a, b = slots[name]["a"][1:], slots[name]["b"][1:]

        def apply() -> jax.Array:
            xa = jnp.einsum("ti,sir->tsr", x, a) * onehot[:, :, None].astype(x.dtype)
            return jnp.einsum("tsr,sro->to", xa, b)

        # A step of base-model requests only skips the adapter matmuls (and their weight reads).
        return jax.lax.cond(any_adapter, apply, lambda: jnp.zeros((x.shape[0], b.shape[-1]), x.dtype))

    return delta
