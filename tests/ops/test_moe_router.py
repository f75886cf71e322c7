"""ops.moe_router: the router of a mixture's decode rows (RMSNorm, logits, top-k, weights) as one
kernel, against float64 numpy on fresh random inputs and against the unfused jnp ops; exact ties
take the lower expert first; lowering for an H200.

On the CPU the kernel runs interpreted; on a GPU compiled.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.moe_router import kernel_refusal, route, route_rows, route_rows_reference

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"
BF16_ULP = 2.0 ** -8  # bfloat16's unit roundoff (half its spacing near 1)


def operands(seed: int, n: int, hidden: int, experts: int):
    rng = np.random.default_rng(seed)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    return (bf(3.0 * rng.standard_normal((n, hidden))),
            bf(1.0 + 0.3 * rng.standard_normal(hidden)),
            bf(rng.standard_normal((hidden, experts)) / np.sqrt(hidden) * 4.0))


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("n,hidden,experts,top_k,normalize", [
    (1, 256, 128, 8, True),    # qwen3-30b-a3b's routing, one decode row
    (5, 512, 8, 2, True),      # Mixtral's
    (3, 96, 24, 4, False)])    # unnormalized weights, E and hidden not powers of two
def test_kernel_against_float64(n, hidden, experts, top_k, normalize):
    """The normed rows within one bf16 rounding of float64's (of x and the norm weight); the
    experts the k largest float64 logits of those rows, up to logits within two bf16 roundings
    of the k-th; the weights float64's softmax (over the k, or over all E unnormalized) of the
    chosen logits within what their bf16 rounding moves them."""
    x, norm_weight, router = operands(n + hidden, n, hidden, experts)
    normed, weights, chosen = route_rows(x, norm_weight, 1e-6, router, top_k=top_k,
                                         normalize=normalize, impl=IMPL)
    assert normed.dtype == jnp.bfloat16 and weights.dtype == jnp.float32
    assert chosen.dtype == jnp.int32 and chosen.shape == weights.shape == (n, top_k)
    xs = f64(x)
    want_normed = xs / np.sqrt(np.mean(xs * xs, axis=1, keepdims=True) + 1e-6) * f64(norm_weight)
    np.testing.assert_array_less(np.abs(f64(normed) - want_normed),
                                 3 * BF16_ULP * np.abs(want_normed) + 1e-6)
    logits = f64(normed) @ f64(router)  # [N, E] float64 of the kernel's normed rows
    tol = 2 * 2 * BF16_ULP * np.abs(logits).max(axis=1, keepdims=True)  # two roundings
    ours = np.take_along_axis(logits, np.asarray(chosen), axis=1)  # [N, k]
    kth = np.sort(logits, axis=1)[:, ::-1][:, top_k - 1:top_k]
    assert np.all(ours >= kth - tol) and all(len(set(r)) == top_k for r in np.asarray(chosen))
    assert np.all(np.diff(ours, axis=1) <= tol)  # largest first
    if normalize:
        want = np.exp(ours - ours.max(1, keepdims=True))
        want /= want.sum(1, keepdims=True)
    else:
        top = logits.max(1, keepdims=True)
        want = np.exp(ours - (top + np.log(np.exp(logits - top).sum(1, keepdims=True))))
    # each logit rounded once to bf16 (2^-8 of the largest at most) moves a softmax weight w by
    # at most w x twice that
    shift = 2 * BF16_ULP * np.abs(logits).max(axis=1, keepdims=True)
    np.testing.assert_array_less(np.abs(np.asarray(weights) - want), want * shift + 1e-6)


@pytest.mark.parametrize("normalize", [True, False])
def test_kernel_matches_the_unfused_ops(normalize):
    """Against the jnp path (rms_norm_reference, the bf16 product, route): the normed rows
    within one bf16 rounding, and where no logit is within two bf16 roundings of the k-th (the
    two sum the logits in different orders) the same experts, the weights within what one bf16
    rounding of a logit moves them (2e-2; interpreted on the CPU they are equal)."""
    x, norm_weight, router = operands(7, 6, 128, 32)
    got = route_rows(x, norm_weight, 1e-5, router, top_k=4, normalize=normalize, impl=IMPL)
    want = route_rows_reference(x, norm_weight, 1e-5, router, 4, normalize)
    np.testing.assert_allclose(f64(got[0]), f64(want[0]), rtol=2 * BF16_ULP, atol=1e-6)
    logits = f64(want[0]) @ f64(router)
    gaps = np.abs(np.sort(logits, 1)[:, ::-1][:, 3] - np.sort(logits, 1)[:, ::-1][:, 4])
    clear = gaps > 4 * BF16_ULP * np.abs(logits).max(1)
    assert clear.sum() >= 3  # most rows have no near-tie at the k-th place
    np.testing.assert_array_equal(np.asarray(got[2])[clear], np.asarray(want[2])[clear])
    np.testing.assert_allclose(np.asarray(got[1])[clear], np.asarray(want[1])[clear],
                               rtol=0, atol=2e-2)


def test_exact_ties_take_the_lower_expert_first():
    """Router columns repeated: equal logits. The kernel orders them as jax.lax.top_k (and
    `route`) does: the lower expert first."""
    x, norm_weight, router = operands(3, 2, 64, 4)
    router = jnp.concatenate([router, router], axis=1)  # experts e and e + 4 tie
    _, weights, chosen = route_rows(x, norm_weight, 1e-6, router, top_k=4, normalize=True,
                                    impl=IMPL)
    _, want_weights, want = route_rows_reference(x, norm_weight, 1e-6, router, 4, True)
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(want))
    for row in np.asarray(chosen):
        pairs = [(e, e + 4) for e in range(4) if e in row and e + 4 in row]
        assert pairs and all(list(row).index(a) < list(row).index(b) for a, b in pairs)
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6)


def test_route_is_softmax_then_top_k():
    """`route` (top-k of the logits first) against float64 softmax over all E, then top-k."""
    logits = np.random.default_rng(1).standard_normal((5, 16)) * 3
    for normalize in (True, False):
        weights, experts = route(jnp.asarray(logits, jnp.float32), 3, normalize)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        want_experts = np.argsort(-probs, axis=1, kind="stable")[:, :3]
        want = np.take_along_axis(probs, want_experts, axis=1)
        if normalize:
            want /= want.sum(1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(experts), want_experts)
        np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)


def test_dispatch_and_bad_input():
    """float32 rows and more than MAX_ROWS rows take the jnp path with impl None (the kernel
    refuses them, naming why); shapes that do not fit raise ValueError."""
    x, norm_weight, router = operands(0, 2, 64, 8)
    assert kernel_refusal(x.astype(jnp.float32), norm_weight, router, 2)
    assert kernel_refusal(jax.ShapeDtypeStruct((65, 64), jnp.bfloat16), norm_weight, router, 2)
    assert kernel_refusal(x, norm_weight, router, 2) is None
    with pytest.raises(ValueError, match="bf16"):
        route_rows(x.astype(jnp.float32), norm_weight, 1e-6, router, top_k=2, normalize=True,
                   impl=IMPL)
    with pytest.raises(ValueError, match="do not fit"):
        route_rows(x, norm_weight[:5], 1e-6, router, top_k=2, normalize=True)
    with pytest.raises(ValueError, match="do not fit"):
        route_rows(x, norm_weight, 1e-6, router, top_k=9, normalize=True)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("hidden,experts,top_k", [(2048, 128, 8), (4096, 8, 2)],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_lowers_to_triton_for_h200(h200_lowering, hidden, experts, top_k):
    spec = jax.ShapeDtypeStruct
    text = jax.jit(lambda x, w, r: route_rows(x, w, 1e-6, r, top_k=top_k, normalize=True,
                                              impl="pallas")).trace(
        spec((4, hidden), jnp.bfloat16), spec((hidden,), jnp.bfloat16),
        spec((hidden, experts), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert '"moe_router_logits"' in text and '"moe_router_top_k"' in text and h200_lowering
