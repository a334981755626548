"""Compiled programs saved whole (runtime/program_cache.py): a second start loads every
program without tracing, serves the same tokens and compiles nothing; another setting is
another key; a broken entry is compiled again; XLA-cache hits are never saved."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from app import LLM, SamplingParams
from conftest import REPO

MODEL = "servax-tiny/llama"
SETTINGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, show_progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(10, 60))]


def run(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [GREEDY, SAMPLED])]


@pytest.fixture(scope="module")
def first(tmp_path_factory, servax_cache):
    cache_dir = tmp_path_factory.mktemp("programs")
    llm = LLM(MODEL, compilation_cache_dir=str(cache_dir), **SETTINGS)
    return cache_dir, llm, run(llm)


def test_second_start_loads_every_program_and_serves_the_same_tokens(first):
    cache_dir, llm, tokens = first
    cache = llm.engine.runner.program_cache
    assert cache.loaded == 0 and cache.saved > 0
    entries = sorted((cache_dir / "servax-programs").glob("*.pkl"))
    assert entries

    again = LLM(MODEL, loaded_model=llm.engine.model, compilation_cache_dir=str(cache_dir), **SETTINGS)
    cache2 = again.engine.runner.program_cache
    assert (cache2.loaded, cache2.saved) == (cache.saved, 0)
    assert run(again) == tokens
    assert again.engine.stats().compilations_since_warmup == 0


def test_other_settings_are_other_programs(first):
    cache_dir, llm, _ = first
    other = LLM(MODEL, loaded_model=llm.engine.model, compilation_cache_dir=str(cache_dir),
                **dict(SETTINGS, max_model_len=96))
    runner = other.engine.runner
    seq_buckets = {s for _, s in runner.bucket_pairs()}
    # Other block tables: every step program (3 per bucket, layer by layer) and the samplers
    # with penalties (token counts of max_model_len) are new; the other samplers are shared.
    assert runner.program_cache.saved == 3 * len(runner.bucket_pairs()) + 4 * len(seq_buckets)
    assert runner.program_cache.loaded == 4 * len(seq_buckets)


def test_a_broken_entry_is_compiled_again(first, caplog):
    cache_dir, llm, tokens = first
    entries = sorted((cache_dir / "servax-programs").glob("*.pkl"), key=lambda p: p.stat().st_mtime)
    entries[0].write_bytes(b"not a program")
    with caplog.at_level("WARNING", logger="servax.engine"):
        again = LLM(MODEL, loaded_model=llm.engine.model, compilation_cache_dir=str(cache_dir), **SETTINGS)
    assert "could not be loaded" in caplog.text
    assert again.engine.runner.program_cache.saved >= 1
    assert run(again) == tokens


def test_xla_cache_hits_are_not_saved(tmp_path):
    """JAX 0.10 cannot serialize again an executable its persistent cache handed back
    (the copy fails to run), so compile_fresh must tell such programs apart."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import jax, jax.numpy as jnp
        from runtime.compilation import enable_persistent_cache
        from runtime.program_cache import compile_fresh
        enable_persistent_cache({str(tmp_path)!r})
        f = lambda x: jnp.tanh(x).sum()
        _, fresh = compile_fresh(jax.jit(f).lower(jnp.ones(8)))
        jax.clear_caches()
        _, again = compile_fresh(jax.jit(f).lower(jnp.ones(8)))
        print(fresh, again)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
