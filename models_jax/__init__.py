"""Native JAX model definitions.

Each model module exposes the same small interface, which `registry.native` relies on:

    config_from_hf(hf_config) -> args      # frozen, hashable; has num_layers, num_heads,
                                           # num_kv_heads, head_dim
    weight_table(args) -> pytree of models_jax.weights.WeightSpec (same structure as params)
    forward(params, kv_cache, batch, *, args) -> (logits [S, vocab] float32, kv_cache)
"""
