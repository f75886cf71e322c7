"""ops.skinny_matmul: the Pallas kernel (with its RMSNorm / SiLU-gate prologues and residual
epilogue) against the jnp reference and a float64 numpy product, on fresh random inputs.

On CPU the kernel runs interpreted; on a GPU compiled. A CPU test lowers it to Triton for an
H200. Shapes: rows 1 to 16, K with a block that divides it, N that is and is not a multiple of
the column block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.skinny_matmul import SkinnyConfig, skinny_matmul, skinny_matmul_reference

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"


def operands(m, k, n, dtype, seed, *, gated=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, 2 * k if gated else k)) * rng.uniform(0.2, 5, (m, 1))
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    nw = rng.uniform(0.5, 1.5, k)
    res = rng.standard_normal((m, n))
    return tuple(jnp.asarray(a, dtype) for a in (x, w, nw, res))


def numpy_product(x, w, nw=None, eps=1e-5, gated=False, res=None):
    """(x' @ w [+ res], |x'| @ |w|) in float64, x' = the prologue of x: the product and the
    magnitude of its terms (which bounds the rounding of any summation order)."""
    x, w = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    if nw is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        x = x * np.asarray(nw.astype(jnp.float32), np.float64)
    if gated:
        gate, up = np.split(x, 2, axis=-1)
        x = gate / (1 + np.exp(-gate)) * up
    y, mag = x @ w, np.abs(x) @ np.abs(w)
    if res is not None:
        y = y + np.asarray(res.astype(jnp.float32), np.float64)
    return y, mag


def check(got, ref, want, mag, dtype):
    """got and the reference within a few roundings of the inputs (relative to the terms'
    magnitude) and of the output (relative to its value)."""
    got, ref = (np.asarray(a.astype(jnp.float32), np.float64) for a in (got, ref))
    eps = {jnp.float32: 2.0 ** -23, jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11}[dtype]
    for a, b, c in ((got, ref, 4), (got, want, 8)):
        bound = c * eps * mag + 2 * eps * np.abs(b) + 1e-30
        worst = float(np.max(np.abs(a - b) / bound))
        assert worst <= 1.0, f"error {worst:.2f}x the {dtype.__name__} bound"


CASES = [  # (m, k, n, dtype, config)
    (1, 128, 96, jnp.float32, SkinnyConfig(block_n=32, block_k=32)),
    (3, 256, 80, jnp.bfloat16, SkinnyConfig(block_n=32, block_k=64)),  # N % BN != 0
    (16, 64, 64, jnp.float16, SkinnyConfig(block_n=16, block_k=16, num_stages=2)),
    (7, 192, 48, jnp.float32, None),  # K = 3 x 64: the heuristic's block divides it
]


@pytest.mark.parametrize("m,k,n,dtype,config", CASES)
@pytest.mark.parametrize("fusion", ["plain", "norm", "gated", "residual", "norm+residual"])
def test_matches_reference_and_float64(m, k, n, dtype, config, fusion):
    gated = fusion == "gated"
    x, w, nw, res = operands(m, k, n, dtype, seed=m * 1000 + k + n, gated=gated)
    kwargs = dict(norm_weight=nw if "norm" in fusion else None, eps=1e-5, gated=gated,
                  residual=res if "residual" in fusion else None)
    got = skinny_matmul(x, w, config=config, impl=IMPL, **kwargs)
    assert got.shape == (m, n) and got.dtype == dtype
    ref = skinny_matmul_reference(x, w, **kwargs)
    want, mag = numpy_product(x, w, kwargs["norm_weight"], 1e-5, gated, kwargs["residual"])
    check(got, ref, want, mag, dtype)


def test_validation_names_the_problem():
    x, w, nw, res = operands(2, 64, 32, jnp.float32, seed=3)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_matmul(x[:, :32], w, impl=IMPL)
    with pytest.raises(ValueError, match="share a float dtype"):
        skinny_matmul(x, w.astype(jnp.bfloat16), impl=IMPL)
    with pytest.raises(ValueError, match="residual"):
        skinny_matmul(x, w, residual=res[:1], impl=IMPL)
    with pytest.raises(ValueError, match="norm_weight"):
        skinny_matmul(x, w, norm_weight=nw[:5], impl=IMPL)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_matmul(jnp.ones((17, 64)), w, impl=IMPL)
    with pytest.raises(ValueError, match="block_k"):
        skinny_matmul(x, w, config=SkinnyConfig(block_n=16, block_k=128), impl=IMPL)
    with pytest.raises(ValueError, match="impl"):
        skinny_matmul(x, w, impl="cuda")


def test_default_dispatch_takes_the_kernel_for_few_rows(monkeypatch):
    """On a GPU (simulated) impl None runs the kernel for up to 16 rows only; more rows, and a
    K without a power-of-two block, go to the jnp reference."""
    import ops.skinny_matmul as mod
    monkeypatch.setattr(mod, "_resolve_impl", lambda impl: "pallas_interpret")
    calls = []
    kernel = mod._skinny_pallas
    monkeypatch.setattr(mod, "_skinny_pallas",
                        lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    for m, k in ((1, 64), (16, 64), (17, 64), (4, 72)):
        mod.skinny_matmul(jnp.ones((m, k)), jnp.ones((k, 16)))
    assert calls == [1, 16]


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile the kernel for real")
def test_lowers_to_triton_for_h200(monkeypatch):
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    spec = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for args, kw in (((spec((1, 4096), bf), spec((4096, 6144), bf)), {}),
                     ((spec((4, 2 * 14336), bf), spec((14336, 4096), bf)), {"gated": True})):
        text = jax.jit(lambda x, w: skinny_matmul(x, w, impl="pallas", **kw)).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
