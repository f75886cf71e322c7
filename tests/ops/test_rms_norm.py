"""ops.rms_norm: the Pallas kernel against the jnp reference and a float64 numpy RMSNorm.

On CPU the kernel runs interpreted; on a GPU compiled. A CPU test lowers it to Triton for an
H200. Rows of random scale (not unit variance) and random weights; hidden sizes that are and
are not powers of two.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.kernel_choice import KernelBackends
from ops.rms_norm import rms_norm, rms_norm_reference

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"


def norm_np(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden,dtype", [(1, 64, jnp.float32), (5, 96, jnp.bfloat16),
                                               (3, 2048, jnp.bfloat16), (2, 576, jnp.float32)])
def test_matches_reference_and_float64(rows, hidden, dtype):
    rng = np.random.default_rng(hidden + rows)
    x = (rng.standard_normal((rows, hidden)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
    w = rng.uniform(-2, 2, hidden).astype(np.float32)
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    got = rms_norm(xj, wj, 1e-5, impl=IMPL)
    assert got.shape == x.shape and got.dtype == dtype
    ref = rms_norm_reference(xj, wj, 1e-5)
    got32, ref32 = (np.asarray(a.astype(jnp.float32)) for a in (got, ref))
    want = norm_np(np.asarray(xj.astype(jnp.float32)), np.asarray(wj.astype(jnp.float32)), 1e-5)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got32, ref32, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(got32, want, rtol=2e-5, atol=2e-5)
    else:  # two bf16 roundings on each side: within 2 units in the last place
        ulp = np.abs(ref32) * 2.0 ** -7 + 1e-30
        assert np.all(np.abs(got32 - ref32) <= 2 * ulp)
        assert np.all(np.abs(got32 - want) <= 3 * (np.abs(want) * 2.0 ** -7) + 1e-6)


@pytest.mark.gpu
def test_one_dimensional_input_and_validation():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(32), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 32), jnp.float32)
    np.testing.assert_allclose(np.asarray(rms_norm(x, w, 1e-6, impl=IMPL)),
                               np.asarray(rms_norm_reference(x, w, 1e-6)), rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:-1], 1e-6)
    with pytest.raises(ValueError, match="impl"):
        rms_norm(x, w, 1e-6, impl="cuda")


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
def test_lowers_to_triton_for_h200(h200_lowering):
    spec = jax.ShapeDtypeStruct
    text = jax.jit(lambda x, w: rms_norm(x, w, 1e-5, impl="pallas")).trace(
        spec((3, 3584), jnp.bfloat16), spec((3584,), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and h200_lowering


def test_default_dispatch_takes_the_kernel_only_for_its_rows(monkeypatch):
    """With the kernel chosen (kernels.norm; interpreted here) the kernel runs for KERNEL_ROWS
    rows only; 1 row (where it measured slower) and many rows stay with XLA."""
    import ops.rms_norm as mod
    kernels = KernelBackends(norm="pallas_interpret")
    calls = []
    kernel = mod._rms_norm_pallas
    monkeypatch.setattr(mod, "_rms_norm_pallas", lambda *a, **k: calls.append(a[0].shape[0])
                        or kernel(*a, **k))
    w = jnp.ones(64, jnp.float32)
    for rows in (1, 16, 32, 64, 65, 300):
        mod.rms_norm(jnp.ones((rows, 64), jnp.float32), w, 1e-6, kernels=kernels)
    assert calls == [16, 32, 64]
