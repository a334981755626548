"""Large host arrays backed by 2 MiB pages (Linux transparent huge pages), for XLA:CPU.

A decode step on the CPU streams every weight of the model once, matrix after matrix, most of
them a megabyte or less. On 4 KiB pages each page of a matrix costs the core a TLB miss and a
page walk (a two-dimensional one in a virtual machine), and the packed products read their
weights well under the machine's bandwidth (measured in benchmarks/RESULTS.md, stop 54;
NumPy asks the same for its own large arrays). Linux backs anonymous memory with 2 MiB pages only where a
program asks (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most
distributions), so once the weights are in their final form the runtime asks for each large
host array: `madvise(MADV_HUGEPAGE)` marks its range and `madvise(MADV_COLLAPSE)` (Linux 6.1+)
moves what is already there onto huge pages at once; on older kernels the kernel's
`khugepaged` does it in the background. Only whole 2 MiB-aligned pages inside an array are
asked for (an array's first and last partial pages stay as they are), so nothing outside the
arrays changes, and the contents never do. Where the system says `never`, or is not Linux,
nothing happens; SERVAX_HUGE_PAGES=0 in the environment turns the request off (to compare).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger("servax.engine")

HUGE_PAGE = 2 << 20  # bytes (x86-64 and arm64 with 4 KiB base pages)
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
DISABLE_ENV = "SERVAX_HUGE_PAGES"
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_allowed() -> bool:
    """Whether this system gives a program 2 MiB pages where it asks (Linux with transparent
    huge pages `always` or `madvise`), unless SERVAX_HUGE_PAGES=0 says not to ask."""
    if not sys.platform.startswith("linux") or os.environ.get(DISABLE_ENV) == "0":
        return False
    try:
        return "[never]" not in _SETTING.read_text()
    except OSError:
        return False


def host_ranges(tree: Any, least: int = HUGE_PAGE) -> list[tuple[int, int]]:
    """(start, end) of the whole 2 MiB pages inside each host (CPU) buffer of the arrays in
    `tree`, each buffer once; buffers with no whole page inside, or under `least` bytes, are
    left out."""
    ranges = set()
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu" or shard.data.nbytes < least:
                continue
            start = shard.data.unsafe_buffer_pointer()
            lo = -(-start // HUGE_PAGE) * HUGE_PAGE
            hi = (start + shard.data.nbytes) // HUGE_PAGE * HUGE_PAGE
            if hi > lo:
                ranges.add((lo, hi))
    return sorted(ranges)


def advise_huge_pages(ranges: list[tuple[int, int]]) -> int:
    """Ask Linux to back each (start, end) range of `host_ranges` with 2 MiB pages, now where the
    kernel can (MADV_COLLAPSE) and otherwise in the background. Returns the bytes asked for (0
    where the system gives no huge pages). Never raises for the system's refusal (a range since
    freed, a kernel without MADV_COLLAPSE): the arrays stay correct either way, only their
    speed differs. Safe while programs read the arrays (the kernel moves pages under a lock)."""
    if not ranges or not huge_pages_allowed():
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, asked, collapsed = time.perf_counter(), 0, 0
    for lo, hi in ranges:
        if libc.madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            continue
        asked += hi - lo
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
    if asked:
        logger.info("weights: %.0f MiB on 2 MiB pages (%.0f MiB now, the rest as the kernel gets to it; %.2f s)",
                    asked / 2**20, collapsed / 2**20, time.perf_counter() - start)
    return asked


def back_with_huge_pages(tree: Any) -> int:
    """advise_huge_pages for the large host arrays of `tree` (a pytree of jax.Arrays)."""
    return advise_huge_pages(host_ranges(tree)) if huge_pages_allowed() else 0
