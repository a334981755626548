"""Ragged paged attention as a C++ kernel for XLA:CPU (the `attention_backend="cpu"` path).

XLA:CPU has no way to read a paged cache in place: the pure-JAX attention
(runtime/ops/attention.py) gathers each token's blocks into a fresh array before its dots, and
on the demo model that copy, not the arithmetic, is most of a decode step's attention
(~0.75 of a 2.9 ms layer at 32 sequences of 128 tokens). This kernel reads every cached
block where it lies, once per (sequence, KV head, query tile), with an online softmax; it
runs on XLA's own intra-op threads.

The kernel (runtime/ops/kernels/paged_attention.cc) is compiled on first use, in one library with
the sampler's top-k/top-p cut (runtime/ops/kernels/sampling.cc, see runtime/engine/sampler.py) and the
matmul on packed weights (runtime/ops/kernels/matmul.cc, see runtime/ops/matmul.py), with the
machine's C++ compiler (`CXX`, else g++ or c++; more flags from SERVAX_KERNEL_CXXFLAGS) against
the XLA FFI headers jaxlib ships, for the CPU it runs on (-march=native), and kept in
~/.cache/servax/kernels/ under a key of source, flags, jaxlib version and CPU: later starts load
it in milliseconds. Where no
compiler is found or the build fails, `kernel_status()` says why and attention_backend
"auto" keeps the XLA implementation.

Float32 caches only (a quantized or bfloat16 cache keeps the XLA path); a bfloat16 model's
queries are read as float32 and its output cast back.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from runtime.ops.attention import NO_SLIDING_WINDOW, per_kv_head_shard
from runtime.ops.step import StepInput

logger = logging.getLogger("servax.engine")

_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = tuple(_KERNELS / name for name in ("paged_attention.cc", "sampling.cc", "matmul.cc"))
_HEADERS = tuple(_KERNELS / name for name in ("parallel.h",))  # part of the build key, not compiled alone
_TARGET = "servax_paged_attention"
TRUNCATION_TARGET = "servax_truncation_cut"  # runtime/engine/sampler.py's top-k/top-p cut
MATMUL_TARGET = "servax_packed_matmul"  # runtime/ops/matmul.py
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC")
# Linked apart from compiling, without -ffast-math: GCC 12 links crtfastmath.o into a shared
# library built with it, which sets flush-to-zero and denormals-are-zero in the thread that
# loads the library (the caller's main thread: its NumPy would round subnormals to 0).
_LINK_FLAGS = ("-shared", "-fPIC")
# More compiler flags, after _FLAGS (e.g. "-mno-avx512f": the AVX2 code paths on a machine with AVX-512).
EXTRA_FLAGS_ENV = "SERVAX_KERNEL_CXXFLAGS"
NO_WINDOW = 0  # the kernel's "no sliding window"

_lock = threading.Lock()
_status: str | None = None  # None: not tried; "ok"; else why the kernel is unavailable


def _flags() -> list[str]:
    return [*_FLAGS, *os.environ.get(EXTRA_FLAGS_ENV, "").split()]


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("SERVAX_KERNEL_CACHE", Path.home() / ".cache" / "servax" / "kernels"))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in info.splitlines() if ln.startswith("flags")), "").partition(":")[2].split())


def _cpu_key() -> str:
    """What the machine code depends on besides the source: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return platform.machine() + "\n" + "\n".join(lines)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str) -> Path:
    """The kernel's shared library, compiled now unless a build for this machine is cached."""
    import jaxlib

    sources = [source.read_bytes() for source in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256(b"\0".join([*sources, " ".join([*_flags(), *_LINK_FLAGS]).encode(), jaxlib.__version__.encode(),
                                     _cpu_key().encode(), compiler.encode()])).hexdigest()[:16]
    out = kernel_cache_dir() / f"servax_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling the CPU kernels (once per machine) -> %s", out)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in _SOURCES]
        for cmd in [*([compiler, *_flags(), f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", obj]
                      for source, obj in zip(_SOURCES, objects)),
                    [compiler, *_LINK_FLAGS, *objects, "-o", str(part)]]:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(part, out)  # atomic: a concurrent build of the same key is harmless
    return out


def kernel_status() -> str:
    """"ok" once the kernel is built and registered with XLA:CPU; else why it is not."""
    global _status
    with _lock:
        if _status is None:
            _status = _load()
        return _status


def kernel_available() -> bool:
    return kernel_status() == "ok"


def _load() -> str:
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (set CXX, or install g++)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.ServaxPagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(TRUNCATION_TARGET, jax.ffi.pycapsule(library.ServaxTruncationCut), platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(library.ServaxPackedMatmul), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure leaves the XLA path, with the reason
        return f"{type(e).__name__}: {e}"
    return "ok"


def cpu_ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_blocks, kv_heads, block_size, head_dim], float32
    v_cache: jax.Array,
    layer: int | jax.Array,
    batch: StepInput,
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    logit_soft_cap: float | None = None,
    mesh: jax.sharding.Mesh | None = None,
    cache_spec: PartitionSpec | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], dtype of q; zeros for padding tokens
    """Causal paged attention of every token over its sequence's cached context (which
    includes the step's own K/V, already written), read in place by the C++ kernel.

    Same contract as runtime.ops.attention.ragged_paged_attention. On a mesh of several devices
    the kernel runs per shard (shard_map): each device attends with its own KV heads.

    Raises:
        RuntimeError: the kernel is not available (`kernel_status()` says why).
    """
    status = kernel_status()
    if status != "ok":
        raise RuntimeError(f"the CPU attention kernel is not available: {status}")
    if k_cache.dtype != jnp.float32:
        raise NotImplementedError(f"the CPU attention kernel reads a float32 cache, not {k_cache.dtype}")
    batch = jax.tree.map(jnp.asarray, batch)
    window = NO_WINDOW if sliding_window is None else sliding_window
    attend = functools.partial(_attend, scale=scale, soft_cap=logit_soft_cap)
    return per_kv_head_shard(attend, q, k_cache, v_cache, layer, window, batch, mesh=mesh, cache_spec=cache_spec,
                             kernel="CPU attention kernel")


def _attend(q, k_cache, v_cache, layer, window, batch: StepInput, *, scale: float,
            soft_cap: float | None) -> jax.Array:
    """cpu_ragged_paged_attention on one device's arrays."""
    # The XLA path's "no window" (a huge traced width) is the kernel's too.
    window = jnp.where(window >= NO_SLIDING_WINDOW, NO_WINDOW, window)
    as_scalar = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))  # noqa: E731
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32), k_cache, v_cache, as_scalar(layer), batch.block_tables.astype(jnp.int32),
        batch.seq_lens.astype(jnp.int32), batch.query_start_loc.astype(jnp.int32),
        batch.positions.astype(jnp.int32), as_scalar(batch.num_tokens), as_scalar(window),
        scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0),
    )
    return out.astype(q.dtype)
