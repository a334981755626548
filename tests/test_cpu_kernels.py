"""Building, caching and loading the C++ kernels (runtime/ops/cpu_kernels.py), each with its own status.

The kernels are built with the machine's compiler, as users get them; a kernel that cannot be
built says why and leaves the others usable.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import runtime.ops.cpu_kernels as cpu_kernels
from runtime.ops.cpu_kernels import KERNELS, kernel_available, kernel_status


def test_every_kernel_builds_on_the_test_machine():
    for name in KERNELS:
        assert kernel_status(name) == "ok", f"{name}: {kernel_status(name)}"
    with pytest.raises(KeyError):
        kernel_status("no_such_kernel")


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    """A compiler that fails leaves the reason (its stderr) in kernel_status(), nothing half-written."""
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'fatal error: no FFI headers' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SERVAX_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setattr(cpu_kernels, "_status", {})
    status = kernel_status("paged_attention")
    assert "no FFI headers" in status and status != "ok"
    assert not list((tmp_path / "kernels").glob("*.so"))
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "_status", {})
    assert kernel_status("paged_attention") == "ok"


@pytest.mark.slow
def test_a_kernel_that_fails_to_compile_leaves_the_others_available(tmp_path, monkeypatch):
    """One broken source: its kernel reports the compiler's error, the other two build, load and
    register from the same sources in a fresh cache, one library each."""
    sources = tmp_path / "kernels"
    shutil.copytree(cpu_kernels.SOURCE_DIR, sources)
    with open(sources / KERNELS["paged_attention"].source, "a") as f:
        f.write("\n#error broken on purpose\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("SERVAX_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", sources)
    monkeypatch.setattr(cpu_kernels, "_status", {})
    status = kernel_status("paged_attention")
    assert "broken on purpose" in status and not kernel_available("paged_attention")
    assert kernel_available("truncation") and kernel_available("matmul")
    assert sorted(p.name.partition("-")[0] for p in cache.glob("*.so")) == ["servax_matmul", "servax_truncation"]


def test_loading_the_kernels_keeps_subnormal_floats():
    """The kernels are compiled with -ffast-math but linked without it: a library that sets
    flush-to-zero on load would round the caller's subnormal floats to 0 (NumPy's included)."""
    assert all(kernel_available(name) for name in KERNELS)
    tiny = np.float32(1e-40)  # a subnormal float32
    assert tiny * np.float32(1.0) == tiny != 0
    assert (np.array([tiny]) * np.float32(3.0))[0] > tiny
