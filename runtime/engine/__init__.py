"""The engine that runs a step function: the layer `app/` drives.

Requests enter through `input_processor.py` (prompt forms, chat template, limits) and live as
`request.Request` in the `scheduler.py` (continuous batching, chunked prefill), which asks the
`kv_cache_manager.py` for blocks (`block_pool.py`, prefix cache). `plan.py` decides the execution
plan once at startup (KV blocks, attention backend, buckets, layered or whole steps); the
`runner.py` turns a `interfaces.SchedulerOutput` into device calls (`runner_inputs.py` builds
the inputs, `programs.py` compiles and holds the programs) and returns a
`interfaces.RunnerOutput`; the `output_processor.py` detokenizes, applies stop strings and the
stop decision (`stop.py`) and makes `outputs.RequestOutput`s. `core.Engine` ties them together
(schedule, run, collect, update), and reports on itself through `introspection.py` (stats, health);
`async_engine.AsyncLLMEngine` drives it from its own thread.

This layer imports `runtime.ops`; nothing in `runtime.ops`, `registry/` or `models_jax/`
imports it.
"""
