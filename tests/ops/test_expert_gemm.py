"""ops.expert_gemm (rows sorted by expert @ w[e] per run, bf16 experts or INT8 / INT4 codes)
against float64 numpy on fresh random inputs: runs longer than a chunk, empty experts, rows past
the groups' sum, rows read in place and gated rows; its dispatch; its lowering for an H200.

On the CPU the kernel runs interpreted on small shapes; on a GPU the same cases run compiled.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.expert_gemm import (MAX_ROWS, ExpertGemmConfig, expert_gemm_config,
                             expert_group_matmul, grouped_rows_coded_matmul, grouped_rows_matmul,
                             kernel_refusal)
from ops.kernel_choice import KernelBackends
from ops.moe_matmul import ACTIVATIONS, GatedRows, IndexedRows
from tests.ops.test_expert_gemv import check, float64_want, operands

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"
# (group sizes, K, N, variant, config): a run longer than two chunks and empty experts; rows
# past the groups' sum (another shard's pairs); INT8 per channel and asymmetric in groups;
# INT4 symmetric in groups of 128 and asymmetric per channel; the default tiles
CASES = [
    ((5, 0, 37, 2), 64, 48, "bf16", ExpertGemmConfig(block_m=16, block_n=16, block_k=16)),
    ((3, 9, 0), 128, 64, "bf16", None),
    ((17, 1, 6), 64, 32, "int8", ExpertGemmConfig(block_m=16, block_n=16, block_k=16)),
    ((4, 20, 3, 0), 128, 32, "int8_g32_asym", ExpertGemmConfig(block_m=16, block_n=32,
                                                               block_k=32)),
    ((2, 33, 5), 256, 32, "int4_g128", ExpertGemmConfig(block_m=32, block_n=16, block_k=128)),
    ((6, 0, 11), 128, 48, "int4_asym", None),
]


def sorted_operands(seed: int, sizes, k: int, n: int, variant: str, tail: int = 0):
    """x [M, K] with M = sum(sizes) + tail, experts (values or codes and their keyword
    arguments), group sizes [E] and each row's expert (the tail's: -1)."""
    m = sum(sizes) + tail
    x, w, _, kw = operands(seed, m, len(sizes), k, n, variant)
    expert = np.concatenate([np.repeat(np.arange(len(sizes)), sizes), -np.ones(tail, int)])
    return x, w, jnp.asarray(sizes, jnp.int32), expert, kw


def want_rows(x, w, expert, kw) -> np.ndarray:
    """float64 products per row; rows with expert -1 are 0."""
    want = float64_want(x, w, np.maximum(expert, 0), **kw)
    return np.where((expert >= 0)[:, None], want, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes,k,n,variant,config", CASES)
def test_kernel_against_float64(sizes, k, n, variant, config):
    tail = 3 if len(sizes) == 3 else 0
    x, w, group_sizes, expert, kw = sorted_operands(sum(sizes) + k + n, sizes, k, n, variant,
                                                    tail)
    out = expert_group_matmul(x, w, group_sizes, config=config, interpret=not ON_GPU, **kw)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], n)
    check(out, want_rows(x, w, expert, kw))
    np.testing.assert_array_equal(np.asarray(out[len(expert) - tail:].astype(jnp.float32)), 0)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["bf16", "int4_g128"])
def test_indexed_and_gated_rows(variant):
    """IndexedRows: each sorted row reads its token's row of x in place. GatedRows: float32
    partials [2, M, 2 K] summed and activated as the kernel loads them, as GatedRows.rows()
    computes them. Float32 partials [1, M, N] out, within float32 sums of float64."""
    sizes, k, n = (7, 0, 18), 128, 32
    x, w, group_sizes, expert, kw = sorted_operands(11, sizes, k, n, variant)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 4, len(expert)), jnp.int32)
    table = jnp.asarray(np.random.default_rng(3).standard_normal((4, k)), jnp.bfloat16)
    out = expert_group_matmul(IndexedRows(table, tokens), w, group_sizes, partials=True,
                              interpret=not ON_GPU, **kw)
    assert out.dtype == jnp.float32 and out.shape == (1, len(expert), n)
    want = want_rows(table[tokens], w, expert, kw)  # float32 out: within float32 sums
    np.testing.assert_allclose(np.asarray(out[0], np.float64), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
    rng = np.random.default_rng(4)
    parts = jnp.asarray(rng.standard_normal((2, len(expert), 2 * k)), jnp.float32)
    for act in ACTIVATIONS:
        gated = GatedRows(parts, act, jnp.bfloat16)
        out = expert_group_matmul(gated, w, group_sizes, interpret=not ON_GPU, **kw)
        check(out, want_rows(gated.rows(), w, expert, kw))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["bf16", "int4_asym"])
@pytest.mark.parametrize("sizes,tail", [((1, 0, 75, 1, 0, 1, 1, 2), 37), ((17,) * 8, 17)])
def test_crowded_runs_and_long_tails(sizes, tail, variant):
    """Chunks of 16 rows: one expert holding most rows (a run of five chunks, each its own grid
    slot), the others one row or none, and a tail of three chunks; or every run and the tail one
    row past a whole chunk, so that all ceil(M / 16) + E grid slots hold a chunk. The tail
    comes out 0."""
    x, w, group_sizes, expert, kw = sorted_operands(21, sizes, 128, 32, variant, tail=tail)
    config = ExpertGemmConfig(block_m=16, block_n=16, block_k=128 if "int4" in variant else 32)
    out = expert_group_matmul(x, w, group_sizes, config=config, interpret=not ON_GPU, **kw)
    check(out, want_rows(x, w, expert, kw))
    np.testing.assert_array_equal(np.asarray(out[-tail:].astype(jnp.float32)), 0)


def test_dispatch_and_refusals():
    """impl None with no kernels: the grouped XLA forms, the same rows (up to the bf16 rounding
    of the tiles form's dequantized experts); the kernel refuses
    float32 rows, K or N not whole tiles and too many rows, naming why; shapes that do not
    fit raise ValueError."""
    x, w, group_sizes, expert, kw = sorted_operands(5, (4, 3), 64, 32, "int8")
    got = grouped_rows_coded_matmul(x, w, kw["scales"], None, group_sizes, bits=8,
                                    group_size=64)
    pallas = grouped_rows_coded_matmul(x, w, kw["scales"], None, group_sizes, bits=8,
                                       group_size=64, kernels=KernelBackends(moe=IMPL))
    want = want_rows(x, w, expert, kw)
    check(pallas, want)
    # XLA's tiles form rounds the dequantized experts to bf16 before its product
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=0,
                               atol=2.0 ** -6 * np.abs(want).max())
    xb, wb, gb, eb, _ = sorted_operands(6, (2, 5), 64, 48, "bf16")
    check(grouped_rows_matmul(xb, wb, gb, partials=True)[0], want_rows(xb, wb, eb, {}))
    assert "bf16" in kernel_refusal(xb.astype(jnp.float32), wb, gb)
    assert "whole tiles" in kernel_refusal(xb, wb[:, :, :40], gb)
    assert "rows" in kernel_refusal(jax.ShapeDtypeStruct((MAX_ROWS + 4, 64), jnp.bfloat16),
                                    wb, gb)
    assert kernel_refusal(xb, wb, gb) is None
    with pytest.raises(ValueError, match="group sizes"):
        expert_group_matmul(xb, wb, gb[:1])
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        expert_group_matmul(xb[:, :32], wb, gb)


def test_config_chunks_hold_the_average_run():
    assert expert_gemm_config(512, 128, 2048, 1536, 4, 128).block_m == 16
    assert expert_gemm_config(4096, 128, 2048, 1536, 4, 128).block_m == 32
    assert expert_gemm_config(8192, 8, 4096, 14336, 16).block_m == 64
    assert expert_gemm_config(64, 8, 100, 64) is None


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("variant", ["bf16", "int8_g32_asym", "int4_g128"])
def test_lowers_to_triton_for_h200(h200_lowering, variant):
    x, w, group_sizes, _, kw = sorted_operands(0, (40, 0, 24), 256, 256, variant)
    parts = jax.ShapeDtypeStruct((1, x.shape[0], 2 * x.shape[1]), jnp.float32)
    text = jax.jit(lambda p, w, g: expert_group_matmul(
        GatedRows(p, "silu", jnp.bfloat16), w, g, **kw)).trace(
        parts, w, group_sizes).lower(lowering_platforms=("cuda",)).as_text()
    assert "expert_gemm" in text and h200_lowering
