"""A step's host inputs in the form the layered programs take them (runtime/ops/layered.py):
one host buffer per program call (HostBatch), and the batch's sequence arrays widened to the
slots the programs were compiled for (widen_seqs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import numpy as np

from runtime.ops.step import StepInput


def widen_seqs(batch: StepInput, num_seqs: int) -> StepInput:
    """A host batch with its sequence arrays padded to `num_seqs` slots of no tokens (the
    batch itself when it has that many already)."""
    pad = num_seqs - batch.padded_num_seqs
    if pad <= 0:
        return batch

    def rows(a: Any, edge: bool = False) -> np.ndarray:  # `pad` more rows: zeros, or copies of the last
        a = np.asarray(a)
        out = np.empty((len(a) + pad, *a.shape[1:]), a.dtype)  # (np.pad costs ~10x more, per step)
        out[:len(a)] = a
        out[len(a):] = a[-1] if edge else 0
        return out

    groups = {} if batch.group_block_tables is None else {"group_block_tables": rows(batch.group_block_tables)}
    return dataclasses.replace(batch, block_tables=rows(batch.block_tables), seq_lens=rows(batch.seq_lens),
                               query_start_loc=rows(batch.query_start_loc, edge=True),
                               logits_indices=rows(batch.logits_indices), **groups)


@flax.struct.dataclass
class HostBatch:
    """A host StepInput's int32 arrays in one buffer: each program call then converts one
    host argument, not one per field (each host array adds to a call's host time, which a
    step pays once per program; measured in benchmarks/RESULTS.md, stop 45)."""

    data: np.ndarray  # [sum of the fields' sizes] int32
    layout: tuple = flax.struct.field(pytree_node=False)  # ((field, shape), ...) in data's order

    @classmethod
    def pack(cls, batch: StepInput) -> "HostBatch":
        fields = [(f.name, np.asarray(getattr(batch, f.name))) for f in dataclasses.fields(batch)
                  if getattr(batch, f.name) is not None]
        data = np.concatenate([a.reshape(-1) for _, a in fields]).astype(np.int32, copy=False)
        return cls(data, tuple((name, a.shape) for name, a in fields))

    @property
    def padded_num_tokens(self) -> int:
        return dict(self.layout)["input_ids"][0]

    @property
    def padded_num_seqs(self) -> int:
        return dict(self.layout)["seq_lens"][0]

    def unpack(self) -> StepInput:
        """The StepInput again, its arrays slices of `data` (inside a program: free)."""
        arrays, offset = {}, 0
        for name, shape in self.layout:
            size = int(np.prod(shape))
            arrays[name] = self.data[offset:offset + size].reshape(shape)
            offset += size
        return StepInput(**arrays)
