"""ops.kv_quant: per-token, per-head int8 / fp8 quantization of K/V rows and its inverse."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ops.kv_quant import dequantize_pages, quantize_kv
from tests.ops.paged_cases import quantize_np

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
def test_dequantize_pages_inverts_quantize(kv_dtype):
    """Pages of quantized rows times their scales give the rows back within the rounding."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 5, 4, 32)) * 3).astype(np.float32)  # [KVH, P, S, D]
    values, scales = quantize_kv(jnp.asarray(x), kv_dtype)
    back = np.asarray(dequantize_pages(values, scales))
    amax = np.abs(x).max(-1, keepdims=True)
    assert np.all(np.abs(back - x) <= amax * (0.5 / 127 if kv_dtype == "int8" else 2.0 ** -4)
                  + 1e-6)


def test_validation():
    pages = jnp.zeros((2, 3, 4, 8), jnp.int8)
    scales = jnp.zeros((2, 3, 4), jnp.float32)
    with pytest.raises(ValueError, match="dtype"):
        quantize_kv(jnp.zeros((2, 2, 8)), jnp.int16)
    with pytest.raises(ValueError, match="scales"):
        dequantize_pages(pages, scales[..., :1])
