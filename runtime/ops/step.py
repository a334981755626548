"""The step contract: the one seam where both model paths meet the runtime.

Every model servax serves, native JAX or torchax-wrapped transformers, is reduced to

    step_fn(params, kv_cache, batch: StepInput) -> (logits[S, vocab], kv_cache)

a pure function: weights and the paged KV cache go in as arguments and come back out,
nothing hides in module state. The runtime owns everything around it (scheduling,
the block pool, sampling, sharding, compilation).

KV cache groups (vLLM v1's): where a model's layers have different sliding windows
(`KVCacheSpec.sliding_windows`, e.g. Gemma 2/3's sliding and global layers), the layers form
groups (`KVCacheGroups`), each with its own block table: a sliding group's table covers only
its window (the KV cache manager frees the blocks before it; the table reads the null block
there). The stacked cache then has a row per layer of a group, not per layer, and the step
input carries every group's block tables and slots (`StepInput.group_block_tables`,
`group_slot_mapping`); `paged_attention` reads a layer's row through its group's tables, so
models see no difference. A model with one group (no windows, or one window for every layer)
gets no group arrays: its programs are what they were.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from runtime.ops.mesh import logical_to_spec

PyTree = Any
# The logical axes of one cache array (runtime.ops.mesh.SHARDING_RULES maps them to mesh axes).
# Heads before block offsets: a gathered block is [kv_heads, block_size, head_dim], each head's
# keys contiguous, which is the operand layout attention's batched dots want (no transpose copy).
KV_CACHE_AXES = ("layers", "kv_blocks", "kv_heads", "kv_block_tokens", "head_dim")


# Caches of 16-bit floats (kv_cache_dtype bfloat16 / float16, or a half-precision model's).
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@flax.struct.dataclass
class KVCache:
    """The paged KV cache of every layer: one stacked K and one stacked V array.

    Stacked over layers so that a forward pass scanning its layers carries the whole cache
    through the scan and updates layer i in place (a scatter into the loop's carry); the
    torchax path indexes it with each layer's static index. Donated into every step.
    """

    k: jax.Array  # [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
    v: jax.Array  # the same; empty, [num_layers, 0, kv_heads, block_size, 0], where values are in the keys
    # Which attention implementation reads and writes this cache ("xla" or "pallas", see
    # runtime.ops.attention.paged_attention): chosen once, when the cache is allocated, and
    # carried as static metadata so that a model's step function needs no setting of its own.
    attention_backend: str = flax.struct.field(pytree_node=False, default="xla")
    # The mesh the cache is sharded over and the PartitionSpec of k and v on it (None: one
    # device): what a kernel that runs per shard (under shard_map) needs to know.
    mesh: Any = flax.struct.field(pytree_node=False, default=None)
    partition_spec: Any = flax.struct.field(pytree_node=False, default=None)
    # A quantized cache (kv_cache_dtype int8 / fp8): k and v hold the quantized values and these
    # one float32 scale per token and head, [num_layers, num_blocks, num_kv_heads, block_size]
    # (value = stored * scale). None: k and v hold the values themselves.
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    # The 16-bit float ("bfloat16" / "float16") whose bits k and v hold as uint16, or None: they
    # hold their values as they are. XLA:CPU updates and gathers a 16-bit float array by widening
    # all of it to float32 and back (its float normalization), but moves 16-bit integers in place,
    # so a half-precision cache on CPU is kept as its bits (allocate_kv_cache).
    half_bits: str | None = flax.struct.field(pytree_node=False, default=None)
    # How layers map to rows and block tables where the model has several KV cache groups
    # (KVCacheGroups); None: one group, row i is layer i.
    groups: Any = flax.struct.field(pytree_node=False, default=None)
    # How multi-head latent attention attends the tokens after a step's decodes (a cache of
    # latents, KVCacheSpec.value_dims): "absorbed", "expanded", or "auto" (the cheaper form,
    # chosen per step from its shape; see models_jax/deepseek.py). Decodes are always absorbed.
    mla_prefill: str = flax.struct.field(pytree_node=False, default="absorbed")

    @property
    def num_layers(self) -> int:
        """Rows of the stacked arrays: the layers (with KV cache groups, the layers of one group)."""
        return self.k.shape[0]



@flax.struct.dataclass
class StepInput:
    """One ragged, padded batch: T token slots for S sequence slots.

    Tokens of sequence i are input_ids[query_start_loc[i]:query_start_loc[i+1]]: a whole
    prompt, a chunk of one (chunked prefill, starting mid-sequence) or one decode token.
    T and S are padded up to precompiled buckets. Padding tokens carry an out-of-range
    slot (so their K/V is written nowhere) and padding sequences have seq_lens == 0;
    their outputs are ignored by the caller.
    """

    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32, flat cache slot (block * block_size + offset) for the new K/V
    block_tables: jax.Array  # [S, max_blocks_per_seq] int32, physical block ids per sequence
    seq_lens: jax.Array  # [S] int32, context length after this step (cached + new tokens)
    query_start_loc: jax.Array  # [S + 1] int32, offsets of each sequence's tokens in the T axis
    logits_indices: jax.Array  # [S] int32, the token whose logits each sequence needs
    num_seqs: jax.Array  # [] int32, real sequences (<= S)
    num_tokens: jax.Array  # [] int32, real tokens (<= T)
    # [T] int32, each token's LoRA adapter slot (0: none); None when the engine serves no adapters.
    lora_slots: jax.Array | None = None
    # Several KV cache groups (KVCacheGroups): every group's block tables and new-K/V slots
    # (block_tables and slot_mapping above are group 0's); None with one group.
    group_block_tables: jax.Array | None = None  # [S, G, max_blocks_per_seq] int32
    group_slot_mapping: jax.Array | None = None  # [G, T] int32

    def of_group(self, group: int | jax.Array) -> "StepInput":
        """The batch as KV cache group `group` (an int or a traced int32) reads it: that group's
        block tables and slots in block_tables and slot_mapping."""
        return self.replace(block_tables=self.group_block_tables[:, group],
                            slot_mapping=self.group_slot_mapping[group])

    @property
    def padded_num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def padded_num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    """How a model's layers share the paged cache when their sliding windows differ (vLLM v1's
    KV cache groups).

    Layers of one window (None: full attention) are split into groups of `num_rows` layers,
    `num_rows` being the layer count of the rarest window (Gemma 3's 5 sliding layers per
    global one: a group of the global layers and five of sliding layers). Every group has its
    own block table and a block belongs to one group at a time; the stacked cache arrays have
    `num_rows` rows, and block b of row r holds layer r of the group that owns b. A sliding
    group keeps only the blocks of its window, so a long sequence holds its global layers'
    context plus a window per sliding group, not every layer's context.
    """

    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: full attention)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_row: tuple[int, ...]  # per layer: its row of the stacked cache arrays
    num_rows: int

    @classmethod
    def of(cls, sliding_windows: tuple[int | None, ...]) -> "KVCacheGroups":
        """The groups of layers with these windows (full-attention groups first); one group of
        every layer where all windows are equal."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(sliding_windows):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        windows, group, row = [], [0] * len(sliding_windows), [0] * len(sliding_windows)
        for window in sorted(kinds, key=lambda w: -1 if w is None else w):
            for start in range(0, len(kinds[window]), size):
                for r, layer in enumerate(kinds[window][start:start + size]):
                    group[layer], row[layer] = len(windows), r
                windows.append(window)
        return cls(tuple(windows), tuple(group), tuple(row), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_per_seq(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """The most blocks, over all groups, one sequence of `num_tokens` tokens holds when its
        steps compute up to `step_tokens` tokens (a sliding group: the window before a step
        plus the step's own tokens)."""
        full = -(-num_tokens // block_size)
        return sum(full if w is None else min(full, -(-(w - 1 + step_tokens) // block_size) + 1)
                   for w in self.windows)

    def row_and_batch(self, layer: int | jax.Array, batch: StepInput) -> tuple[int | jax.Array, StepInput]:
        """Layer `layer`'s row of the stacked cache and the batch as its group reads it.

        Raises:
            ValueError: the batch has no group tables (it was built for one group)."""
        if batch.group_block_tables is None or batch.group_block_tables.shape[1] != self.num_groups:
            raise ValueError(f"this KV cache has {self.num_groups} groups: the step input needs "
                             f"group_block_tables [S, {self.num_groups}, max_blocks] and group_slot_mapping")
        if isinstance(layer, (int, np.integer)):
            return self.layer_row[layer], batch.of_group(self.layer_group[layer])
        rows, groups = jnp.asarray(self.layer_row, jnp.int32), jnp.asarray(self.layer_group, jnp.int32)
        return rows[layer], batch.of_group(groups[layer])


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What a model needs from the KV cache; the runtime sizes, allocates and shards it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # a jnp dtype: the model's (attention computes in it)
    # What the cache stores: None (dtype itself), or a quantized dtype (jnp.int8,
    # jnp.float8_e4m3fn) with a float32 scale per token and head (runtime.ops.step.KVCache).
    cache_dtype: Any = None
    # Multi-head latent attention (DeepSeek-V2/V3): each token's values are the first
    # `value_dims` dims of its key (the compressed latent; the rest is the rotary part), so a
    # block holds keys only and KVCache.v is empty. None: separate K and V of head_dim each.
    value_dims: int | None = None
    # Each layer's sliding window (None: full attention), or None where no layer has one;
    # layers with differing windows keep different blocks (KVCacheGroups).
    sliding_windows: tuple[int | None, ...] | None = None

    @property
    def groups(self) -> KVCacheGroups:
        return KVCacheGroups.of(self.sliding_windows or (None,) * self.num_layers)

    @property
    def quantized(self) -> bool:
        return self.cache_dtype is not None

    @property
    def values_in_keys(self) -> bool:
        return self.value_dims is not None

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes across all rows of the cache (the layers, or with KV cache
        groups the layers of one group), K and V (and their scales, quantized); keys only
        where the values are in the keys."""
        itemsize = np.dtype(self.cache_dtype if self.quantized else self.dtype).itemsize
        per_token_head = self.head_dim * itemsize + (4 if self.quantized else 0)
        arrays = 1 if self.values_in_keys else 2
        return arrays * self.groups.num_rows * block_size * self.num_kv_heads * per_token_head

    def partition_spec(self, mesh: jax.sharding.Mesh) -> jax.sharding.PartitionSpec:
        """The PartitionSpec of one stacked cache array (KVCache.k or .v) under `mesh`:
        KV_CACHE_AXES through the sharding rules (the KV heads split where they divide the
        mesh axis)."""
        shape = (self.num_layers, None, self.num_kv_heads, None, self.head_dim)  # blocks are counted later
        return logical_to_spec(KV_CACHE_AXES, shape, mesh)


@dataclasses.dataclass(frozen=True)
class LayerStages:
    """A model's step split at its decoder layers, so that a runtime can run each layer as
    its own call of one compiled layer program:

        carry = prologue(outer_params, batch)
        for i in range(num_layers):
            carry, kv_cache = layer(params[layers_key][i], carry, kv_cache, i, batch)
        logits = epilogue(outer_params, carry, batch)

    equals step_fn(params, kv_cache, batch) (outer_params: params without `layers_key`).
    A pooling engine (runner="pooling") swaps the epilogue for runtime.ops.pooling's, which
    also returns each sequence slot's pooled hidden state: its step returns (logits, pooled),
    kv_cache; a generating engine's programs are unchanged.
    Why: under a scan over stacked weights XLA:CPU copies each layer's weights out of the
    stack before its matmuls (a copy of every weight per step, ~60% of a batch-1 decode on
    the 30-layer demo model); separate per-layer arrays are read in place, and the layer
    program still compiles once whatever the depth (it runs a few layers per call, each
    from its first layer's index). See runtime/ops/layered.py.
    """

    prologue: Callable[..., Any]  # (outer_params, batch) -> carry
    layer: Callable[..., Any]  # (layer_params, carry, kv_cache, i: int32 [], batch) -> (carry, kv_cache)
    epilogue: Callable[..., Any]  # (outer_params, carry, batch) -> logits [S, vocab] float32
    num_layers: int  # every decoder layer, all stacks together
    layers_key: str = "layers"  # params[layers_key]: the layers' weights, stacked [num_layers, ...]
    # Layers whose weights differ in structure (DeepSeek: its first dense layers, then the MoE
    # ones) lie in more than one stack: runs of consecutive layers as (params key, layer count)
    # in layer order, each run the next layers of its stack (a key may recur where kinds of
    # layers interleave); each stack [its layers, ...]. `layer` (and fuse, pack_layer) take a
    # layer of any stack, i its index among all layers. Empty: one stack, params[layers_key].
    stacks: tuple[tuple[str, int], ...] = ()
    # One layer's weights -> a joined form `layer` also takes (e.g. q/k/v as one matrix),
    # applied by the runtime to per-layer weights that are whole on every device; None: none.
    # Weights in the joined form pass through unchanged.
    fuse: Callable[[Any], Any] | None = None
    # One layer's weights (joined) -> its matrices as runtime.ops.matmul.PackedWeight where
    # they can be, and the outer params -> their LM head likewise (the stages read either
    # form); applied by the runtime where it runs its CPU kernels. None: never packed.
    pack_layer: Callable[[Any], Any] | None = None
    pack_head: Callable[[dict], dict] | None = None
    # (outer_params, carry, batch) -> the final normed hidden states of the step's tokens [T, D]
    # (what the epilogue feeds its LM head): what pooling reads (runtime/ops/pooling.py, whose
    # epilogue returns (logits, pooled) in a pooling engine). None: the model does not pool.
    hidden: Callable[..., Any] | None = None

    @property
    def layer_runs(self) -> tuple[tuple[str, int], ...]:
        """(params key, layer count) of each run of consecutive layers, in layer order."""
        return self.stacks or ((self.layers_key, self.num_layers),)

    @property
    def stack_sizes(self) -> dict[str, int]:
        """{params key: layers in that stack}, in the order the stacks first appear."""
        sizes: dict[str, int] = {}
        for key, n in self.layer_runs:
            sizes[key] = sizes.get(key, 0) + n
        return sizes


@dataclasses.dataclass
class LoadedModel:
    """What `registry.load` returns, whatever the implementation path.

    Attributes:
        step_fn: the pure step function (not yet jitted; the runtime jits it).
        params: the weights as jax.Arrays, placed with `param_shardings` on the mesh.
        kv_spec: what the KV cache must look like.
        param_shardings: PartitionSpecs for params (same tree structure as params).
        kv_partition_spec: PartitionSpec for one [num_layers, num_blocks, kv_heads, block_size,
            head_dim] cache array under the mesh the params were placed on (kv_spec.partition_spec(mesh)).
        tokenizer: the checkpoint's Hugging Face tokenizer (None if it has none).
        hf_config: the transformers PretrainedConfig.
        impl: "jax" (native models_jax) or "torchax" (wrapped transformers model).
        model_id: the ID or path it was resolved from.
        max_model_len: the context length the model supports (max_position_embeddings).
        vocab_size: rows of the logits.
        eos_token_ids: the end-of-sequence ids (generation_config.json, else config.json).
        generation_config: sampling defaults from generation_config.json, under SamplingParams'
            names (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens).
        stages: the same step split at its decoder layers (native models), or None.
        lora_targets: {PEFT module name: runtime.ops.lora.LoRATarget} the model can adapt with
            LoRA (native models), or None (LoRA not supported on this path).
        read_lora_adapter: (LoRARequest, max_rank) -> runtime.ops.lora.LoRAAdapter, how this
            model's adapters are read from disk (registry/peft.py; None where lora_targets is).
    """

    step_fn: Callable[..., tuple[jax.Array, KVCache]]
    params: PyTree
    kv_spec: KVCacheSpec
    param_shardings: PyTree
    kv_partition_spec: Any
    tokenizer: Any
    hf_config: Any
    impl: str
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    stages: LayerStages | None = None
    lora_targets: dict[str, Any] | None = None
    read_lora_adapter: Callable[[Any, int], Any] | None = None


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, block_size: int, sharding: jax.sharding.Sharding | None = None,
    attention_backend: str = "xla", mla_prefill: str = "absorbed",
) -> KVCache:
    """Zero-filled paged KV cache: K and V, each [rows, num_blocks, kv_heads, block_size, head_dim]
    (rows: the layers, or with KV cache groups the layers of one group), for the given attention
    backend (both backends read this one layout) and latent attention's prefill form
    (KVCache.mla_prefill). Where the spec keeps the values in the keys, V
    (and its scales) has no blocks: [rows, 0, kv_heads, block_size, 0]. A bfloat16 / float16
    cache on CPU (but for the Pallas kernel's interpret mode) holds its values' bits as uint16
    (KVCache.half_bits)."""
    groups = spec.groups
    shape = (groups.num_rows, num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
    v_shape = (groups.num_rows, 0, spec.num_kv_heads, block_size, 0) if spec.values_in_keys else shape
    groups = groups if groups.num_groups > 1 else None
    mesh = partition_spec = None
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
        mesh, partition_spec = sharding.mesh, sharding.spec
    stored = jnp.dtype(spec.cache_dtype if spec.quantized else spec.dtype)
    half_bits = None
    platform = next(iter(sharding.device_set)).platform if sharding is not None else jax.default_backend()
    if stored in HALF and platform == "cpu" and attention_backend != "pallas":
        stored, half_bits = jnp.dtype(jnp.uint16), stored.name  # KVCache.half_bits: XLA:CPU moves it in place

    def zeros() -> KVCache:
        scale = (lambda s: jnp.ones(s[:-1], jnp.float32)) if spec.quantized else (lambda s: None)  # noqa: E731
        return KVCache(jnp.zeros(shape, stored), jnp.zeros(v_shape, stored), attention_backend=attention_backend,
                       mesh=mesh, partition_spec=partition_spec, k_scale=scale(shape), v_scale=scale(v_shape),
                       half_bits=half_bits, groups=groups, mla_prefill=mla_prefill)

    if sharding is None:
        return jax.jit(zeros)()
    scale_sharding = None
    if isinstance(sharding, jax.sharding.NamedSharding):  # the values' spec without head_dim
        entries = tuple(sharding.spec) + (None,) * (5 - len(tuple(sharding.spec)))
        scale_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*entries[:4]))
    shardings = jax.tree.map(lambda _: sharding, jax.eval_shape(zeros))
    if spec.quantized:
        shardings = dataclasses.replace(shardings, k_scale=scale_sharding or sharding, v_scale=scale_sharding or sharding)
    return jax.jit(zeros, out_shardings=shardings)()


def make_step_input(
    *,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    logits_indices: np.ndarray,
    num_seqs: int,
    num_tokens: int,
    lora_slots: np.ndarray | None = None,
    group_block_tables: np.ndarray | None = None,
    group_slot_mapping: np.ndarray | None = None,
) -> StepInput:
    """A StepInput from host arrays (int32).

    Raises:
        ValueError: the token arrays are not all [T], the sequence arrays not [S] / [S + 1], or
            the group arrays not [S, G, ...] / [G, T].
    """
    t, s = len(input_ids), len(seq_lens)
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"positions {positions.shape} and slot_mapping {slot_mapping.shape} must be [T={t}]")
    if block_tables.shape[0] != s or query_start_loc.shape != (s + 1,) or logits_indices.shape != (s,):
        raise ValueError(
            f"block_tables {block_tables.shape}, query_start_loc {query_start_loc.shape} and logits_indices "
            f"{logits_indices.shape} must be [S={s}, ...], [S + 1] and [S]"
        )
    if (group_block_tables is None) != (group_slot_mapping is None) or (group_block_tables is not None and (
            group_block_tables.shape[0] != s or group_slot_mapping.shape != (group_block_tables.shape[1], t))):
        raise ValueError(f"group_block_tables and group_slot_mapping must be [S={s}, G, ...] and [G, T={t}] "
                         "(or both None)")
    i32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
    return StepInput(
        input_ids=i32(input_ids),
        positions=i32(positions),
        slot_mapping=i32(slot_mapping),
        block_tables=i32(block_tables),
        seq_lens=i32(seq_lens),
        query_start_loc=i32(query_start_loc),
        logits_indices=i32(logits_indices),
        num_seqs=np.int32(num_seqs),
        num_tokens=np.int32(num_tokens),
        lora_slots=None if lora_slots is None else i32(lora_slots),
        group_block_tables=None if group_block_tables is None else i32(group_block_tables),
        group_slot_mapping=None if group_slot_mapping is None else i32(group_slot_mapping),
    )
