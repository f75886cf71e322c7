"""ops.decode_attention against its jnp reference and an independent float64 numpy attention.

On CPU the Pallas kernel runs with interpret=True (few, small cases: the CI machine has two
cores); on a GPU the same cases run compiled, and PALLASITE_GPU_SWEEP=1 adds a larger sweep
over page sizes, head dims, GQA ratios and dtypes. A CPU test also lowers the kernel to Triton
IR for an H200, which catches unsupported constructs without a GPU.
"""
from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.decode_attention import (DecodeConfig, decode_config, paged_attention,
                                  paged_attention_reference)
from tests.ops.paged_cases import NP_DTYPES, attention_np, make_paged_case, rel_err, tolerance

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"
# Lengths 1, mid-page ends, exact page ends and a padding row (0).
LENGTHS = (1, 37, 0, 16, 70)


def run_case(*, page_size, head_dim, num_heads, num_kv_heads, dtype="float32",
             kv_dtype=None, lengths=LENGTHS, config=None, seed=0, **kw):
    rng = np.random.default_rng(seed)
    kv_dtype = kv_dtype or dtype
    case = make_paged_case(rng, lengths, page_size=page_size, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, kv_dtype=kv_dtype)
    q = rng.standard_normal((len(lengths), num_heads, head_dim)).astype(NP_DTYPES[dtype])
    args = (jnp.asarray(q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
            jnp.asarray(case.block_tables), jnp.asarray(case.kv_lens))
    scales = {}
    if case.k_scales is not None:
        scales = dict(k_scales=jnp.asarray(case.k_scales), v_scales=jnp.asarray(case.v_scales))
    out = paged_attention(*args, **scales, impl=IMPL, config=config, **kw)
    ref = paged_attention_reference(*args, **scales, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    tol = tolerance(dtype, case.k_scales is not None)
    assert rel_err(out, np.asarray(ref.astype(jnp.float32))) < tol
    for b, n in enumerate(lengths):
        if n == 0:
            assert np.all(out[b] == 0), "padding row must be 0"
            continue
        want = attention_np(q[b:b + 1].astype(np.float64), case.keys[b], case.values[b], [n - 1],
                            **kw)
        assert rel_err(out[b:b + 1], want) < tol, f"sequence {b} (length {n})"


# (page_size, head_dim, num_heads, num_kv_heads, dtype, kv_dtype, config)
CASES = [
    (16, 64, 8, 2, "float32", None, DecodeConfig(block_k=32, num_splits=1)),  # GQA 4
    (8, 32, 8, 1, "bfloat16", None, DecodeConfig(block_k=16, num_splits=3)),  # GQA 8, splits
    (32, 64, 4, 4, "float16", None, None),  # GQA 1, heuristic config
    (16, 64, 8, 2, "bfloat16", "int8", DecodeConfig(block_k=32, num_splits=2)),
    (16, 32, 4, 1, "float16", "float8_e4m3fn", DecodeConfig(block_k=16, num_splits=1)),
    # The next tile's table entries read a loop step ahead (splits, quantized pages).
    (8, 32, 8, 2, "bfloat16", None, DecodeConfig(block_k=16, num_splits=3, prefetch_slots=True)),
    (16, 64, 8, 2, "float32", "int8", DecodeConfig(block_k=32, num_splits=2,
                                                   prefetch_slots=True)),
    # Splits merged inside the kernel by the last one to finish (more splits than some
    # sequences have key blocks: empty splits take part in the merge too).
    (8, 32, 8, 2, "bfloat16", None, DecodeConfig(block_k=16, num_splits=3, merge_in_kernel=True)),
    (16, 64, 8, 2, "float32", "int8", DecodeConfig(block_k=16, num_splits=5,
                                                   merge_in_kernel=True)),
    # The softmax's exponent in PTX (compiled; the same jnp as the others when interpreted).
    (16, 64, 8, 2, "bfloat16", "int8", DecodeConfig(block_k=32, num_splits=2, ptx_softmax=True)),
    (8, 32, 8, 1, "float16", None, DecodeConfig(block_k=16, num_splits=3, ptx_softmax=True)),
]


@pytest.mark.parametrize("page_size,head_dim,num_heads,num_kv_heads,dtype,kv_dtype,config", CASES)
def test_matches_references(page_size, head_dim, num_heads, num_kv_heads, dtype, kv_dtype,
                            config):
    run_case(page_size=page_size, head_dim=head_dim, num_heads=num_heads,
             num_kv_heads=num_kv_heads, dtype=dtype, kv_dtype=kv_dtype, config=config)


def test_soft_cap_sliding_window_and_odd_group():
    # 6 heads over 2 kv heads: a group of 3 (not a power of two), padded to 16 rows.
    for prefetch in (False, True):
        run_case(page_size=8, head_dim=32, num_heads=6, num_kv_heads=2, soft_cap=5.0,
                 sliding_window=11, scale=0.3, seed=1,
                 config=DecodeConfig(block_k=16, num_splits=2, prefetch_slots=prefetch))


def gpu_sweep_cases():
    full = os.environ.get("PALLASITE_GPU_SWEEP") == "1"
    pages = (8, 16, 32, 64, 128) if full else (16, 128)
    dims = (64, 128, 256) if full else (128,)
    for page, dim, group, dtype in itertools.product(pages, dims, (1, 4, 8),
                                                     ("bfloat16", "float16")):
        yield page, dim, group, dtype, None
    for page, kv in itertools.product((16, 64) if full else (16,), ("int8", "float8_e4m3fn")):
        yield page, 128, 4, "bfloat16", kv


@pytest.mark.skipif(not ON_GPU, reason="GPU sweep (compiled kernel)")
@pytest.mark.parametrize("page_size,head_dim,group,dtype,kv_dtype", list(gpu_sweep_cases()))
def test_gpu_sweep(page_size, head_dim, group, dtype, kv_dtype):
    lengths = (1, 513, 0, 4096, 2000, 17, 128 * 33 + 5, 777)
    run_case(page_size=page_size, head_dim=head_dim, num_heads=2 * group, num_kv_heads=2,
             dtype=dtype, kv_dtype=kv_dtype, lengths=lengths, seed=page_size + head_dim)


def test_dispatch_and_validation():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 4, 32)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((2, 6, 8, 32)), jnp.float32)
    tables = jnp.zeros((2, 3), jnp.int32)
    lengths = jnp.array([5, 9], jnp.int32)
    if not ON_GPU:  # default on CPU: the reference
        np.testing.assert_array_equal(
            paged_attention(q, pages, pages, tables, lengths),
            paged_attention_reference(q, pages, pages, tables, lengths))
    bad = [
        dict(q=q[0]),  # rank
        dict(block_tables=tables[:1]),  # batch mismatch
        dict(lengths=lengths[:1]),
        dict(lengths=lengths.astype(jnp.int16)),
        dict(v_pages=pages[:, :5]),  # k / v mismatch
        dict(q=jnp.zeros((2, 3, 32), jnp.float32)),  # heads not a multiple of kv heads
        dict(k_pages=pages.astype(jnp.int8), v_pages=pages.astype(jnp.int8)),  # no scales
        dict(k_pages=pages.astype(jnp.bfloat16), v_pages=pages.astype(jnp.bfloat16)),
    ]
    base = dict(q=q, k_pages=pages, v_pages=pages, block_tables=tables, lengths=lengths)
    for change in bad:
        args = {**base, **change}
        with pytest.raises(ValueError, match="paged_attention"):
            paged_attention(args["q"], args["k_pages"], args["v_pages"], args["block_tables"],
                            args["lengths"])
    with pytest.raises(ValueError, match=r"\(2, 6, 8\)"):
        paged_attention(q, pages.astype(jnp.int8), pages.astype(jnp.int8), tables, lengths,
                        k_scales=jnp.ones((2, 6, 4)), v_scales=jnp.ones((2, 6, 4)))
    with pytest.raises(ValueError, match="impl"):
        paged_attention(q, pages, pages, tables, lengths, impl="triton")


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile the kernel for real")
@pytest.mark.parametrize("kv_dtype,head_dim,page_size,config", [
    ("bfloat16", 128, 16, None), ("int8", 64, 128, None), ("float8_e4m3fn", 256, 8, None),
    ("bfloat16", 128, 16, DecodeConfig(128, 4, prefetch_slots=True)),
    ("int8", 128, 16, DecodeConfig(128, 4, merge_in_kernel=True)),
    ("bfloat16", 128, 16, DecodeConfig(128, 4, ptx_softmax=True))])
def test_lowers_to_triton_for_h200(h200_lowering, kv_dtype, head_dim, page_size, config):
    spec = jax.ShapeDtypeStruct
    q = spec((4, 32, head_dim), jnp.bfloat16)
    pages = spec((8, 64, page_size, head_dim), jnp.dtype(kv_dtype))
    scales = spec((8, 64, page_size), jnp.float32) if kv_dtype != "bfloat16" else None
    tables, lengths = spec((4, 16), jnp.int32), spec((4,), jnp.int32)

    def f(q, k, v, t, n, ks, vs):  # config None: the heuristic's
        return paged_attention(q, k, v, t, n, k_scales=ks, v_scales=vs, impl="pallas",
                               soft_cap=30.0, sliding_window=100, config=config)

    text = jax.jit(f).trace(q, pages, pages, tables, lengths, scales, scales).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and h200_lowering


def test_heuristic_merges_in_kernel_only_for_a_few_programs():
    """One llama sequence (8 kv heads) merges its splits in the kernel; a batch of 8 does not."""
    one, eight = decode_config(1, 8, 4096, 128), decode_config(8, 8, 4096, 128)
    assert one.num_splits > 1 and one.merge_in_kernel
    assert eight.num_splits > 1 and not eight.merge_in_kernel
    # Bandwidth-bound splits: 64-token tiles at about four programs per SM; none at B = 128.
    assert (eight.block_k, eight.num_splits) == (64, 8)
    wide = decode_config(128, 8, 4096, 128)
    assert (wide.block_k, wide.num_splits) == (128, 1)
    # 600 tokens: 2 splits of the heuristic, merged in the kernel
    run_case(page_size=16, head_dim=64, num_heads=8, num_kv_heads=8, lengths=(600,))
