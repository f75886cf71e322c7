"""ops.ragged_attention against its jnp reference and an independent float64 numpy attention.

Each case is one step of a continuous-batching engine: a flat array of query tokens from
sequences doing a whole prefill, a prefill chunk after cached tokens (chunked prefill or a
prefix-cache hit), a speculative verification (a few tokens) and a decode (one token), plus
padding sequences and padding tokens at the end. On CPU the Pallas kernel runs with
interpret=True; on a GPU compiled (the tests marked `gpu`, run by `make test-gpu`), with a larger
sweep under PALLASITE_GPU_SWEEP=1. The references compute in float32 at HIGHEST precision.
"""
from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.paged_attention import paged_attention_reference
from ops.ragged_attention import (RaggedConfig, ragged_paged_attention,
                                  ragged_paged_attention_reference)
from tests.ops.paged_cases import NP_DTYPES, attention_np, make_paged_case, rel_err, tolerance

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"
# (kv_len, q_len): full prefill, chunk after a prefix (ends mid-page), padding, a length-1
# prefill, speculative verification, decode.
SEQUENCES = ((21, 21), (45, 13), (0, 0), (1, 1), (38, 4), (29, 1))


def run_case(*, page_size, head_dim, num_heads, num_kv_heads, dtype="float32", kv_dtype=None,
             sequences=SEQUENCES, pad_tokens=3, config=None, seed=0, q_scale=1.0, **kw):
    rng = np.random.default_rng(seed)
    kv_dtype = kv_dtype or dtype
    kv_lens = [n for n, _ in sequences]
    q_lens = [t for _, t in sequences]
    case = make_paged_case(rng, kv_lens, page_size=page_size, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, kv_dtype=kv_dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(starts[-1]) + pad_tokens
    q = (q_scale * rng.standard_normal((num_tokens, num_heads, head_dim))).astype(NP_DTYPES[dtype])
    max_q_len = max(q_lens)
    args = (jnp.asarray(q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
            jnp.asarray(case.block_tables), jnp.asarray(starts), jnp.asarray(case.kv_lens))
    scales = {}
    if case.k_scales is not None:
        scales = dict(k_scales=jnp.asarray(case.k_scales), v_scales=jnp.asarray(case.v_scales))
    out = ragged_paged_attention(*args, max_q_len=max_q_len, **scales, impl=IMPL,
                                 config=config, **kw)
    ref = ragged_paged_attention_reference(*args, max_q_len=max_q_len, **scales, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    tol = tolerance(dtype, case.k_scales is not None) * q_scale  # logit errors grow with them
    assert rel_err(out, np.asarray(ref.astype(jnp.float32))) < tol
    for s, (n, t) in enumerate(sequences):
        if t == 0:
            continue
        rows = slice(starts[s], starts[s + 1])
        want = attention_np(q[rows].astype(np.float64), case.keys[s], case.values[s],
                            np.arange(n - t, n), **kw)
        assert rel_err(out[rows], want) < tol, f"sequence {s} (kv_len {n}, q_len {t})"
    assert np.all(out[starts[-1]:] == 0), "padding rows must be 0"


# (page_size, head_dim, num_heads, num_kv_heads, dtype, kv_dtype, config)
CASES = [
    (16, 64, 8, 2, "float32", None, RaggedConfig(block_m=32, block_k=16)),  # GQA 4
    (8, 32, 8, 1, "bfloat16", None, RaggedConfig(block_m=16, block_k=16, num_splits=3)),  # GQA 8
    (32, 32, 4, 4, "float16", None, None),  # GQA 1, heuristic config
    (16, 64, 8, 2, "bfloat16", "int8", RaggedConfig(block_m=64, block_k=32)),
    (16, 32, 4, 1, "float16", "float8_e4m3fn", RaggedConfig(block_m=16, block_k=16)),
    # The softmax's exponent in PTX when compiled (the same jnp as the others when interpreted).
    (16, 64, 8, 2, "bfloat16", None, RaggedConfig(block_m=64, block_k=16, ptx_softmax=True)),
    (8, 32, 8, 1, "float16", "int8", RaggedConfig(block_m=16, block_k=16, num_splits=3,
                                                  ptx_softmax=True)),
    # Phi-3's 96-wide heads: rows read as 128 columns, the last 32 masked
    (16, 96, 4, 4, "bfloat16", None, RaggedConfig(block_m=16, block_k=16, num_splits=2)),
    (16, 48, 4, 2, "float32", "int8", None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,head_dim,num_heads,num_kv_heads,dtype,kv_dtype,config", CASES)
def test_matches_references(page_size, head_dim, num_heads, num_kv_heads, dtype, kv_dtype,
                            config):
    run_case(page_size=page_size, head_dim=head_dim, num_heads=num_heads,
             num_kv_heads=num_kv_heads, dtype=dtype, kv_dtype=kv_dtype, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharp_softmax_at_llama_8b_head_dim(dtype):
    """Queries 8x larger than the keys (logits of std 8: a softmax close to one-hot, as in a
    model with large activations), head_dim 128 and GQA 4 as llama3.1-8b, the prefill tiles."""
    run_case(page_size=16, head_dim=128, num_heads=8, num_kv_heads=2, dtype=dtype, q_scale=8.0,
             config=RaggedConfig(block_m=128, block_k=64, num_warps=4, num_stages=3,
                                 ptx_softmax=True), seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ON_GPU, reason="needs a GPU: interpreted, the PTX softmax runs the same jnp as "
                       "ptx=False"))])
def test_soft_cap_sliding_window_and_odd_group(ptx):
    # A group of 3 query heads: q blocks of 5 tokens in 16 rows.
    run_case(page_size=8, head_dim=32, num_heads=6, num_kv_heads=2, soft_cap=5.0,
             sliding_window=9, scale=0.3, config=RaggedConfig(block_m=16, block_k=8,
                                                               num_splits=2, ptx_softmax=ptx),
             seed=1)


@pytest.mark.gpu
def test_single_token_queries_equal_padded_decode():
    """max_q_len=1 (decode): the kernel equals the padded [B, 1] reference of
    ops.paged_attention, each query at its sequence's last position."""
    rng = np.random.default_rng(3)
    kv_lens = [17, 1, 40, 0]
    case = make_paged_case(rng, kv_lens, page_size=8, num_kv_heads=2, head_dim=32)
    q = jnp.asarray(rng.standard_normal((4, 8, 32)), jnp.float32)
    starts = jnp.array([0, 1, 2, 3, 3], jnp.int32)  # the padding sequence has no token
    pages = (jnp.asarray(case.k_pages), jnp.asarray(case.v_pages), jnp.asarray(case.block_tables))
    ragged = ragged_paged_attention(q, *pages, starts, jnp.asarray(case.kv_lens), max_q_len=1,
                                    impl=IMPL)
    kv_lens = jnp.asarray(case.kv_lens)
    with jax.default_matmul_precision("highest"):  # float32 products on a GPU too (not TF32)
        decode = paged_attention_reference(q[:, None], *pages, (kv_lens - 1)[:, None],
                                           kv_lens)[:, 0]
    # row 3 belongs to no sequence (the kernel writes zeros; the reference's padding row is
    # unspecified)
    np.testing.assert_allclose(np.asarray(ragged)[:3], np.asarray(decode)[:3], atol=1e-5)
    assert not np.asarray(ragged)[3].any()


def gpu_sweep_cases():
    full = os.environ.get("PALLASITE_GPU_SWEEP") == "1"
    pages = (8, 16, 32, 64, 128) if full else (16, 64)
    dims = (64, 128, 256) if full else (128,)
    for page, dim, group, dtype in itertools.product(pages, dims, (1, 4, 8),
                                                     ("bfloat16", "float16")):
        yield page, dim, group, dtype, None
    for page, kv in itertools.product((16, 64) if full else (16,), ("int8", "float8_e4m3fn")):
        yield page, 128, 4, "bfloat16", kv
    yield 16, 96, 1, "bfloat16", None  # Phi-3's heads (no grouping)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the sweep of long contexts compiles the kernel")
@pytest.mark.parametrize("page_size,head_dim,group,dtype,kv_dtype", list(gpu_sweep_cases()))
def test_gpu_sweep(page_size, head_dim, group, dtype, kv_dtype):
    sequences = ((1000, 1000), (3000, 700), (0, 0), (1, 1), (2049, 5), (517, 1), (4100, 1))
    run_case(page_size=page_size, head_dim=head_dim, num_heads=2 * group, num_kv_heads=2,
             dtype=dtype, kv_dtype=kv_dtype, sequences=sequences, pad_tokens=37,
             seed=page_size + head_dim)


def test_validation():
    q = jnp.zeros((5, 4, 32), jnp.float32)
    pages = jnp.zeros((2, 6, 8, 32), jnp.float32)
    tables = jnp.zeros((2, 3), jnp.int32)
    starts = jnp.array([0, 2, 5], jnp.int32)
    kv_lens = jnp.array([4, 9], jnp.int32)
    base = dict(q=q, k_pages=pages, v_pages=pages, block_tables=tables,
                query_start_loc=starts, kv_lens=kv_lens)
    bad = [dict(q=q[0]), dict(query_start_loc=starts[:2]), dict(kv_lens=kv_lens[:1]),
           dict(kv_lens=kv_lens.astype(jnp.uint32)), dict(block_tables=tables[0]),
           dict(q=jnp.zeros((5, 4, 16), jnp.float32))]
    for change in bad:
        with pytest.raises(ValueError, match="ragged_paged_attention"):
            ragged_paged_attention(**{**base, **change}, max_q_len=3)
    with pytest.raises(ValueError, match="max_q_len"):
        ragged_paged_attention(**base, max_q_len=0)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("kv_dtype,head_dim,page_size,max_q_len,variant", [
    ("bfloat16", 128, 16, 2048, None), ("int8", 64, 128, 4, None),
    ("float8_e4m3fn", 256, 8, 512, None), ("bfloat16", 96, 16, 1, None),
    ("int8", 128, 16, 1, "ptx_softmax")])
def test_lowers_to_triton_for_h200(h200_lowering, kv_dtype, head_dim, page_size, max_q_len,
                                   variant):
    spec = jax.ShapeDtypeStruct
    q = spec((2048, 32, head_dim), jnp.bfloat16)
    pages = spec((8, 256, page_size, head_dim), jnp.dtype(kv_dtype))
    scales = spec((8, 256, page_size), jnp.float32) if kv_dtype != "bfloat16" else None
    tables, starts, kv_lens = spec((4, 64), jnp.int32), spec((5,), jnp.int32), spec((4,), jnp.int32)

    def f(q, k, v, t, qs, n, ks, vs):
        config = RaggedConfig(16, 128, 4, ptx_softmax=True) if variant else None
        return ragged_paged_attention(q, k, v, t, qs, n, max_q_len=max_q_len, k_scales=ks,
                                      v_scales=vs, impl="pallas", sliding_window=300,
                                      config=config)

    text = jax.jit(f).trace(q, pages, pages, tables, starts, kv_lens, scales, scales).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and h200_lowering
