"""The ops a step function is built from: the layer `models_jax/` and `registry/` import.

- `step.py`: the step contract (`StepInput`, `KVCache`, `KVCacheSpec`, `LoadedModel`).
- `mesh.py`: the device mesh and the one logical-axis rules table.
- `attention.py`: the one dispatch point for ragged paged attention; one module per backend
  (`attention_xla.py`, with its block reads in `attention_blocks.py`; `attention_cpu.py`,
  `attention_pallas.py`) over `attention_common.py`.
- `cpu_kernels.py`: building, caching and loading servax's C++ kernels, with a status per kernel;
  `matmul.py`: products on packed weights by one of them.
- `quantization.py`, `lora.py` (adapter slots in the params), `layered.py` (stepping a few
  decoder layers per program).

Nothing here imports the engine (`runtime/engine/`).
"""
