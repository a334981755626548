"""A step's inputs, built on the host: the padded `StepInput` and the sampler's `SamplingBatch`.

Rows: normally one sequence slot per scheduled request. A request that still needs prompt
logprobs, or verifies draft tokens (runtime/engine/speculative.py), has each of its scheduled
tokens in a slot of its own (same block table, seq_len = position + 1). Because a layer
writes all new K/V before it attends, the result equals one ragged prefill, and every
position yields logits.

A model whose layers keep different blocks (KV cache groups, runtime.ops.step.KVCacheGroups)
gets every group's block tables and slots as well; block_tables and slot_mapping are group 0's.

Every batch ships the token mask (all ones where unconstrained), so one sampler program
serves constrained and free batches alike; the masks of constrained rows are filled later
(`StepInputs.masked_rows`), while the device runs the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from runtime.engine.interfaces import SchedulerOutput, StepRequest
from runtime.engine.sampler import BIAS_WIDTH, SUPPRESS, SamplingBatch, empty_sampling_batch
from runtime.engine.stop import suppressed_token_ids
from runtime.engine.structured_output import mask_words
from runtime.ops.step import StepInput, make_step_input


@dataclasses.dataclass
class StepInputs:
    """What one step sends to the device, and how to read its results back."""

    batch: StepInput
    sampling: SamplingBatch
    use_penalties: bool
    masked_rows: list[tuple[int, Any, list[int]]]  # (row, token constraints, output token ids) to mask
    sample_rows: list[list[int]]  # per scheduled request, the rows whose samples count
    prompt_rows: list[tuple[str, int, int]]  # (request id, row, prompt token index) of prompt logprobs
    # Pooling requests: (request id, row, first prompt token of the chunk, tokens in it); their
    # rows are pooled (runtime/ops/pooling.py), never sampled.
    pool_rows: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)
    # Async scheduling: [t_pad] int32, for each token whose id is still on the device (a
    # pending token) the row of the previous step's samples holding it, else -1; None: none.
    input_from: np.ndarray | None = None


class InputBuilder:
    """Builds padded step and sampler inputs for one engine's geometry.

    Args:
        max_model_len: the context limit (block-table width, penalty history length).
        block_size: tokens per KV block.
        vocab_size: rows of the logits (the token mask's width).
        lora: whether the step takes per-token adapter slots.
        num_kv_groups: the model's KV cache groups (one: the step takes no group tables).
    """

    def __init__(self, *, max_model_len: int, block_size: int, vocab_size: int, lora: bool,
                 num_kv_groups: int = 1):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.mask_words = mask_words(vocab_size)  # packed token-mask row of the logits' vocabulary
        self.lora = lora
        self.num_kv_groups = num_kv_groups

    def _group_arrays(self, t: int, s: int) -> dict[str, np.ndarray]:
        """Empty group block tables [s, G, max_blocks] and slots [G, t]; none with one group."""
        if self.num_kv_groups == 1:
            return {}
        return dict(group_block_tables=np.zeros((s, self.num_kv_groups, self.max_blocks_per_seq), np.int32),
                    group_slot_mapping=np.full((self.num_kv_groups, t), -1, np.int32))

    def _empty_sampling(self, s: int, penalties: bool) -> dict[str, np.ndarray]:
        return empty_sampling_batch(s, self.max_model_len if penalties else 1, self.mask_words, report=False)

    def padding_sampling(self, s: int, penalties: bool) -> SamplingBatch:
        """A sampler batch of `s` empty rows (for lowering and warmup)."""
        return SamplingBatch(**self._empty_sampling(s, penalties))

    def padding_step(self, t: int, s: int) -> StepInput:
        """A step of bucket (t, s) with no real token (for lowering and warmup)."""
        return make_step_input(
            input_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
            slot_mapping=np.full(t, -1, np.int32),
            block_tables=np.zeros((s, self.max_blocks_per_seq), np.int32),
            seq_lens=np.zeros(s, np.int32), query_start_loc=np.zeros(s + 1, np.int32),
            logits_indices=np.zeros(s, np.int32), num_seqs=0, num_tokens=0,
            lora_slots=np.zeros(t, np.int32) if self.lora else None, **self._group_arrays(t, s),
        )

    def decode_probe(self, n: int, t_pad: int, s_pad: int, context: int) -> StepInput:
        """`n` single-token sequences with `context` tokens of context each, reading the null
        block (cost, not results): the timing probe's step."""
        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:n] = min(context, self.max_model_len - n) + np.arange(1, n + 1)
        query_start_loc = np.full(s_pad + 1, n, np.int32)
        query_start_loc[:n + 1] = np.arange(n + 1)
        positions = np.zeros(t_pad, np.int32)
        positions[:n] = seq_lens[:n] - 1
        return make_step_input(
            input_ids=np.zeros(t_pad, np.int32), positions=positions, slot_mapping=np.full(t_pad, -1, np.int32),
            block_tables=np.zeros((s_pad, self.max_blocks_per_seq), np.int32), seq_lens=seq_lens,
            query_start_loc=query_start_loc, logits_indices=np.minimum(np.arange(s_pad), n - 1).astype(np.int32),
            num_seqs=n, num_tokens=n, lora_slots=np.zeros(t_pad, np.int32) if self.lora else None,
            **self._group_arrays(t_pad, s_pad),
        )

    def build(self, sched: SchedulerOutput, block_ids: dict[str, list[list[int]]], t_pad: int, s_pad: int,
              use_penalties: bool, prev_rows: dict[str, int] | None = None) -> StepInputs:
        """The inputs of a scheduled step, padded to bucket (t_pad, s_pad); `block_ids` holds each
        scheduled request's block table per KV cache group. `prev_rows`: for the requests whose
        newest token is pending, its row in the previous step's samples (async scheduling)."""
        bs = self.block_size
        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, -1, np.int32)
        block_tables = np.zeros((s_pad, self.max_blocks_per_seq), np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        query_start_loc = np.zeros(s_pad + 1, np.int32)
        logits_indices = np.zeros(s_pad, np.int32)
        lora_slots = np.zeros(t_pad, np.int32) if self.lora else None
        groups = self._group_arrays(t_pad, s_pad)
        group_tables, group_slots = groups.get("group_block_tables"), groups.get("group_slot_mapping")
        sb = self._empty_sampling(s_pad, use_penalties)
        masked_rows, sample_rows, prompt_rows, pool_rows = [], [], [], []
        input_from = None
        t = row = 0
        for entry in sched.scheduled:
            req = entry.request
            c, n = entry.num_computed_tokens, entry.num_new_tokens
            tables = [np.asarray(ids, np.int32) for ids in block_ids[req.request_id]]
            table = tables[0]
            pos = np.arange(c, c + n, dtype=np.int32)
            drafts = entry.draft_token_ids
            input_ids[t:t + n] = req.all_token_ids[c:c + n] + drafts
            if req.has_pending_token and c <= req.num_tokens - 1 < c + n:  # (no drafts then)
                if input_from is None:
                    input_from = np.full(t_pad, -1, np.int32)
                at = t + req.num_tokens - 1 - c
                input_from[at], input_ids[at] = prev_rows[req.request_id], 0
            positions[t:t + n] = pos
            slot_mapping[t:t + n] = table[pos // bs] * bs + pos % bs
            if group_tables is not None:
                for g, group_table in enumerate(tables):
                    group_slots[g, t:t + n] = group_table[pos // bs] * bs + pos % bs
            if lora_slots is not None:
                lora_slots[t:t + n] = req.lora_slot
            if entry.one_slot_per_token:
                rows = np.arange(row, row + n)
                _put_tables(block_tables, group_tables, rows, tables)
                seq_lens[rows] = pos + 1
                query_start_loc[row + 1:row + n + 1] = t + np.arange(1, n + 1)
                logits_indices[rows] = t + np.arange(n)
                for j in range(n):
                    target = c + j + 1  # the prompt token this row's logits predict
                    if req.num_prompt_logprobs < target < req.num_prompt_tokens:
                        sb["target_ids"][row + j] = req.prompt_token_ids[target]
                        sb["report"][row + j] = True
                        prompt_rows.append((req.request_id, row + j, target))
                    if drafts and j < n - 1:  # row j draws the token after drafts[:j]
                        self._fill_sampling_row(sb, row + j, req, drafts[:j])
                last = row + n - 1
                rows_sampled = list(range(row, row + n)) if drafts else [last]
                row += n
            else:
                _put_tables(block_tables, group_tables, row, tables)
                seq_lens[row] = c + n
                query_start_loc[row + 1] = t + n
                logits_indices[row] = t + n - 1
                last = row
                rows_sampled = [row]
                row += 1
            if req.pooling_params is not None:
                pool_rows.append((req.request_id, last, c, n))
            else:
                self._fill_sampling_row(sb, last, req, drafts)
            if req.token_constraints is not None:
                masked_rows.append((last, req.token_constraints, req.output_token_ids))
            sample_rows.append(rows_sampled)
            t += n
        query_start_loc[row + 1:] = t
        batch = make_step_input(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
            seq_lens=seq_lens, query_start_loc=query_start_loc, logits_indices=logits_indices,
            num_seqs=row, num_tokens=t, lora_slots=lora_slots, **groups,
        )
        return StepInputs(batch, SamplingBatch(**sb), use_penalties, masked_rows, sample_rows, prompt_rows, pool_rows,
                          input_from)

    def _fill_sampling_row(self, sb: dict[str, np.ndarray], r: int, req: StepRequest, drafts: list[int] = ()) -> None:
        """Row r samples the request's next token after its tokens and then `drafts` (the
        draft tokens before this row, when verifying a proposal)."""
        p = req.sampling_params
        sb["report"][r] |= p.logprobs is not None
        if p.logprob_token_ids:
            sb["logprob_ids"][r, :len(p.logprob_token_ids)] = p.logprob_token_ids
        sb["temperature"][r] = p.temperature
        sb["top_k"][r] = p.top_k
        sb["top_p"][r] = p.top_p
        sb["min_p"][r] = p.min_p
        sb["seeds"][r] = req.sample_seed
        position = req.num_output_tokens + len(drafts)  # of the output token this row draws
        sb["steps"][r] = position
        bias = list(p.logit_bias.items()) + [(tok, SUPPRESS) for tok in suppressed_token_ids(req, position)]
        if bias:
            bias = bias[:BIAS_WIDTH]
            sb["bias_ids"][r, :len(bias)] = [b[0] for b in bias]
            sb["bias_values"][r, :len(bias)] = [b[1] for b in bias]
        if p.uses_penalties:
            sb["presence_penalty"][r] = p.presence_penalty
            sb["frequency_penalty"][r] = p.frequency_penalty
            sb["repetition_penalty"][r] = p.repetition_penalty
            hist = (req.all_token_ids + list(drafts))[: self.max_model_len]
            sb["token_history"][r, :len(hist)] = hist
            sb["prompt_lens"][r] = req.num_prompt_tokens


def _put_tables(block_tables: np.ndarray, group_tables: np.ndarray | None, rows: int | np.ndarray,
                tables: list[np.ndarray]) -> None:
    """One request's block tables into `rows` of the step's: group 0's into block_tables
    [S, max_blocks], and with KV cache groups every group's into group_tables [S, G, max_blocks]."""
    block_tables[rows, :len(tables[0])] = tables[0]
    if group_tables is not None:
        for g, table in enumerate(tables):
            group_tables[rows, g, :len(table)] = table
