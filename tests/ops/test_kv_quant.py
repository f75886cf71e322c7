"""ops.kv_quant: per-token, per-head int8 / fp8 quantization of new K/V rows and the write path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.kv_quant import (dequantize_pages, init_quantized_pages, quantize_kv,
                          write_kv_quantized)
from tests.ops.paged_cases import NP_DTYPES, quantize_np

KV_DTYPES = ("int8", "float8_e4m3fn")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantize_matches_numpy_and_bounds_error(kv_dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 3, 64)) * rng.uniform(0.01, 30, (7, 3, 1))).astype(np.float32)
    x[2, 1] = 0.0  # an all-zero row
    values, scales = quantize_kv(jnp.asarray(x), kv_dtype)
    want_values, want_scales = quantize_np(x, kv_dtype)
    assert values.dtype == jnp.dtype(kv_dtype) and scales.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(scales), want_scales, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(values).astype(np.float32),
                                  want_values.astype(np.float32))
    assert scales[2, 1] == 0 and np.all(np.asarray(values[2, 1]).astype(np.float32) == 0)
    back = np.asarray(values).astype(np.float64) * np.asarray(scales, np.float64)[..., None]
    amax = np.abs(x).max(-1, keepdims=True)
    if kv_dtype == "int8":  # rounding to the nearest step of amax / 127
        assert np.all(np.abs(back - x) <= amax / 127 * 0.5 + 1e-6 * amax)
    else:  # e4m3: half an ulp is 2^-4 relative (normals), 2^-10 absolute (subnormals)
        step = np.asarray(scales, np.float64)[..., None]
        assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -4 + step * 2.0 ** -10 + 1e-7)
    # The largest entry of each row maps to +-qmax exactly.
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    top = np.abs(np.asarray(values).astype(np.float32)).max(-1)
    assert np.all(top[scales > 0] == qmax)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_scatters_rows_and_scales_in_place(kv_dtype):
    rng = np.random.default_rng(1)
    kvh, num_pages, page_size, dim = 2, 5, 4, 32
    k_pages, v_pages, k_scales, v_scales = init_quantized_pages(kvh, num_pages, page_size, dim,
                                                                kv_dtype)
    # Pre-existing contents that must survive outside the written slots.
    old_k = rng.standard_normal((kvh, num_pages, page_size, dim)).astype(NP_DTYPES[kv_dtype])
    old_s = rng.uniform(0.1, 1, (kvh, num_pages, page_size)).astype(np.float32)
    k_pages, v_pages = jnp.asarray(old_k), jnp.asarray(old_k)
    k_scales, v_scales = jnp.asarray(old_s), jnp.asarray(old_s)
    n = 9
    slots = rng.permutation(num_pages * page_size)[:n].astype(np.int32)
    slots[[2, 6]] = -1  # padding, dropped
    k = (rng.standard_normal((n, kvh, dim)) * 3).astype(np.float32)
    v = rng.standard_normal((n, kvh, dim)).astype(np.float32)
    write = jax.jit(write_kv_quantized, donate_argnums=(0, 1, 2, 3))
    k_pages, v_pages, k_scales, v_scales = write(k_pages, v_pages, k_scales, v_scales,
                                                 jnp.asarray(k, jnp.bfloat16), jnp.asarray(v),
                                                 jnp.asarray(slots))
    k_deq = np.asarray(dequantize_pages(k_pages, k_scales))
    v_deq = np.asarray(dequantize_pages(v_pages, v_scales))
    k_in = np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32))
    written = np.zeros((num_pages, page_size), bool)
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        page, off = divmod(int(slot), page_size)
        written[page, off] = True
        for got, want in ((k_deq[:, page, off], k_in[i]), (v_deq[:, page, off], v[i])):
            amax = np.abs(want).max(-1, keepdims=True)
            assert np.all(np.abs(got - want) <= amax * (0.5 / 127 if kv_dtype == "int8"
                                                        else 2.0 ** -4) + 1e-6)
    keep = ~written
    np.testing.assert_array_equal(np.asarray(k_scales)[:, keep], old_s[:, keep])
    np.testing.assert_array_equal(np.asarray(k_pages).astype(np.float32)[:, keep],
                                  old_k.astype(np.float32)[:, keep])


def test_validation():
    pages, _, scales, _ = init_quantized_pages(2, 3, 4, 8)
    k = jnp.zeros((2, 2, 8))
    slots = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="not quantized"):
        write_kv_quantized(pages.astype(jnp.bfloat16), pages.astype(jnp.bfloat16), scales,
                           scales, k, k, slots)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        write_kv_quantized(pages, pages, scales[:, :2], scales, k, k, slots)
    with pytest.raises(ValueError, match=r"\[N, 2, 8\]"):
        write_kv_quantized(pages, pages, scales, scales, k[:, :1], k[:, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_quantized(pages, pages, scales, scales, k, k, slots[:1])
    with pytest.raises(ValueError, match="dtype"):
        quantize_kv(k, jnp.int16)
    with pytest.raises(ValueError, match="scales"):
        dequantize_pages(pages, scales[..., :1])
