"""Pooling on the device: what a step returns for the rows of pooling requests.

A pooling engine (EngineConfig runner="pooling") steps its model with the epilogue that
`pooling_epilogue` builds: the model's own epilogue (logits for the rows that generate) plus
one pooled vector per sequence slot, read from the final normed hidden states
(`LayerStages.hidden`) of this step's tokens:

    LAST: the hidden state of the slot's last token this step   (logits_indices)
    CLS:  the hidden state of the slot's first token this step  (query_start_loc)
    MEAN: the sum of the hidden states of the slot's tokens     (the host divides)

A prompt prefilled in several chunks is pooled by the host from each chunk's row (the last
chunk's LAST, the first chunk's CLS, the sum of every chunk's MEAN). A classifier read from
the LM head (vLLM's `classifier_from_token`, the Qwen3-Reranker recipe) pools the logits of
its tokens at the LAST row instead: [S, K].
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from runtime.ops.step import StepInput

POOLING_TYPES = ("LAST", "MEAN", "CLS")


def pool_rows(hidden: jax.Array, batch: StepInput, pooling_type: str) -> jax.Array:
    """hidden [T, D] (final normed hidden states of this step's tokens) -> [S, D] float32,
    one row per sequence slot (see the module docstring); padding slots get garbage."""
    if pooling_type == "LAST":
        return hidden[batch.logits_indices].astype(jnp.float32)
    if pooling_type == "CLS":
        first = jnp.minimum(batch.query_start_loc[:-1], hidden.shape[0] - 1)
        return hidden[first].astype(jnp.float32)
    if pooling_type == "MEAN":
        tok = jnp.arange(hidden.shape[0])
        seq = jnp.searchsorted(batch.query_start_loc[1:], tok, side="right")  # [T]; padding tokens: past S
        return jax.ops.segment_sum(hidden.astype(jnp.float32), seq, num_segments=batch.seq_lens.shape[0])
    raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")


def _pooled_epilogue(outer: dict, carry: Any, batch: StepInput, *, epilogue: Callable, hidden: Callable,
                     pooling_type: str, classifier_token_ids: tuple[int, ...] | None) -> tuple[jax.Array, jax.Array]:
    logits = epilogue(outer, carry, batch)
    if classifier_token_ids:
        return logits, logits[:, jnp.asarray(classifier_token_ids)]
    return logits, pool_rows(hidden(outer, carry, batch), batch, pooling_type)


def pooling_epilogue(epilogue: Callable, hidden: Callable, pooling_type: str,
                     classifier_token_ids: tuple[int, ...] | None = None) -> Callable:
    """The epilogue of a pooling engine: (outer_params, carry, batch) -> (logits [S, vocab],
    pooled [S, D] float32, or [S, K] logits of `classifier_token_ids` at each slot's last token).

    epilogue / hidden: the model's LayerStages.epilogue and LayerStages.hidden."""
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")
    return functools.partial(_pooled_epilogue, epilogue=epilogue, hidden=hidden, pooling_type=pooling_type,
                             classifier_token_ids=tuple(classifier_token_ids) if classifier_token_ids else None)
