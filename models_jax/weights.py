"""The abstract description of one parameter, shared by every native model.

A model declares a pytree of `WeightSpec`s with the same structure as its params. That one
tree drives loading (which tensor of the Hugging Face checkpoint, how to lay it out) and
sharding (the PartitionSpec under a mesh with a "model" axis), so a layout or sharding
change is a one-line edit in the model's table.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One native parameter and where it comes from.

    The checkpoint tensor `hf_name` (shape `hf_shape`) is reshaped to `view`, transposed
    by `perm`, and, with `repeat=(axis, times)`, each slice along `axis` is repeated
    `times` times in place (KV heads stored once per device group, see
    models_jax/__init__.py), giving the native layout `shape`.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    spec: P
    view: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None
    repeat: tuple[int, int] | None = None  # (axis of the native layout, times)

    def __post_init__(self):
        if self.view is not None and math.prod(self.view) != math.prod(self.hf_shape):
            raise ValueError(f"{self.hf_name}: view {self.view} does not fit {self.hf_shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.view or self.hf_shape
        shape = [shape[i] for i in self.perm] if self.perm else list(shape)
        if self.repeat:
            axis, times = self.repeat
            shape[axis] *= times
        return tuple(shape)


def vector(hf_name: str, size: int, spec: P = P()) -> WeightSpec:
    """A 1-D tensor kept as is (norm scales, biases)."""
    return WeightSpec(hf_name, (size,), spec)


def linear(hf_name: str, d_in: int, d_out: int, spec: P) -> WeightSpec:
    """An nn.Linear weight: HF [out, in] -> native [in, out]."""
    return WeightSpec(hf_name, (d_out, d_in), spec, perm=(1, 0))


def _repeat(axis: int, times: int) -> tuple[int, int] | None:
    return (axis, times) if times > 1 else None


def linear_to_heads(
    hf_name: str, d_in: int, heads: int, head_dim: int, spec: P, repeat: int = 1
) -> WeightSpec:
    """A projection into heads (q/k/v): HF [heads * head_dim, in] -> native [in, heads * repeat, head_dim]."""
    return WeightSpec(
        hf_name, (heads * head_dim, d_in), spec, view=(heads, head_dim, d_in), perm=(2, 0, 1), repeat=_repeat(1, repeat)
    )


def linear_from_heads(hf_name: str, heads: int, head_dim: int, d_out: int, spec: P) -> WeightSpec:
    """A projection out of heads (o_proj): HF [out, heads * head_dim] -> native [heads, head_dim, out]."""
    return WeightSpec(hf_name, (d_out, heads * head_dim), spec, view=(d_out, heads, head_dim), perm=(1, 2, 0))


def head_bias(hf_name: str, heads: int, head_dim: int, spec: P, repeat: int = 1) -> WeightSpec:
    """A q/k/v bias: HF [heads * head_dim] -> native [heads * repeat, head_dim]."""
    return WeightSpec(hf_name, (heads * head_dim,), spec, view=(heads, head_dim), repeat=_repeat(0, repeat))
