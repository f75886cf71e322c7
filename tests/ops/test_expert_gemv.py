"""ops.expert_gemv (x [M, K] @ w[expert[m]] per row, bf16) against float64 numpy on fresh random
inputs, its dispatch and fallback, and its lowering for an H200, alone and in a tiny mixture's
decode step.

On the CPU the kernel runs interpreted on small shapes; on a GPU the same cases run compiled and
qwen3-30b-a3b's decode shapes are added.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import get_preset
from ops.backends import select_kernels
from ops.expert_gemv import ExpertGemvConfig, expert_gemv, expert_rows_matmul, kernel_refusal
from ops.kernel_choice import KernelBackends
from ops.moe_matmul import rows_matmul
from tests.marks import gpu_picks
from tests.models.lowering import lowered_step_text

ON_GPU = jax.default_backend() == "gpu"
# (M, E, K, N, config): no split, even and uneven K splits, prefetch off, the default tiles
CASES = [
    (3, 5, 64, 48, ExpertGemvConfig(block_n=16, block_k=16, splits=1)),
    (8, 6, 128, 64, ExpertGemvConfig(block_n=32, block_k=16, splits=4)),
    (8, 4, 128, 32, ExpertGemvConfig(block_n=16, block_k=16, splits=3, prefetch=False)),
    (5, 3, 96, 80, None),
]


def operands(seed: int, m: int, e: int, k: int, n: int):
    """bf16 x [M, K] and experts [E, K, N] of fresh random values, and random expert ids [M]
    with a repeat (two rows of one expert)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) + 0.3, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), jnp.bfloat16)
    expert = rng.integers(0, e, m)
    expert[-1] = expert[0]
    return x, w, jnp.asarray(expert, jnp.int32)


def float64_want(x, w, expert) -> np.ndarray:
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    return np.einsum("mk,mkn->mn", f(x), f(w)[np.asarray(expert)])


def check(out, want):
    """bf16 outputs: within one bf16 rounding (2^-8 relative) of the float64 value, plus float32
    sums' error (1e-4 of the largest value)."""
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert out.shape == want.shape and np.all(np.isfinite(out))
    np.testing.assert_array_less(np.abs(out - want),
                                 2.0 ** -8 * np.abs(want) + 1e-4 * np.abs(want).max())


@pytest.mark.parametrize("m,e,k,n,config", gpu_picks(CASES, {0, 1, 2, 3}))
def test_kernel_against_float64(m, e, k, n, config):
    x, w, expert = operands(m * 100 + k + n, m, e, k, n)
    out = expert_gemv(x, w, expert, config=config, interpret=not ON_GPU)
    assert out.dtype == jnp.bfloat16
    want = float64_want(x, w, expert)
    check(out, want)
    check(rows_matmul(x, w, expert), want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: qwen3-30b-a3b's decode shapes run compiled")
@pytest.mark.parametrize("m,k,n", [(8, 2048, 768), (8, 768, 2048), (128, 2048, 768)])
def test_qwen3_moe_shapes_on_gpu(m, k, n):
    x, w, expert = operands(m + k, m, 128, k, n)
    check(expert_rows_matmul(x, w, expert, impl="pallas"), float64_want(x, w, expert))


def test_dispatch_follows_the_choice_and_falls_back():
    x, w, expert = operands(7, 4, 5, 64, 32)
    ref = rows_matmul(x, w, expert)
    np.testing.assert_array_equal(expert_rows_matmul(x, w, expert), ref)  # kernels None
    interpreted = KernelBackends(moe="pallas_interpret")
    check(expert_rows_matmul(x, w, expert, kernels=interpreted), float64_want(x, w, expert))
    # shapes and dtypes the kernel does not take run the reference, whatever the choice
    odd = jnp.pad(w, ((0, 0), (0, 0), (0, 8)))  # N = 40: no whole column blocks
    assert "not whole tiles" in kernel_refusal(x, odd, expert)
    np.testing.assert_array_equal(expert_rows_matmul(x, odd, expert, kernels=interpreted),
                                  rows_matmul(x, odd, expert))
    x32 = x.astype(jnp.float32)
    assert "bf16" in kernel_refusal(x32, w, expert)
    np.testing.assert_array_equal(expert_rows_matmul(x32, w, expert, kernels=interpreted),
                                  rows_matmul(x32, w, expert))
    with pytest.raises(ValueError, match="impl 'triton'"):
        expert_rows_matmul(x, w, expert, impl="triton")


def test_bad_input_raises():
    x, w, expert = operands(8, 3, 4, 32, 16)
    with pytest.raises(ValueError, match=r"x \(3, 16\) must be \[M, K\]"):
        expert_gemv(x[:, :16], w, expert, interpret=True)
    with pytest.raises(ValueError, match=r"expert ids \(2,\) int32 must be integers \[M\]"):
        expert_gemv(x, w, expert[:2], interpret=True)
    with pytest.raises(ValueError, match=r"expert ids \(3,\) float32"):
        expert_rows_matmul(x, w, expert.astype(jnp.float32))
    with pytest.raises(ValueError, match="the kernel takes bf16"):
        expert_gemv(x.astype(jnp.float32), w, expert, interpret=True)
    with pytest.raises(ValueError, match=r"not whole tiles \(16 x 64\)"):
        expert_gemv(x, w, expert, config=ExpertGemvConfig(block_n=64, block_k=16),
                    interpret=True)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
def test_lowers_to_triton_for_h200(h200_lowering):
    spec = jax.ShapeDtypeStruct
    text = jax.jit(lambda x, w, e: expert_gemv(x, w, e)).trace(
        spec((8, 2048), jnp.bfloat16), spec((128, 2048, 768), jnp.bfloat16),
        spec((8,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "expert_gemv" in text and h200_lowering


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
def test_decode_step_of_a_tiny_mixture_reaches_the_kernel(h200_lowering):
    """tiny-qwen3-moe's decode step (2 tokens x 3 experts: 6 rows <= 8 experts) with the GPU's
    kernel choice runs its three expert products per layer through the kernel; with the
    reference choice, through none."""
    cfg = get_preset("tiny-qwen3-moe")
    shapes = dict(num_pages=8, page_size=4, tokens=2, seqs=2, width=4)
    gpu = select_kernels("gpu", hopper=True)
    assert gpu.moe == "pallas"
    text = lowered_step_text(cfg, gpu, **shapes)
    assert text.count('"expert_gemv"') >= 3 * cfg.num_layers and h200_lowering
    text = lowered_step_text(cfg, dataclasses.replace(gpu, moe="reference"), **shapes)
    assert '"expert_gemv"' not in text
