"""The Llama family in plain JAX: Llama 2/3, Mistral, Qwen2 and Qwen3.

The families differ only by flags read from the Hugging Face config: q/k/v biases
(Qwen2), per-head q/k RMSNorm and an explicit head_dim (Qwen3), a sliding window
(Mistral, or per layer via `layer_types`), the rotary scaling variant (Llama 3).

    forward(params, kv_cache, batch, *, args) -> (logits [S, vocab] float32, kv_cache)

is the servax step contract: a flat ragged token axis T, attention through the runtime's
paged attention, and only the rows at `batch.logits_indices` go through the final norm
and the LM head.

The decoder layers run under `jax.lax.scan` over their stacked weights ([num_layers, ...]),
so XLA compiles one layer whatever the depth; the stacked KV cache rides in the scan's
carry and each layer updates its own slice in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models_jax import ModelEntry, layers
from models_jax.weights import (
    embedding, head_bias, join_outputs, joined_projections, linear, linear_from_heads, linear_to_heads, stacked, vector,
    zeros,
)
from runtime.ops.attention import (NO_SLIDING_WINDOW, paged_attention, rotated_attention_takes,
                                   rotated_paged_attention)
from runtime.ops.layer_fusions import mlp_block, mlp_block_fusable, norm_matmul, norm_matmul_fusable
from runtime.ops.matmul import PackedWeight, pack_matrix
from runtime.ops.quantization import transpose_matrix
from runtime.ops.lora import LoRATarget
from runtime.ops.step import KVCache, StepInput


@dataclasses.dataclass(frozen=True)
class LlamaArgs:
    """Static hyperparameters of one model (hashable: it is closed over by the jitted step)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: layers.RopeConfig
    sliding_windows: tuple[int | None, ...]  # per layer
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02  # std of random weights (init_params), as transformers draws them
    kv_repeat: int = 1  # each KV head stored this many times (set by registry.native for the mesh)

    @classmethod
    def from_hf(cls, cfg: Any) -> "LlamaArgs":
        """Raises ValueError on config features these models do not implement."""
        arch = (cfg.architectures or ["LlamaForCausalLM"])[0]
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_layers = cfg.num_hidden_layers
        window = getattr(cfg, "sliding_window", None)
        if arch.startswith("Qwen") and not getattr(cfg, "use_sliding_window", False):
            window = None
        layer_types = getattr(cfg, "layer_types", None)
        layer_types = layer_types or ["sliding_attention" if window else "full_attention"] * num_layers
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=num_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope=layers.RopeConfig.from_hf(cfg, head_dim),
            sliding_windows=windows,
            qkv_bias=is_qwen2 or bool(getattr(cfg, "attention_bias", False)),
            o_bias=not is_qwen2 and bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            initializer_range=float(getattr(cfg, "initializer_range", 0.02)),
        )


def weight_table(a: LlamaArgs, layer: dict | None = None) -> dict:
    """The params tree as WeightSpecs: HF source, shapes, logical axes and initializers.

    layer: one decoder layer's table (hf_names with `{layer}`), default `layer_table(a)`.

    Under runtime.ops.mesh's rules this is Megatron-style: q/k/v and gate/up are split by
    output (heads, features), o_proj and down_proj by input, the embedding and the LM head
    by vocab; norms are whole. k/v (and their biases) hold each KV head `a.kv_repeat`
    times, so that the KV heads split evenly even when the model axis is larger than
    num_kv_heads.
    """
    d = a.hidden_size
    normal = jax.nn.initializers.normal(a.initializer_range)
    table = {
        "embed": embedding("model.embed_tokens.weight", a.vocab_size, d, normal),
        "layers": stacked(layer or layer_table(a), a.num_layers),  # each weight [num_layers, ...]
        "final_norm": vector("model.norm.weight", d, ("embed",)),
    }
    if not a.tie_word_embeddings:
        table["lm_head"] = linear("lm_head.weight", d, a.vocab_size, ("embed", "vocab"), normal)
    return table


def layer_table(a: LlamaArgs) -> dict:
    """One decoder layer's WeightSpecs (hf_names with `{layer}`, which `stacked` fills in)."""
    d, f, hd = a.hidden_size, a.intermediate_size, a.head_dim
    normal = jax.nn.initializers.normal(a.initializer_range)
    pre = "model.layers.{layer}."
    attn, mlp = pre + "self_attn.", pre + "mlp."
    w = {
        "input_norm": vector(pre + "input_layernorm.weight", d, ("embed",)),
        "q": linear_to_heads(attn + "q_proj.weight", d, a.num_heads, hd, "q_heads", normal),
        "k": linear_to_heads(attn + "k_proj.weight", d, a.num_kv_heads, hd, "kv_heads", normal, a.kv_repeat),
        "v": linear_to_heads(attn + "v_proj.weight", d, a.num_kv_heads, hd, "kv_heads", normal, a.kv_repeat),
        "o": linear_from_heads(attn + "o_proj.weight", a.num_heads, hd, d, normal),
        "post_attn_norm": vector(pre + "post_attention_layernorm.weight", d, ("embed",)),
        "mlp": {
            "gate": linear(mlp + "gate_proj.weight", d, f, ("embed", "mlp"), normal),
            "up": linear(mlp + "up_proj.weight", d, f, ("embed", "mlp"), normal),
            "down": linear(mlp + "down_proj.weight", f, d, ("mlp", "embed"), normal),
        },
    }
    if a.qkv_bias:
        for name, heads, axis, repeat in (
            ("q", a.num_heads, "q_heads", 1),
            ("k", a.num_kv_heads, "kv_heads", a.kv_repeat),
            ("v", a.num_kv_heads, "kv_heads", a.kv_repeat),
        ):
            w[name + "_bias"] = head_bias(attn + f"{name}_proj.bias", heads, hd, axis, repeat)
    if a.o_bias:
        w["o_bias"] = vector(attn + "o_proj.bias", d, ("embed",), zeros)
    if a.qk_norm:
        w["q_norm"] = vector(attn + "q_norm.weight", hd, ("head_dim",))
        w["k_norm"] = vector(attn + "k_norm.weight", hd, ("head_dim",))
    if a.mlp_bias:
        w["mlp"]["gate_bias"] = vector(mlp + "gate_proj.bias", f, ("mlp",), zeros)
        w["mlp"]["up_bias"] = vector(mlp + "up_proj.bias", f, ("mlp",), zeros)
        w["mlp"]["down_bias"] = vector(mlp + "down_proj.bias", d, ("embed",), zeros)
    return w


def attention_block(
    x: jax.Array,  # [T, D]
    p: dict,  # one layer's weights
    kv_cache: KVCache,
    i: jax.Array,  # [] int32, the layer index
    batch: StepInput,
    cos: jax.Array,  # [T, hd]
    sin: jax.Array,  # [T, hd]
    a: LlamaArgs,
    window: int | jax.Array | None,
    project: bool = True,
    norm: jax.Array | None = None,  # x not yet normed: this RMSNorm and qkv in one kernel call (`_fusions`)
) -> tuple[jax.Array, KVCache]:  # [T, D] ([T, heads, hd] before o where not `project`), the cache, layer i written
    lora = _lora(p, batch)
    with jax.named_scope("qkv"):
        kv_heads = a.num_kv_heads * a.kv_repeat
        plain = lora is None and not a.qk_norm and p.get("sinks") is None  # nothing between q/k/v and attention
        y = _side_by_side(x, p, norm, batch, a, plain and rotated_attention_takes(kv_cache, x, cos, a.num_heads,
                                                                                  a.head_dim, joined=False))
        if y is not None and plain and rotated_attention_takes(kv_cache, y, cos, a.num_heads, a.head_dim):
            with jax.named_scope("paged_attention"):  # rotation, cache writes and attention in one kernel call
                out, kv_cache = rotated_paged_attention(y if "qkv_bias" not in p else y + p["qkv_bias"], cos, sin,
                                                        kv_cache, batch, layer=i, num_heads=a.num_heads,
                                                        scale=a.head_dim**-0.5, sliding_window=window)
            return _project_out(out, p, lora, batch, project), kv_cache
        if y is not None:
            q, k, v = layers.split_joined_heads(y, p.get("qkv_bias"), (a.num_heads, kv_heads, kv_heads), a.head_dim)
        else:
            q, k, v = (layers.project_to_heads(x, p[name], p.get(name + "_bias"), batch.num_tokens, a.head_dim)
                       for name in ("q", "k", "v"))  # [T, H, hd], [T, KV, hd] twice
        if lora is not None:
            q, k, v = (layers.add_delta(y, lora(name, x)) for y, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
        if a.qk_norm:
            q = layers.rms_norm(q, p["q_norm"], a.rms_norm_eps)
            k = layers.rms_norm(k, p["k_norm"], a.rms_norm_eps)
        q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    with jax.named_scope("paged_attention"):
        out, kv_cache = paged_attention(  # "sinks": gpt-oss's per-head sink logits (models_jax/gpt_oss.py)
            q, k, v, kv_cache, batch, layer=i, scale=a.head_dim**-0.5, sliding_window=window, sinks=p.get("sinks"),
        )
    return _project_out(out, p, lora, batch, project), kv_cache


def _side_by_side(x: jax.Array, p: dict, norm: jax.Array | None, batch: StepInput, a: LlamaArgs,
                  for_one_call: bool) -> jax.Array | None:
    """q, k and v's products side by side [T, (H + 2 KV) hd]: where the weights are joined (with `norm`,
    that RMSNorm first, in one kernel call), or, `for_one_call` (the one-call attention takes the
    layer), apart but packed (fuse_layer leaves a GGUF file's Q6_K v beside Q4_K q and k); else None."""
    if norm is not None:
        return norm_matmul(x, norm, a.rms_norm_eps, p["qkv"], batch.num_tokens)
    if "qkv" in p:  # joined by fuse_layer
        return layers.matmul(x, p["qkv"], batch.num_tokens)
    if for_one_call and all(isinstance(p.get(n), PackedWeight) and n + "_bias" not in p for n in "qkv"):
        return jnp.concatenate([layers.matmul(x, p[n], batch.num_tokens) for n in "qkv"], axis=-1)
    return None


def _project_out(out: jax.Array, p: dict, lora, batch: StepInput, project: bool) -> jax.Array:
    """The attention's output through o (as it is where not `project`)."""
    if not project:
        return out
    with jax.named_scope("o"):
        y = layers.project_from_heads(out, p["o"], p.get("o_bias"), batch.num_tokens)
        return y if lora is None else layers.add_delta(y, lora("o_proj", out.reshape(out.shape[0], -1)))


def _lora(p: dict, batch: StepInput):
    """The layer's LoRA delta function, or None (no adapter slots, or a batch without slots)."""
    return None if "lora" not in p or batch.lora_slots is None else layers.lora_delta(p["lora"], batch.lora_slots)


def layer(
    x: jax.Array,  # [T, D]
    p: dict,  # one layer's weights
    kv_cache: KVCache,
    i: jax.Array,  # [] int32, the layer index
    batch: StepInput,
    cos: jax.Array,
    sin: jax.Array,
    a: LlamaArgs,
    window: int | jax.Array | None,
) -> tuple[jax.Array, KVCache]:  # [T, D], the cache with layer i written
    """One pre-norm decoder layer: x + attention(norm(x)), then + mlp(norm(x))."""
    fused_qkv, fused_block = _fusions(x, p, batch)
    h = x if fused_qkv else layers.rms_norm(x, p["input_norm"], a.rms_norm_eps)
    norm = p["input_norm"] if fused_qkv else None
    if fused_block:  # o to the layer's end in one kernel call (runtime/ops/layer_fusions.py)
        out, kv_cache = attention_block(h, p, kv_cache, i, batch, cos, sin, a, window, project=False, norm=norm)
        mlp = p["mlp"]
        with jax.named_scope("o_mlp"):
            return mlp_block(out.reshape(out.shape[0], -1), x, p["o"], p["post_attn_norm"], a.rms_norm_eps,
                             mlp["gate_up"], mlp["down"], batch.num_tokens), kv_cache
    h, kv_cache = attention_block(h, p, kv_cache, i, batch, cos, sin, a, window, norm=norm)
    x = x + h
    with jax.named_scope("mlp"):
        x = x + layers.gated_mlp(layers.rms_norm(x, p["post_attn_norm"], a.rms_norm_eps), p["mlp"], _lora(p, batch),
                                 batch.num_tokens)
    return x, kv_cache


FUSED_MAX_TOKENS = 16  # the largest step (padded tokens) that runs `_fusions`


def _fusions(x: jax.Array, p: dict, batch: StepInput) -> tuple[bool, bool]:
    """Which of the layer's ops run fused into the packed products' kernels (runtime/ops/layer_fusions.py):
    (the input norm with the joined qkv projection: norm_matmul; o to the layer's end: mlp_block).
    Each needs its matrices packed for int8 activations, or taking float ones (float32 panels in a
    one-token step only; see runtime.ops.layer_fusions._fused_kernel_takes); neither runs with LoRA, the
    block not with biases. Only for steps of at most FUSED_MAX_TOKENS tokens (decodes): with more
    rows XLA's own programs share the small ops over the cores, which the kernel's calling thread
    runs alone (benchmarks/RESULTS.md, stop 55)."""
    if _lora(p, batch) is not None or x.shape[0] > FUSED_MAX_TOKENS:
        return False, False
    mlp = p.get("mlp", {})
    norm_qkv = "qkv" in p and norm_matmul_fusable(x, p["qkv"])
    biased = "o_bias" in p or any(k in mlp for k in ("gate_up_bias", "down_bias"))
    return norm_qkv, not biased and "gate_up" in mlp and mlp_block_fusable(x, p["o"], mlp["gate_up"], mlp["down"])


def fuse_layer(p: dict) -> dict:
    """One layer's weights with the projections that read the same input joined into one
    matrix: "qkv" [D, (H + 2 KV) * hd] for q/k/v and mlp "gate_up" [D, 2 F] for gate/up,
    their biases likewise (`layer` takes either form).

    Why: on XLA:CPU a matmul of a few rows costs about as much for a narrow weight as for a
    wide one, so two matmuls of [D, F] cost nearly twice one of [D, 2F]. The runtime joins
    them only where the weights are whole on every device (runtime/ops/layered.py): a
    column-parallel split of a joined matrix would not fall on head and feature boundaries.
    A group that cannot be joined (quantized unlike its siblings) stays as it was, as do q, k and v
    of GGUF kinds that would have to be requantized to be one (a Q4_K_M file's Q6_K attn_v beside
    Q4_K q and k: three products, each of its kind, read fewer bytes than one of int8 blocks).
    """
    p = joined_projections(p, ("q", "k", "v"), "qkv", requantize=False)
    return {**p, "mlp": joined_projections(p["mlp"], ("gate", "up"), "gate_up")}


def layer_windows(a: LlamaArgs) -> tuple[int | None, jax.Array | None]:
    """The sliding window of the layers: (static window, None) when all layers share one
    (None: no window), else (None, per-layer windows [num_layers] int32, indexed by the
    layer; NO_SLIDING_WINDOW where a layer has none)."""
    if len(set(a.sliding_windows)) == 1:
        return a.sliding_windows[0], None
    return None, jnp.asarray([w or NO_SLIDING_WINDOW for w in a.sliding_windows], jnp.int32)


# The step in three stages (runtime.ops.step.LayerStages): what runs before the decoder layers,
# one decoder layer (any of them: the layer index is an argument), and what runs after.
# `forward` composes them under a scan; the runtime may instead call the layer stage once
# per layer (see runtime.ops.step.LayerStages for why).

def prologue(params: dict, batch: StepInput, *, args: LlamaArgs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Embeddings and rotary tables: the carry (x [T, D], cos [T, hd], sin [T, hd])."""
    with jax.named_scope("embed"):
        embed = params["embed"]
        if isinstance(embed, PackedWeight):  # a tied table packed as the LM head (pack_head)
            x = embed.columns(batch.input_ids)  # [T, D]
        else:
            x = embed[batch.input_ids]  # [T, D]
    with jax.named_scope("rope"):
        cos, sin = layers.rope_cos_sin(args.rope, batch.positions, token_seq_lens(batch))  # [T, hd]
    return x, cos, sin


def token_seq_lens(batch: StepInput) -> jax.Array:
    """The context length of each token's sequence: [T] int32 (padding tokens read the last
    sequence slot's), which dynamic NTK rotary tables grow with."""
    tok = jnp.arange(batch.input_ids.shape[0])
    seq = jnp.searchsorted(batch.query_start_loc[1:], tok, side="right")
    seq = jnp.minimum(seq, batch.seq_lens.shape[0] - 1)  # [T]
    return batch.seq_lens[seq]


def decoder_layer(
    p: dict, carry: tuple, kv_cache: KVCache, i: jax.Array, batch: StepInput, *, args: LlamaArgs,
) -> tuple[tuple, KVCache]:
    """Decoder layer `i` (a traced int32) with its weights `p`: (carry, kv_cache) updated."""
    x, cos, sin = carry
    window, windows = layer_windows(args)
    x, kv_cache = layer(x, p, kv_cache, i, batch, cos, sin, args, window if windows is None else windows[i])
    return (x, cos, sin), kv_cache


def epilogue(params: dict, carry: tuple, batch: StepInput, *, args: LlamaArgs) -> jax.Array:
    """Final norm and LM head on the rows at `batch.logits_indices`: logits [S, vocab] float32."""
    x = carry[0]
    with jax.named_scope("lm_head"):
        x = layers.rms_norm(x[batch.logits_indices], params["final_norm"], args.rms_norm_eps)  # [S, D]
        return lm_head(params, x, batch, tied=args.tie_word_embeddings)


def final_hidden(params: dict, carry: tuple, batch: StepInput, *, args: LlamaArgs) -> jax.Array:
    """The final norm on every token: hidden states [T, D], what transformers' base model
    (Qwen3Model, LlamaModel) returns as last_hidden_state and pooling reads (runtime/ops/pooling.py)."""
    with jax.named_scope("final_norm"):
        return layers.rms_norm(carry[0], params["final_norm"], args.rms_norm_eps)


def lm_head(params: dict, x: jax.Array, batch: StepInput, *, tied: bool) -> jax.Array:
    """x [S, D] (normed) through the LM head: "lm_head" [D, vocab], or with `tied` the embedding
    [vocab, D] (either possibly packed by pack_head) -> logits [S, vocab] float32."""
    head = params["embed"] if tied else params["lm_head"]
    if isinstance(head, PackedWeight):  # pack_head; rows past the real sequences get zeros
        return head.matmul(x, batch.num_seqs, jnp.float32)
    if tied:
        return jnp.einsum("sd,vd->sv", x, head, preferred_element_type=jnp.float32)
    return jnp.einsum("sd,dv->sv", x, head, preferred_element_type=jnp.float32)


def pack_layer(p: dict) -> dict:
    """One layer's projections (qkv, or q, k and v where fuse_layer left them apart; o, gate_up,
    down) as runtime.ops.matmul.PackedWeight for the CPU matmul kernels where those take them
    (float32, bfloat16, int8 and 4- to 6-bit QuantizedWeights, kept in their format); the layer's
    two RMSNorm weights in float32, as the fused kernels take them (`_fusions`; converted once here,
    not in every step: the same values either way); the rest (biases, LoRA slots, gate and up
    where not joined) as it is."""
    out = {**p, **{name: p[name].astype(jnp.float32) for name in ("input_norm", "post_attn_norm") if name in p}}
    if "qkv" in p:
        out["qkv"] = pack_matrix(p["qkv"])
    elif "q" in p:  # not joined (fuse_layer): each [D, heads, hd] as [D, heads * hd]
        out.update({name: pack_matrix(join_outputs([p[name]])) for name in ("q", "k", "v")})
    out["o"] = pack_matrix(p["o"], inputs=2)  # [H, hd, D] -> [H * hd, D]
    mlp = dict(p["mlp"])
    if "gate_up" in mlp:
        mlp["gate_up"] = pack_matrix(mlp["gate_up"])
        mlp["down"] = pack_matrix(mlp["down"])
    out["mlp"] = mlp
    return out


def pack_head(params: dict, *, args: LlamaArgs) -> dict:
    """The params without their layers, with the LM head as runtime.ops.matmul.PackedWeight
    where the kernels take it: "lm_head", or a tied model's "embed", packed as the head it is
    ([D, vocab]; the prologue then gathers the embeddings from its columns)."""
    out = dict(params)
    if not args.tie_word_embeddings:
        out["lm_head"] = pack_matrix(params["lm_head"])
    else:
        out["embed"] = pack_matrix(transpose_matrix(params["embed"]))
    return out


def forward(params: dict, kv_cache: KVCache, batch: StepInput, *, args: Any,
            layer_fn: Any = None, prologue_fn: Any = None, epilogue_fn: Any = None) -> tuple[jax.Array, KVCache]:
    """One serving step. Returns (logits [S, vocab] float32, the updated kv_cache).

    layer_fn: the decoder layer stage (default this module's `decoder_layer`); the models built
    on this decoder pass theirs (functools.partial) and share the prologue, scan and epilogue.
    prologue_fn, epilogue_fn: the other two stages, for models that differ there too (default
    this module's `prologue` and `epilogue`)."""
    layer_fn, prologue_fn, epilogue_fn = layer_fn or decoder_layer, prologue_fn or prologue, epilogue_fn or epilogue
    carry = prologue_fn(params, batch, args=args)

    def one_layer(state, per_layer):
        carry, kv_cache = state
        p, i = per_layer
        return layer_fn(p, carry, kv_cache, i, batch, args=args), None

    with jax.named_scope("layers"):
        per_layer = (params["layers"], jnp.arange(args.num_layers, dtype=jnp.int32))
        (carry, kv_cache), _ = jax.lax.scan(one_layer, (carry, kv_cache), per_layer)
    return epilogue_fn(params, carry, batch, args=args), kv_cache


def lora_targets(a: LlamaArgs) -> dict[str, LoRATarget]:
    """The projections LoRA adapters may adapt, by PEFT module name (attention and MLP)."""
    d, f, hd = a.hidden_size, a.intermediate_size, a.head_dim
    q_out, kv_out = a.num_heads * hd, a.num_kv_heads * hd
    return {
        "q_proj": LoRATarget(d, q_out, "embed", "q_heads", hd),
        "k_proj": LoRATarget(d, kv_out, "embed", "kv_heads", hd, a.kv_repeat),
        "v_proj": LoRATarget(d, kv_out, "embed", "kv_heads", hd, a.kv_repeat),
        "o_proj": LoRATarget(q_out, d, "q_heads", "embed"),
        "gate_proj": LoRATarget(d, f, "embed", "mlp"),
        "up_proj": LoRATarget(d, f, "embed", "mlp"),
        "down_proj": LoRATarget(f, d, "mlp", "embed"),
    }


# The Hugging Face architectures this module serves (registry.native builds its table from these).
ENTRY = ModelEntry(
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    config_from_hf=LlamaArgs.from_hf,
    weight_table=weight_table,
    forward=forward,
    stages=(prologue, decoder_layer, epilogue),
    lora_targets=lora_targets,
    fuse_layer=fuse_layer,
    pack_layer=pack_layer,
    pack_head=pack_head,
    hidden=final_hidden,
)
