"""quant.rtn: every dequantized weight within half a step of the original."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from quant.qtensor import dequantize, expand_groups
from quant.rtn import fake_quantize, quantize_rtn


def _weights(shape, seed):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape) * rng.uniform(0.01, 1, (1, shape[1]))
    w[:, 0] += 0.5  # a column far from symmetric
    w[5, :] *= 20  # outlier input channel
    return jnp.asarray(w, jnp.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1, 48])  # 48: K=160 leaves a short group
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_within_half_a_step(bits, group_size, symmetric):
    w = _weights((160, 24), bits + group_size)
    q = quantize_rtn(w, bits, group_size, symmetric)
    k = w.shape[0]
    assert q.group_size == (k if group_size <= 0 else min(group_size, k))
    assert q.scales.shape == (-(-k // q.group_size), 24)
    step = np.asarray(expand_groups(q.scales, q.group_size, k))
    err = np.abs(np.asarray(dequantize(q)) - np.asarray(w))
    assert np.all(err <= 0.5 * step * (1 + 1e-5) + 1e-7), (err / step).max()
    # The jitted fake quantization (AWQ's search) is on the same grid; it may round an exact
    # tie the other way.
    fake_err = np.abs(np.asarray(fake_quantize(w, bits, group_size, symmetric)) - np.asarray(w))
    assert np.all(fake_err <= 0.5 * step * (1 + 1e-4) + 1e-7)
    # The step is that of the group's range: max|w| / (2^(b-1) - 1) or (max - min) / (2^b - 1).
    first = np.asarray(w)[: q.group_size, 1]
    want = (np.abs(first).max() / (2 ** (bits - 1) - 1) if symmetric
            else (first.max() - first.min()) / (2 ** bits - 1))
    np.testing.assert_allclose(float(q.scales[0, 1]), want, rtol=1e-6)


def test_rtn_bound_holds_for_bfloat16_scales():
    w = _weights((128, 16), 7)
    q = quantize_rtn(w, 4, 32, symmetric=False, dtype=jnp.bfloat16)
    assert q.scales.dtype == jnp.bfloat16 and q.offsets.dtype == jnp.bfloat16
    step = np.asarray(expand_groups(q.scales.astype(jnp.float32), 32, 128))
    err = np.abs(np.asarray(dequantize(q)) - np.asarray(w))
    # Scale and offset are rounded to bf16 (8 significant bits) before the codes are chosen:
    # only the ends of the range can land a little past half a step.
    assert np.all(err <= 0.5 * step + 2 ** -7 * np.abs(np.asarray(w)).max(0) + 1e-6)


def test_constant_and_zero_groups_are_exact():
    w = jnp.concatenate([jnp.zeros((32, 4)), jnp.full((32, 4), 0.25)])
    for symmetric in (True, False):
        np.testing.assert_array_equal(np.asarray(dequantize(quantize_rtn(w, 4, 32, symmetric))),
                                      np.asarray(w))


def test_asymmetric_int4_g32_reproduces_a_q4_1_grid():
    """A kernel already on a 4-bit min/max grid per 32 rows (like GGUF Q4_1) comes back exact."""
    rng = np.random.default_rng(5)
    d = rng.uniform(0.01, 0.1, (2, 8))
    m = -rng.uniform(0.1, 1, (2, 8))
    codes = rng.integers(0, 16, (64, 8))
    codes[0], codes[1], codes[32], codes[33] = 0, 15, 0, 15
    w = np.repeat(d, 32, 0) * codes + np.repeat(m, 32, 0)
    q = quantize_rtn(jnp.asarray(w, jnp.float32), 4, 32, symmetric=False)
    np.testing.assert_allclose(np.asarray(dequantize(q)), w, rtol=1e-5, atol=1e-6)
