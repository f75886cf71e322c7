"""paged_attention_reference and write_kv against independent numpy (float64) references.

Every case lays each sequence's K/V out contiguously first, scatters it into randomly chosen
physical pages (the rest of the cache holds large random garbage that must never be seen), and
compares the paged attention of several query tokens per sequence with a dense causal attention
computed in float64 over the contiguous K/V. On a GPU these float32 products run at "highest"
precision, not TF32 (tests/conftest.py, for every test not marked `gpu`), as the 1e-5
tolerances assume.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ops.paged_attention import paged_attention_reference, write_kv

# (kv_len, number of query tokens) of each sequence: the queries sit at [kv_len - T, kv_len).
# Lengths 1, mid-page ends for page sizes 4 and 16, a full prefill, a middle chunk, a decode.
SEQUENCES = ((1, 1), (5, 5), (19, 4), (37, 1), (23, 7))
GARBAGE = 50.0  # magnitude of the unused cache entries: any leak shows up at once

paged_attention_jit = jax.jit(paged_attention_reference,
                              static_argnames=("scale", "soft_cap", "sliding_window"))


def make_case(rng, *, page_size, num_heads, num_kv_heads, head_dim, sequences=SEQUENCES,
              pad_rows=1, dtype=np.float32, extra_width=1, q_scale=1.0):
    """Random paged inputs plus the contiguous K/V they were built from."""
    batch = len(sequences) + pad_rows
    num_q = max(t for _, t in sequences)
    pages_of = [-(-kv_len // page_size) for kv_len, _ in sequences]
    width = max(pages_of) + extra_width
    num_pages = sum(pages_of) + 5  # spare pages full of garbage
    physical = rng.permutation(num_pages)  # shuffled physical pages
    k_pages = rng.uniform(-GARBAGE, GARBAGE, (num_kv_heads, num_pages, page_size, head_dim))
    v_pages = rng.uniform(-GARBAGE, GARBAGE, (num_kv_heads, num_pages, page_size, head_dim))
    # Padding entries of the block tables point at garbage pages (masked by kv_lens).
    block_tables = rng.integers(0, num_pages, (batch, width))
    q = rng.standard_normal((batch, num_q, num_heads, head_dim)) * q_scale
    q_positions = rng.integers(0, 64, (batch, num_q))  # padding queries: arbitrary positions
    kv_lens = np.zeros(batch, np.int64)
    keys, values = [], []
    used = 0
    for b, ((kv_len, t), n) in enumerate(zip(sequences, pages_of)):
        pages = physical[used:used + n]
        used += n
        block_tables[b, :n] = pages
        k = rng.standard_normal((kv_len, num_kv_heads, head_dim))  # contiguous [L, KVH, D]
        v = rng.standard_normal((kv_len, num_kv_heads, head_dim))
        pos = np.arange(kv_len)
        k_pages[:, pages[pos // page_size], pos % page_size] = k.swapaxes(0, 1)
        v_pages[:, pages[pos // page_size], pos % page_size] = v.swapaxes(0, 1)
        q_positions[b, :t] = np.arange(kv_len - t, kv_len)
        kv_lens[b] = kv_len
        keys.append(k)
        values.append(v)
    # Round everything to the test dtype once; the reference sees exactly the rounded values.
    cast = lambda a: np.asarray(a, dtype)
    q, k_pages, v_pages = cast(q), cast(k_pages), cast(v_pages)
    keys = [cast(k).astype(np.float64) for k in keys]
    values = [cast(v).astype(np.float64) for v in values]
    args = (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
            jnp.asarray(block_tables, jnp.int32), jnp.asarray(q_positions, jnp.int32),
            jnp.asarray(kv_lens, jnp.int32))
    return args, q.astype(np.float64), keys, values


def dense_reference(q, keys, values, sequences, *, scale=None, soft_cap=None,
                    sliding_window=None):
    """Float64 causal attention per sequence over contiguous K/V; [(T, H, D)] per sequence."""
    outs = []
    for b, (kv_len, t) in enumerate(sequences):
        k, v = keys[b], values[b]  # [L, KVH, D]
        num_heads, head_dim = q.shape[2], q.shape[3]
        group = num_heads // k.shape[1]
        s = head_dim ** -0.5 if scale is None else scale
        out = np.zeros((t, num_heads, head_dim))
        for i in range(t):
            p = kv_len - t + i
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            for h in range(num_heads):
                kh = h // group  # query head h reads kv head h // group
                logits = k[lo:p + 1, kh] @ q[b, i, h] * s
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                w = np.exp(logits - logits.max())
                out[i, h] = (w / w.sum()) @ v[lo:p + 1, kh]
        outs.append(out)
    return outs


def check(actual, reference, sequences, rtol, atol):
    actual = np.asarray(actual.astype(jnp.float32))
    for b, (_, t) in enumerate(sequences):
        np.testing.assert_allclose(actual[b, :t], reference[b], rtol=rtol, atol=atol,
                                   err_msg=f"sequence {b} {sequences[b]}")


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_matches_dense_reference(page_size, group, head_dim):
    rng = np.random.default_rng(100 * page_size + 10 * group + head_dim)
    num_kv_heads = 2
    args, q, keys, values = make_case(rng, page_size=page_size, num_heads=group * num_kv_heads,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    out = paged_attention_jit(*args)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    check(out, dense_reference(q, keys, values, SEQUENCES), SEQUENCES, rtol=1e-5, atol=1e-5)


def test_eager_call_and_block_table_order():
    """Unjitted call; permuting the physical pages (same logical content) changes nothing."""
    rng = np.random.default_rng(1)
    args, q, keys, values = make_case(rng, page_size=4, num_heads=4, num_kv_heads=4, head_dim=16)
    out = paged_attention_reference(*args)
    check(out, dense_reference(q, keys, values, SEQUENCES), SEQUENCES, rtol=1e-5, atol=1e-5)
    q_, k_pages, v_pages, tables, positions, kv_lens = args
    perm = rng.permutation(k_pages.shape[1])  # physical page p moves to perm[p]
    inverse = np.argsort(perm)
    moved = (q_, k_pages[:, inverse], v_pages[:, inverse], jnp.asarray(perm)[tables],
             positions, kv_lens)
    np.testing.assert_array_equal(np.asarray(paged_attention_reference(*moved))[:len(SEQUENCES)],
                                  np.asarray(out)[:len(SEQUENCES)])


@pytest.mark.parametrize("sliding_window", [1, 3, 8])
def test_sliding_window(sliding_window):
    rng = np.random.default_rng(10 + sliding_window)
    args, q, keys, values = make_case(rng, page_size=4, num_heads=6, num_kv_heads=2, head_dim=16)
    out = paged_attention_jit(*args, sliding_window=sliding_window)
    ref = dense_reference(q, keys, values, SEQUENCES, sliding_window=sliding_window)
    check(out, ref, SEQUENCES, rtol=1e-5, atol=1e-5)
    # The window matters on these inputs (so this test can fail).
    full = dense_reference(q, keys, values, SEQUENCES)
    assert max(np.abs(a - b).max() for a, b in zip(ref, full)) > 1e-2


def test_soft_cap_and_scale():
    rng = np.random.default_rng(20)
    # Large queries: raw logits reach tens, so a cap of 5 changes the result a lot.
    args, q, keys, values = make_case(rng, page_size=4, num_heads=4, num_kv_heads=1,
                                      head_dim=16, q_scale=4.0)
    for scale, soft_cap in ((None, 5.0), (0.5, 5.0), (0.3, None)):
        out = paged_attention_jit(*args, scale=scale, soft_cap=soft_cap)
        ref = dense_reference(q, keys, values, SEQUENCES, scale=scale, soft_cap=soft_cap)
        check(out, ref, SEQUENCES, rtol=1e-5, atol=1e-5)
    uncapped = dense_reference(q, keys, values, SEQUENCES)
    capped = dense_reference(q, keys, values, SEQUENCES, soft_cap=5.0)
    assert max(np.abs(a - b).max() for a, b in zip(capped, uncapped)) > 1e-1


def test_padding_rows_and_queries_do_not_disturb_real_ones():
    """Garbage in padding queries / rows changes no real output, and nothing is NaN."""
    rng = np.random.default_rng(30)
    args, q, keys, values = make_case(rng, page_size=4, num_heads=4, num_kv_heads=2,
                                      head_dim=16, pad_rows=2)
    q_, k_pages, v_pages, tables, positions, kv_lens = args
    out = np.asarray(paged_attention_jit(*args))
    assert np.isfinite(out).all()  # padding rows (kv_len 0) see nothing but must not be NaN
    pad = np.ones(q_.shape[:2], bool)
    for b, (_, t) in enumerate(SEQUENCES):
        pad[b, :t] = False
    noisy_q = jnp.where(pad[:, :, None, None], 100 * rng.standard_normal(q_.shape), q_)
    noisy_positions = jnp.where(pad, rng.integers(0, 1000, pad.shape), positions)
    noisy_tables = tables.at[len(SEQUENCES):].set(
        rng.integers(0, k_pages.shape[1], tables[len(SEQUENCES):].shape))
    noisy_lens = kv_lens.at[len(SEQUENCES):].set(7)
    out2 = np.asarray(paged_attention_jit(noisy_q, k_pages, v_pages, noisy_tables,
                                          noisy_positions, noisy_lens))
    for b, (_, t) in enumerate(SEQUENCES):
        np.testing.assert_array_equal(out2[b, :t], out[b, :t])


def test_bfloat16():
    rng = np.random.default_rng(40)
    args, q, keys, values = make_case(rng, page_size=16, num_heads=8, num_kv_heads=2,
                                      head_dim=64, dtype=ml_dtypes.bfloat16)
    out = paged_attention_jit(*args)
    assert out.dtype == jnp.bfloat16
    # The inputs are exact bf16 values; the output is rounded once to bf16 (8 mantissa bits,
    # relative error <= 2**-9) after float32 arithmetic: allow about one bf16 ulp.
    check(out, dense_reference(q, keys, values, SEQUENCES), SEQUENCES, rtol=1e-2, atol=1e-3)


# ----------------------------------------------------------------------------------- write_kv

def numpy_scatter(pages, new, slots):
    out = pages.copy()
    num_pages, page_size = pages.shape[1], pages.shape[2]
    for i, slot in enumerate(slots):
        if 0 <= slot < num_pages * page_size:
            out[:, slot // page_size, slot % page_size] = new[i]
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_write_kv_scatters_into_page_and_offset(page_size):
    rng = np.random.default_rng(50 + page_size)
    kvh, num_pages, d, n = 3, 16 // page_size + 5, 16, 12
    k_pages = rng.standard_normal((kvh, num_pages, page_size, d)).astype(np.float32)
    v_pages = rng.standard_normal((kvh, num_pages, page_size, d)).astype(np.float32)
    k = rng.standard_normal((n, kvh, d)).astype(np.float32)
    v = rng.standard_normal((n, kvh, d)).astype(np.float32)
    slots = rng.choice(num_pages * page_size, n, replace=False)
    slots[[1, 5, 6]] = -1  # padding
    slots[9] = num_pages * page_size  # past the end: dropped too
    new_k, new_v = jax.jit(write_kv)(jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(k),
                                     jnp.asarray(v), jnp.asarray(slots, jnp.int32))
    np.testing.assert_array_equal(np.asarray(new_k), numpy_scatter(k_pages, k, slots))
    np.testing.assert_array_equal(np.asarray(new_v), numpy_scatter(v_pages, v, slots))
    # The padding rows really were dropped (not written anywhere, e.g. wrapped to the end).
    written = (np.asarray(new_k) != k_pages).any(axis=(0, 3)).sum()
    assert written == n - 4


def test_write_kv_casts_to_page_dtype():
    rng = np.random.default_rng(60)
    k_pages = rng.standard_normal((2, 5, 4, 8)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((6, 2, 8)).astype(np.float32)
    slots = np.array([3, -1, 0, 19, 8, -1])
    new_k, new_v = write_kv(jnp.asarray(k_pages), jnp.asarray(k_pages), jnp.asarray(k),
                            jnp.asarray(k), jnp.asarray(slots, jnp.int32))
    assert new_k.dtype == jnp.bfloat16
    expected = numpy_scatter(k_pages, k.astype(ml_dtypes.bfloat16), slots)
    np.testing.assert_array_equal(np.asarray(new_k), expected)
    np.testing.assert_array_equal(np.asarray(new_v), expected)


# --------------------------------------------------------------------------------- validation

def _shape_text(shape):
    return re.escape(str(tuple(shape)))


def test_write_kv_validation():
    pages = jnp.ones((2, 4, 4, 8))
    k = jnp.ones((3, 2, 8))
    slots = jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match=_shape_text((3, 2, 16))):
        write_kv(pages, pages, jnp.ones((3, 2, 16)), jnp.ones((3, 2, 16)), slots)  # head_dim
    with pytest.raises(ValueError, match=_shape_text((3, 4, 8))):
        write_kv(pages, pages, jnp.ones((3, 4, 8)), jnp.ones((3, 4, 8)), slots)  # kv heads
    with pytest.raises(ValueError, match=_shape_text((4, 2, 8))):
        write_kv(pages, pages, k, jnp.ones((4, 2, 8)), slots)  # k vs v
    with pytest.raises(ValueError, match=_shape_text((5,))):
        write_kv(pages, pages, k, k, jnp.zeros(5, jnp.int32))  # slot mapping
