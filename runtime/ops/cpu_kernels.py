"""servax's C++ kernels for XLA:CPU: building, caching and loading them, with a status per kernel.

Five kernels, each its own source in runtime/ops/kernels/ (sharing the header-only work
splitter parallel.h, which runs on the thread pool XLA hands each call, so nothing is shared
between the libraries at run time, the matmuls' panel header panels.h, and layer_fusions.h,
the decoder-layer ops two of them run between their products):

- "paged_attention" (paged_attention.cc): ragged paged attention (and its form that rotates q/k and
  writes the step's K/V first), runtime/ops/attention_cpu.py;
- "truncation" (sampling.cc): the sampler's top-k / top-p cut and argmax, runtime/engine/sampler.py;
- "matmul" (matmul.cc): products on packed weights, and experts' grouped products, runtime/ops/matmul.py;
- "matmul_formats" (matmul_formats.cc): products on packed bfloat16, int8 and 4-bit weights
  (as quantized or as a GGUF file stores them), runtime/ops/matmul.py;
- "matmul_dot" (matmul_dot.cc): products on int8 and 4-bit weights with the activations
  quantized to int8 (integer dot products), runtime/ops/matmul.py.

Each kernel is compiled on its first use into its own shared library, with the machine's C++
compiler (`CXX`, else g++ or c++; more flags from SERVAX_KERNEL_CXXFLAGS) against the XLA FFI
headers jaxlib ships, for the CPU it runs on (-march=native), and kept in the kernel cache
(SERVAX_KERNEL_CACHE, default ~/.cache/servax/kernels/) under a key of its source, the headers,
flags, jaxlib version, CPU and compiler: later starts load it without compiling. Its FFI target
is then registered with XLA:CPU. `kernel_status(name)` is "ok" once that is done, else why the
kernel is unavailable (no compiler, its compiler error, ...); a kernel that fails leaves the
others usable, and each caller keeps its XLA path where its kernel is missing.
"""

from __future__ import annotations

import ctypes
import dataclasses
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

logger = logging.getLogger("servax.engine")

PAGED_ATTENTION_TARGET = "servax_paged_attention"  # runtime/ops/attention_cpu.py
PAGED_ATTENTION_WRITE_TARGET = "servax_paged_attention_write"  # ... rotating and writing the step's K/V first
TRUNCATION_TARGET = "servax_truncation_cut"  # runtime/engine/sampler.py's top-k/top-p cut
ARGMAX_TARGET = "servax_argmax"  # ... and its argmax
MATMUL_TARGET = "servax_packed_matmul"  # runtime/ops/matmul.py
GROUPED_MATMUL_TARGET = "servax_grouped_matmul"  # runtime/ops/matmul.py's experts (models_jax/moe.py)
BF16_MATMUL_TARGET = "servax_bf16_matmul"  # runtime/ops/matmul.py, weights stored as bfloat16
INT8_MATMUL_TARGET = "servax_int8_matmul"  # ... as int8 with grouped or per-channel scales
UINT4_MATMUL_TARGET = "servax_uint4_matmul"  # ... as 4-bit values with scales and offsets
INT8_DOT_TARGET = "servax_int8_dot_matmul"  # ... int8 weights, activations quantized to int8 (PackedWeight.dot)
UINT4_DOT_TARGET = "servax_uint4_dot_matmul"  # ... 4-bit weights, likewise
DOT_MLP_BLOCK_TARGET = "servax_dot_mlp_block"  # ... a layer's o, residual, norm and MLP by those products
DOT_NORM_MATMUL_TARGET = "servax_dot_norm_matmul"  # ... an RMSNorm, then such a product
MLP_BLOCK_TARGET = "servax_mlp_block"  # the same two with float activations (the formats kernel's weights,
NORM_MATMUL_TARGET = "servax_norm_matmul"  # and float32 panels as matmul.cc packs them)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One C++ kernel: its source file, the FFI handler symbol it defines and the target name it is
    registered as (and any further handlers of the same source, as (symbol, target) pairs)."""

    name: str
    source: str  # file name in SOURCE_DIR
    symbol: str  # XLA_FFI_DEFINE_HANDLER_SYMBOL's name
    target: str
    more: tuple[tuple[str, str], ...] = ()


KERNELS = {k.name: k for k in (
    Kernel("paged_attention", "paged_attention.cc", "ServaxPagedAttention", PAGED_ATTENTION_TARGET,
           more=(("ServaxPagedAttentionWrite", PAGED_ATTENTION_WRITE_TARGET),)),
    Kernel("truncation", "sampling.cc", "ServaxTruncationCut", TRUNCATION_TARGET,
           more=(("ServaxArgmax", ARGMAX_TARGET),)),
    Kernel("matmul", "matmul.cc", "ServaxPackedMatmul", MATMUL_TARGET,
           more=(("ServaxGroupedMatmul", GROUPED_MATMUL_TARGET),)),
    Kernel("matmul_formats", "matmul_formats.cc", "ServaxBf16Matmul", BF16_MATMUL_TARGET,
           more=(("ServaxInt8Matmul", INT8_MATMUL_TARGET), ("ServaxUInt4Matmul", UINT4_MATMUL_TARGET),
                 ("ServaxMlpBlock", MLP_BLOCK_TARGET), ("ServaxNormMatmul", NORM_MATMUL_TARGET))),
    Kernel("matmul_dot", "matmul_dot.cc", "ServaxInt8DotMatmul", INT8_DOT_TARGET,
           more=(("ServaxUInt4DotMatmul", UINT4_DOT_TARGET), ("ServaxDotMlpBlock", DOT_MLP_BLOCK_TARGET),
                 ("ServaxDotNormMatmul", DOT_NORM_MATMUL_TARGET))),
)}

SOURCE_DIR = Path(__file__).with_name("kernels")
# Included by the kernels: part of every build key, not compiled alone.
_HEADERS = ("parallel.h", "panels.h", "half.h", "layer_fusions.h")
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC")
# Linked apart from compiling, without -ffast-math: GCC 12 links crtfastmath.o into a shared
# library built with it, which sets flush-to-zero and denormals-are-zero in the thread that
# loads the library (the caller's main thread: its NumPy would round subnormals to 0).
_LINK_FLAGS = ("-shared", "-fPIC")
# More compiler flags, after _FLAGS (e.g. "-mno-avx512f": the AVX2 code paths on a machine with AVX-512).
EXTRA_FLAGS_ENV = "SERVAX_KERNEL_CXXFLAGS"
CACHE_ENV = "SERVAX_KERNEL_CACHE"

_lock = threading.Lock()
_status: dict[str, str] = {}  # kernel name -> "ok" or why it is unavailable; absent: not tried
_registered: set[str] = set()  # FFI target names registered with XLA:CPU in this process
_libraries: dict[str, ctypes.CDLL] = {}  # kernel name -> its loaded library, once "ok"


def kernel_status(name: str) -> str:
    """"ok" once kernel `name` (a key of KERNELS) is built and registered with XLA:CPU; else why it is not.

    The first call for a kernel builds (or loads the cached build of) that kernel only.

    Raises:
        KeyError: an unknown kernel name.
    """
    kernel = KERNELS[name]
    with _lock:
        if name not in _status:
            _status[name] = _load(kernel)
        return _status[name]


def kernel_available(name: str) -> bool:
    """Whether kernel `name` is built and registered (see `kernel_status`)."""
    return kernel_status(name) == "ok"


def kernel_library(name: str) -> ctypes.CDLL | None:
    """Kernel `name`'s loaded library (building it first, as `kernel_status`), for the plain C
    functions some kernels export beside their handlers; None where the kernel is unavailable."""
    return _libraries.get(name) if kernel_available(name) else None


def kernel_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "servax" / "kernels"))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in info.splitlines() if ln.startswith("flags")), "").partition(":")[2].split())


def _flags() -> list[str]:
    return [*_FLAGS, *os.environ.get(EXTRA_FLAGS_ENV, "").split()]


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


def _build(kernel: Kernel, compiler: str) -> Path:
    """The kernel's shared library, compiled now unless a build for this machine is cached."""
    import jaxlib

    source = SOURCE_DIR / kernel.source
    texts = [source.read_bytes(), *((SOURCE_DIR / header).read_bytes() for header in _HEADERS)]
    key = hashlib.sha256(b"\0".join([*texts, " ".join([*_flags(), *_LINK_FLAGS]).encode(), jaxlib.__version__.encode(),
                                     _cpu_key().encode(), compiler.encode()])).hexdigest()[:16]
    out = kernel_cache_dir() / f"servax_{kernel.name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling the CPU kernel %s (once per machine) -> %s", kernel.name, out)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part, obj = Path(tmp) / out.name, str(Path(tmp) / f"{source.stem}.o")
        for cmd in ([compiler, *_flags(), f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", obj],
                    [compiler, *_LINK_FLAGS, obj, "-o", str(part)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                # The compiler's errors first (warnings about the FFI headers can follow them by pages).
                errors = "\n".join(ln for ln in done.stderr.splitlines() if "error" in ln)
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{errors[:1000]}\n...\n{done.stderr[-1000:]}")
        os.replace(part, out)  # atomic: a concurrent build of the same key is harmless
    return out


def _load(kernel: Kernel) -> str:
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (set CXX, or install g++)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(kernel, compiler)))
        for symbol, target in ((kernel.symbol, kernel.target), *kernel.more):
            handler = getattr(library, symbol)
            if target not in _registered:  # XLA keeps a process's first registration of a name
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
                _registered.add(target)
        _libraries[kernel.name] = library
    except Exception as e:  # noqa: BLE001 - any failure leaves the caller's XLA path, with the reason
        return f"{type(e).__name__}: {e}"
    return "ok"
