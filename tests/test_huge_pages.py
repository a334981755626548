"""Host arrays on 2 MiB pages (runtime/ops/huge_pages.py): which ranges are asked for, that Linux
marks them (its smaps), that contents never change, and the switch that turns it off. That an
engine's weights get there: tests/test_gguf.py (the demo model's)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import asked_for_huge_pages

from runtime.ops.huge_pages import HUGE_PAGE, back_with_huge_pages, host_ranges, huge_pages_allowed


def test_ranges_are_the_whole_huge_pages_inside_each_large_buffer():
    big = jnp.arange(5 * HUGE_PAGE // 4, dtype=jnp.float32)  # 5 huge pages' bytes
    small = jnp.ones(HUGE_PAGE // 8, jnp.float32)  # a quarter of one
    (lo, hi), = host_ranges({"big": big, "small": small, "other": 3})
    start = big.unsafe_buffer_pointer()
    assert lo % HUGE_PAGE == 0 and hi % HUGE_PAGE == 0
    assert start <= lo < start + HUGE_PAGE and hi <= start + big.nbytes < hi + HUGE_PAGE
    assert host_ranges([big, big]) == [(lo, hi)]  # a buffer once
    assert host_ranges(big, least=2 * big.nbytes) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_large_arrays_are_asked_for_huge_pages_and_keep_their_values():
    values = np.random.default_rng(0).standard_normal(3 * HUGE_PAGE // 4).astype(np.float32)
    a = jnp.asarray(values) + 0  # an XLA buffer of its own (not NumPy's memory)
    ((lo, hi),) = host_ranges(a)
    asked = back_with_huge_pages({"w": a})
    if huge_pages_allowed():
        assert asked == hi - lo
        assert asked_for_huge_pages(lo)
    else:  # a system set to `never`: nothing asked, nothing changed
        assert asked == 0
    np.testing.assert_array_equal(np.asarray(a), values)


def test_the_environment_can_turn_the_request_off():
    code = ("import jax.numpy as jnp; from runtime.ops.huge_pages import back_with_huge_pages;"
            "print(back_with_huge_pages(jnp.ones(1 << 21, jnp.float32) + 0))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SERVAX_HUGE_PAGES": "0"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
