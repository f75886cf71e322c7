"""ops.rope_kv: RoPE on queries and keys fused with the KV write, against the unfused jnp ops.

On CPU the Pallas kernel runs interpreted (few small cases); on a GPU compiled. A CPU test also
lowers it to Triton for an H200. The reference (apply_rope + write_kv) is what the model ran
before the fusion; apply_rope itself is checked against a float64 numpy rotation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import get_preset
from models.llama import rope_inv_freq
from ops.kernel_choice import KernelBackends
from ops.kv_quant import zero_pages
from ops.rope_kv import apply_rope, rope_and_write_kv, rope_and_write_kv_reference

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"
BF16_ULP = 2.0 ** -7  # relative spacing of bfloat16 near 1


def make_case(rng, *, num_tokens, num_heads, num_kv_heads, head_dim, page_size, num_pages,
              dtype, fused):
    cols = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    if fused:
        qkv_arg = jnp.asarray(qkv, dtype)
    else:
        q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
        qkv_arg = tuple(jnp.asarray(a, dtype) for a in (
            qkv[:, :q_cols], qkv[:, q_cols:q_cols + kv_cols], qkv[:, q_cols + kv_cols:]))
    positions = rng.integers(0, 130_000, num_tokens).astype(np.int32)
    slots = rng.permutation(num_pages * page_size)[:num_tokens].astype(np.int32)
    slots[rng.random(num_tokens) < 0.25] = -1  # padding tokens write nothing
    pages = rng.standard_normal((2, num_kv_heads, num_pages, page_size, head_dim))
    return (qkv_arg, jnp.asarray(positions), jnp.asarray(pages[0], dtype),
            jnp.asarray(pages[1], dtype), jnp.asarray(slots))


# (tokens, heads, kv heads, head_dim, page_size, dtype, fused projection, q/k norms)
CASES = [(5, 8, 2, 64, 16, jnp.float32, True, False),     # GQA 4
         (7, 4, 4, 32, 8, jnp.bfloat16, False, False),    # GQA 1, three projections
         (3, 6, 2, 128, 16, jnp.bfloat16, True, False),   # GQA 3: padded head rows
         (4, 8, 2, 64, 16, jnp.bfloat16, True, True),     # Qwen3's q/k norms
         (3, 6, 2, 32, 8, jnp.float32, False, True),      # norms, padded head rows
         (5, 4, 4, 96, 16, jnp.bfloat16, True, False),    # Phi-3's 96-wide heads: 128 masked
         (4, 6, 2, 48, 8, jnp.float32, False, True)]      # 48 wide (64 masked), with norms


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,page_size,dtype,fused,norm", CASES)
def test_matches_the_unfused_ops(tokens, heads, kv_heads, head_dim, page_size, dtype, fused,
                                 norm):
    rng = np.random.default_rng(tokens)
    cfg = get_preset("llama3.1-8b").replace(head_dim=head_dim)  # Llama-3.1 scaled frequencies
    inv_freq = rope_inv_freq(cfg)
    qkv, pos, k_pages, v_pages, slots = make_case(
        rng, num_tokens=tokens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, num_pages=6, dtype=dtype, fused=fused)
    qk_norm = None
    if norm:  # weights away from 1, inputs of several scales: the norm must matter
        qkv = jax.tree.map(lambda a: a * jnp.asarray(3.0, dtype), qkv)
        weights = (1.0 + 0.5 * rng.standard_normal((2, head_dim))).astype(np.float32)
        qk_norm = (jnp.asarray(weights[0], dtype), jnp.asarray(weights[1], dtype), 1e-6)
    want_q, want_k, want_v = rope_and_write_kv_reference(
        qkv, pos, inv_freq, k_pages, v_pages, slots, num_heads=heads, qk_norm=qk_norm)
    q, k, v = rope_and_write_kv(qkv, pos, inv_freq, k_pages, v_pages, slots, num_heads=heads,
                                qk_norm=qk_norm, impl=IMPL)
    assert q.shape == (tokens, heads, head_dim) and q.dtype == dtype
    # float32 math on both sides: equal up to the rounding of the last operations.
    tol = 1e-6 if dtype == jnp.float32 else BF16_ULP
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(q), f32(want_q), rtol=tol, atol=tol)
    np.testing.assert_allclose(f32(k), f32(want_k), rtol=tol, atol=tol)
    np.testing.assert_array_equal(f32(v), f32(want_v))  # values are copied, not computed
    # Only the tokens' slots changed; padding tokens wrote nothing.
    written = np.zeros(k_pages.shape[1] * k_pages.shape[2], bool)
    written[np.asarray(slots)[np.asarray(slots) >= 0]] = True
    flat = lambda a: f32(a).reshape(a.shape[0], -1, head_dim)  # noqa: E731
    np.testing.assert_array_equal(flat(k)[:, ~written], flat(k_pages)[:, ~written])
    assert not np.array_equal(flat(k)[:, written], flat(k_pages)[:, written])
    if norm:  # each written key head has the norm's weights' scale, not the input's
        unnormed = rope_and_write_kv_reference(qkv, pos, inv_freq, k_pages, v_pages, slots,
                                               num_heads=heads)
        assert not np.allclose(f32(q), f32(unnormed[0]), atol=0.1)


def test_apply_rope_matches_a_float64_rotation():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 16)).astype(np.float32)
    pos = np.array([0, 1, 517, 99_999], np.int32)
    inv_freq = rope_inv_freq(get_preset("llama3.2-1b").replace(head_dim=16))
    ang = pos[:, None].astype(np.float64) * inv_freq.astype(np.float64)  # [N, 8]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    lo, hi = x[..., :8].astype(np.float64), x[..., 8:].astype(np.float64)
    want = np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), inv_freq))
    # float32 angles of positions near 1e5 carry about 1e-3 of absolute error
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=0)
    np.testing.assert_allclose(got[:3], want[:3], atol=1e-5, rtol=0)


def test_validation_and_fallbacks():
    rng = np.random.default_rng(0)
    inv_freq = rope_inv_freq(get_preset("llama3.2-1b").replace(head_dim=32))
    qkv, pos, k_pages, v_pages, slots = make_case(
        rng, num_tokens=4, num_heads=4, num_kv_heads=2, head_dim=32, page_size=8, num_pages=4,
        dtype=jnp.float32, fused=True)
    with pytest.raises(ValueError, match="qkv"):
        rope_and_write_kv(qkv[:, :-1], pos, inv_freq, k_pages, v_pages, slots, num_heads=4)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_and_write_kv(qkv, pos, inv_freq, k_pages, v_pages, slots[:3], num_heads=4)
    k_quant = zero_pages(k_pages.shape, jnp.int8)
    v_quant = zero_pages(v_pages.shape, jnp.int8)
    with pytest.raises(ValueError, match="quantized pages"):  # an explicit kernel request
        rope_and_write_kv(qkv, pos, inv_freq, k_quant, v_quant, slots, num_heads=4, impl=IMPL)
    # With the GPU's kernel choice, int8 pages take the jnp path (the kernel stores no scales).
    gpu = KernelBackends(platform="gpu", kv_write=IMPL)
    got = rope_and_write_kv(qkv, pos, inv_freq, k_quant, v_quant, slots, num_heads=4,
                            kernels=gpu)
    want = rope_and_write_kv_reference(qkv, pos, inv_freq, k_quant, v_quant, slots,
                                       num_heads=4)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got[1].values.dtype == jnp.int8 and float(jnp.abs(got[1].scales).sum()) > 0


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("fused,norm,d", [(True, False, 128), (False, False, 128),
                                          (True, True, 128), (True, True, 96)])
def test_lowers_to_triton_for_h200(h200_lowering, fused, norm, d):
    spec = jax.ShapeDtypeStruct
    h, kvh = 32, 8
    qkv = (spec((1, (h + 2 * kvh) * d), jnp.bfloat16) if fused else
           (spec((1, h * d), jnp.bfloat16), spec((1, kvh * d), jnp.bfloat16),
            spec((1, kvh * d), jnp.bfloat16)))
    pages = spec((kvh, 64, 16, d), jnp.bfloat16)
    inv_freq = rope_inv_freq(get_preset("llama3.1-8b").replace(head_dim=d))
    weights = (spec((d,), jnp.bfloat16),) * 2 if norm else ()

    def f(qkv, pos, k, v, slots, *weights):
        qk_norm = (*weights, 1e-6) if weights else None
        return rope_and_write_kv(qkv, pos, inv_freq, k, v, slots, num_heads=h, qk_norm=qk_norm,
                                 impl="pallas")

    text = jax.jit(f).trace(qkv, spec((1,), jnp.int32), pages, pages, spec((1,), jnp.int32),
                            *weights).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and h200_lowering
    assert len(h200_lowering) == 1  # one kernel: the norms are inside it
