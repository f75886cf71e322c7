"""The int8 / fp8 KV cache reference path: new K/V rows rounded at the write, wired end to end."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import TINY_LLAMA31
from engine.runner import full_sequence_logits
from models.weights import random_model
from ops.kv_quant import quantize_kv
from ops.paged_attention import write_kv


@pytest.mark.parametrize("kv_quant", ["int8", "float8_e4m3fn"])
def test_write_kv_stores_rows_rounded_through_the_type(kv_quant):
    rng = np.random.default_rng(0)
    pages = jnp.zeros((2, 4, 8, 16), jnp.float32)
    k = jnp.asarray(rng.normal(size=(5, 2, 16)) * rng.uniform(0.1, 10, (5, 2, 1)), jnp.float32)
    v = -2 * k
    slots = jnp.asarray([3, 9, -1, 30, 0], jnp.int32)
    k_pages, v_pages = write_kv(pages, pages, k, v, slots, kv_quant=kv_quant)
    values, scales = quantize_kv(k, kv_quant)
    want = np.asarray(values, np.float32) * np.asarray(scales)[..., None]  # [N, KVH, D]
    for n, slot in enumerate(np.asarray(slots)):
        if slot < 0:
            continue
        np.testing.assert_allclose(np.asarray(k_pages[:, slot // 8, slot % 8]), want[n],
                                   rtol=1e-6)
    assert not np.allclose(np.asarray(k_pages[:, 0, 3]), np.asarray(k[0]))  # really rounded
    assert float(jnp.abs(v_pages).sum()) > 0


def test_kv_cache_dtype_reaches_the_write_through_the_runner():
    cfg = TINY_LLAMA31
    model = random_model(cfg, seed=1)
    ids = np.random.default_rng(2).integers(3, cfg.vocab_size, (1, 24))
    exact = full_sequence_logits(cfg, model, ids)
    scale = np.abs(exact).max()
    for dtype, tolerance in (("int8", 0.02), ("float8_e4m3fn", 0.1)):
        got = full_sequence_logits(cfg, model, ids, kv_dtype=dtype)
        error = np.abs(got - exact).max()
        assert 0 < error < tolerance * scale, (dtype, error, scale)
