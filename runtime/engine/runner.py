"""The model runner: scheduler output -> padded inputs -> step + sampler on the device -> host.

`dispatch` builds a step's inputs (runner_inputs.InputBuilder) in the bucket the execution
plan chooses, enqueues the step and the sampler (programs.ModelPrograms) and returns at once;
`collect` waits for the results and brings them to the host as a RunnerOutput. The engine
dispatches the next step before it processes this one's output, so host work overlaps the
device's. The runner reads scheduled requests through `interfaces.StepRequest` only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from runtime.engine.interfaces import RowResult, RunnerOutput, SchedulerOutput
from runtime.engine.programs import ModelPrograms
from runtime.engine.runner_inputs import StepInputs
from runtime.engine.structured_output import fill_token_masks


@dataclasses.dataclass
class InFlightStep:
    """A step enqueued on the device whose results have not been fetched yet."""

    sched: SchedulerOutput
    out: Any  # SamplerOutput of device arrays
    inputs: StepInputs
    pooled: Any = None  # [S, D] device array of pooled rows when the step has pooling requests


# Async scheduling where EngineConfig.async_scheduling is None, when serving: run ahead while
# steps take at most this long. Running ahead hides the host's work between steps (~1 ms here)
# from every running request; a request that arrives meanwhile waits up to one step more for
# its first token. Below this, a reply of ~60 tokens or more gains more than that (measured:
# benchmarks/RESULTS.md, stop 46).
AHEAD_MAX_STEP_S = 0.05


class AheadPolicy:
    """Whether the engine schedules the next step before the tokens of the one in flight are
    on the host (async scheduling, Engine.step).

    Args:
        setting: EngineConfig.async_scheduling: True / False always / never (where it works);
            None while steps take at most `max_step_s`. A request that arrives while a step runs
            joins the step after the one dispatched ahead: one step later than without.
        supported: whether the engine can (one process, a layered step, no speculation).
        max_step_s: AHEAD_MAX_STEP_S, or no limit offline (app.LLM: no request arrives later).
    """

    def __init__(self, setting: bool | None, supported: bool, max_step_s: float = AHEAD_MAX_STEP_S):
        self.setting, self.supported, self.max_step_s = setting, supported, max_step_s
        self.step_seconds = 0.0  # moving average of the time between two steps' results, under load
        self._last: float | None = None

    def observe(self, chained: bool) -> None:
        """A step's results are on the host; `chained`: it was dispatched before the previous
        step's results were processed (no idle engine in between)."""
        now = time.perf_counter()
        if chained and self._last is not None:
            period = now - self._last
            self.step_seconds = 0.8 * self.step_seconds + 0.2 * period if self.step_seconds else period
        self._last = now

    @property
    def wanted(self) -> bool:
        if not self.supported or self.setting is False:
            return False
        return self.setting is True or self.step_seconds <= self.max_step_s


class ModelRunner:
    """Runs scheduled steps on an engine's programs.

    Args:
        programs: the device side (ModelPrograms, or a multi-process engine's MirroredPrograms).
    """

    def __init__(self, programs: ModelPrograms):
        self.programs = programs
        self.plan = programs.plan
        self.busy_since: float | None = None  # time.monotonic() of the dispatched step not collected yet

    def dispatch(self, sched: SchedulerOutput, block_ids: dict[str, list[list[int]]],
                 prev: InFlightStep | None = None) -> InFlightStep:
        """Build the inputs and enqueue step + sampler on the device without waiting.

        block_ids: per scheduled request, its block table in each KV cache group.
        prev: the step in flight whose samples are this step's pending input ids (async
            scheduling: Scheduler.advance; the programs must feed_input_ids)."""
        self.busy_since = time.monotonic()
        programs = self.programs
        use_penalties = any(e.request.sampling_params.uses_penalties for e in sched.scheduled)
        t_pad, s_pad = self.plan.step_bucket(sched.num_scheduled_tokens, sched.num_slots)
        t_pad, s_pad = programs.runnable_bucket(t_pad, s_pad, use_penalties)
        prev_rows = None if prev is None else {
            e.request.request_id: rows[-1] for e, rows in zip(prev.sched.scheduled, prev.inputs.sample_rows)}
        inputs = programs.inputs.build(sched, block_ids, t_pad, s_pad, use_penalties, prev_rows)
        if programs.pools:
            logits, pooled = programs.run_pooling_step(inputs.batch)
        elif inputs.input_from is not None:
            logits, pooled = programs.run_step(inputs.batch, prev.out.next_ids, inputs.input_from), None
        else:  # (a multi-process engine mirrors run_step on its workers)
            logits, pooled = programs.run_step(inputs.batch), None
        # Filled while the device runs the step (llguidance releases the GIL).
        fill_token_masks(inputs.sampling.token_mask, inputs.masked_rows)
        out = programs.run_sample(logits, inputs.sampling, use_penalties=use_penalties)
        return InFlightStep(sched, out, inputs, pooled if inputs.pool_rows else None)

    def collect(self, step: InFlightStep) -> RunnerOutput:
        """Wait for a dispatched step and bring its results to the host."""
        out = step.out
        reads_logprobs = bool(step.inputs.prompt_rows) or any(
            e.request.sampling_params.logprobs is not None for e in step.sched.scheduled)
        if reads_logprobs:
            if getattr(out, "next_ids", None) is not None:
                out = out.replace(next_ids=None)  # the next step's, left on the device
            out = jax.device_get(out)
        sampled_ids = np.asarray(out.sampled).tolist()  # (alone where no row reads logprobs: one transfer)
        self.busy_since = None

        def result(r: int, ids: list[int] | None = None) -> RowResult:
            if ids:  # the ids the request named, in its order, for the top K (vLLM's logprob_token_ids)
                return RowResult(float(out.chosen_logprob[r]), int(out.chosen_rank[r]), ids,
                                 out.id_logprobs[r, :len(ids)])
            return RowResult(float(out.chosen_logprob[r]), int(out.chosen_rank[r]), out.top_ids[r], out.top_logprobs[r])

        sample_rows = step.inputs.sample_rows
        sampled = [[sampled_ids[r] for r in rows] for rows in sample_rows]
        sample_logprobs = {
            e.request.request_id: [result(r, e.request.sampling_params.logprob_token_ids) for r in rows]
            for e, rows in zip(step.sched.scheduled, sample_rows)
            if e.request.sampling_params.logprobs is not None
        }
        prompt_logprobs: dict[str, list[tuple[int, RowResult]]] = {}
        for rid, r, target in step.inputs.prompt_rows:
            prompt_logprobs.setdefault(rid, []).append((target, result(r)))
        pooled = {}
        if step.pooled is not None:  # the pooling requests' rows only (runtime/engine/pooling.py pools them)
            rows = np.asarray(jax.device_get(step.pooled))
            pooled = {rid: (first, n, rows[r]) for rid, r, first, n in step.inputs.pool_rows}
        return RunnerOutput(sampled, sample_logprobs, prompt_logprobs, pooled)
