"""Native JAX model definitions.

Each model module ends with an `ENTRY = ModelEntry(...)` declaring the Hugging Face
architectures it serves (as sglang-jax's `EntryClass`); `registry.native` builds its
table from these declarations, so a new model is one new file here. The entry names the
module's three functions:

    config_from_hf(hf_config) -> args      # frozen dataclass, hashable; has num_layers,
                                           # num_heads, num_kv_heads, head_dim, kv_repeat
    weight_table(args) -> pytree of models_jax.weights.WeightSpec (same structure as params)
    forward(params, kv_cache, batch, *, args) -> (logits [S, vocab] float32, kv_cache)

and, optionally, the same step in three stages (runtime.ops.step.LayerStages), which the
runtime calls one decoder layer at a time; `forward` should be their composition:

    prologue(params, batch, *, args) -> carry                    # params without "layers"
    layer(layer_params, carry, kv_cache, i, batch, *, args) -> (carry, kv_cache)
    epilogue(params, carry, batch, *, args) -> logits

`kv_repeat` (default 1) is set by registry.native from the mesh: with a model axis of
size tp, each KV head is stored kv_repeat = tp // gcd(num_kv_heads, tp) times (in the k/v
weights and so in the KV cache), so the cache always splits evenly on its head axis.
Query head h then reads stored KV head h // (num_heads // (num_kv_heads * kv_repeat)),
which is a copy of its original KV head h // (num_heads // num_kv_heads). This is vLLM's
KV-head replication: without it, a cache with fewer KV heads than devices would be
replicated whole on every device (and XLA re-gathers it each step).

models_jax imports runtime (the step contract, attention, the sharding rules), never registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """What a native model module serves and how (see the module docstring for the signatures).

    Attributes:
        architectures: Hugging Face `config.architectures` names, e.g. "LlamaForCausalLM".
        config_from_hf: HF config -> static args; raises ValueError on features it lacks.
        weight_table: args -> pytree of WeightSpec.
        forward: the step function, (params, kv_cache, batch, *, args) -> (logits, kv_cache).
        stages: (prologue, layer, epilogue), the step split at its decoder layers, whose
            stacked weights are params["layers"] (or see layer_stacks); None if the model does
            not offer it.
        lora_targets: args -> {PEFT module name: runtime.ops.lora.LoRATarget}, the projections
            LoRA adapters may adapt; the layer then reads the adapter slots from
            layer_params["lora"] (see runtime/ops/lora.py). None: no LoRA for this model.
        fuse_layer: one layer's weights -> the same weights in a joined form the layer stage
            also takes (several projections of one input as one matrix); the runtime applies
            it where a layer's weights are whole on every device. None: used as loaded.
        pack_layer: one layer's weights (after fuse_layer) -> the same with its matrices as
            runtime.ops.matmul.PackedWeight where they can be (the layer stage reads either
            form); the runtime applies it where it runs its CPU kernels. None: never packed.
        pack_head: the params without their layers -> the same with the LM head packed
            likewise (prologue and epilogue read either form). None: never packed.
        layer_stacks: args -> ((params key, layer count), ...), where a model's layers lie in
            more than one stack of weights (runtime.ops.step.LayerStages.stacks); None: all in
            params["layers"].
        kv_spec: (args, dtype) -> runtime.ops.step.KVCacheSpec, what one block of the paged
            cache holds where that is not K and V per KV head (multi-head latent attention keeps
            one latent per token; Gemma 4 one head shape for layers that differ). None: K and V of
            num_kv_heads * kv_repeat heads of head_dim, kv_repeat set from the mesh. A spec of its
            own with one KV head (a latent) is whole on every device; with several, registry.native
            sets args.kv_repeat from the mesh and asks again, so its heads split over the mesh.
        hidden: (params, carry, batch, *, args) -> the final normed hidden states [T, D] of the
            step's tokens (runtime.ops.step.LayerStages.hidden), what pooling reads (embeddings,
            scores); None: the model serves no pooling requests.
        window_blocks: its sliding-window layers keep only their window's blocks (the KV cache
            in groups, runtime.ops.step.KVCacheGroups; args.sliding_windows per layer). False:
            every layer keeps every block of a sequence.
    """

    architectures: tuple[str, ...]
    config_from_hf: Callable[[Any], Any]
    weight_table: Callable[[Any], Any]
    forward: Callable[..., Any]
    stages: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None = None
    lora_targets: Callable[[Any], dict[str, Any]] | None = None
    fuse_layer: Callable[[dict], dict] | None = None
    pack_layer: Callable[[dict], dict] | None = None
    pack_head: Callable[..., dict] | None = None
    kv_spec: Callable[[Any, Any], Any] | None = None
    window_blocks: bool = False
    layer_stacks: Callable[[Any], tuple[tuple[str, int], ...]] | None = None
    hidden: Callable[..., Any] | None = None
