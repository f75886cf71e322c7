"""The step programs update the KV cache in place: their temporary memory stays far below one
layer's page array, whatever the cache's size. A program that copied a page array would need
that array's bytes again on every step (and fail to start when the cache fills the device)."""
from __future__ import annotations

import jax
import pytest

from engine.api import load_engine
from engine.llm_engine import EngineConfig

CACHE_BYTES = 1 << 30  # 2 layers x (K, V): page arrays of 256 MiB each


@pytest.fixture(scope="module")
def runner():
    engine = load_engine("tiny-llama", random_weights=True, engine_config=EngineConfig(
        max_model_len=256, max_num_seqs=4, page_size=16, kv_cache_memory=CACHE_BYTES))
    return engine.runner


@pytest.mark.gpu  # on a GPU: through the device's kernels (the Pallas KV write and attention)
@pytest.mark.parametrize("program", ["mixed step", "multi-step decode"])
def test_step_programs_write_the_cache_in_place(runner, program):
    page_array = max(leaf.nbytes for leaf in jax.tree.leaves(runner.cache))
    assert page_array >= CACHE_BYTES // 8  # the cache took the bytes it was given
    width = 256 // runner.page_size  # pages per sequence
    compiled = (runner.warmup([37, 1, 1], width) if program == "mixed step"
                else runner.warmup_multi_step(4, width, num_steps=4))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < page_array // 4, (f"{program}: {temp / 2**20:.0f} MiB of temporaries against "
                                    f"page arrays of {page_array / 2**20:.0f} MiB ({runner.kernels})")
