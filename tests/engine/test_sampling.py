"""engine.sampling (sample, filtered_logits) and SamplingParams validation, against numpy."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.request import SamplingParams
from engine.sampling import filtered_logits, sample, sampling_mode

VOCAB = 32


def run_sample(logits, temperature, top_k, top_p, seeds, steps):
    return np.asarray(sample(jnp.asarray(logits, jnp.float32),
                             jnp.asarray(temperature, jnp.float32),
                             jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
                             jnp.asarray(seeds, jnp.uint32), jnp.asarray(steps, jnp.int32)))


def numpy_kept(logits, temperature, top_k, top_p):
    """The set kept by top-k then top-p, in float64: sort, renormalize over the top-k, keep the
    tokens whose preceding mass is < top_p (at least one)."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled)
    k = len(scaled) if top_k == 0 else min(top_k, len(scaled))
    top = scaled[order[:k]]
    probs = np.exp(top - top.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    n = max(int((before < top_p).sum()), 1)
    keep = np.zeros(len(scaled), bool)
    keep[order[:n]] = True
    return keep


def numpy_distribution(logits, temperature, top_k, top_p):
    keep = numpy_kept(logits, temperature, top_k, top_p)
    scaled = np.asarray(logits, np.float64) / temperature
    p = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    return p / p.sum()


def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(0)
    b = 8
    logits = rng.standard_normal((b, VOCAB)) * 3
    tokens = run_sample(logits, np.zeros(b), rng.integers(0, 5, b), rng.uniform(0.05, 1, b),
                        rng.integers(0, 2**32, b), rng.integers(0, 100, b))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_top_k_one_is_argmax_at_any_temperature():
    rng = np.random.default_rng(1)
    b = 8
    for temperature in (0.3, 1.0, 5.0, 100.0):
        logits = rng.standard_normal((b, VOCAB))
        tokens = run_sample(logits, np.full(b, temperature), np.ones(b), np.ones(b),
                            rng.integers(0, 2**32, b), rng.integers(0, 100, b))
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_filtered_logits_keep_exactly_the_right_set():
    rng = np.random.default_rng(2)
    b = 64
    logits = rng.standard_normal((b, VOCAB)) * rng.uniform(0.5, 4, (b, 1))
    temperature = rng.uniform(0.2, 2.0, b)
    top_k = np.where(rng.random(b) < 0.5, 0, rng.integers(1, VOCAB + 5, b))  # incl. > vocab
    top_p = np.where(rng.random(b) < 0.3, 1.0, rng.uniform(0.01, 1.0, b))
    top_p[:3] = 1e-6  # keeps only the most likely token
    out = np.asarray(filtered_logits(jnp.asarray(logits, jnp.float32),
                                     jnp.asarray(temperature, jnp.float32),
                                     jnp.asarray(top_k, jnp.int32),
                                     jnp.asarray(top_p, jnp.float32)))
    sizes = []
    for i in range(b):
        keep = numpy_kept(logits[i], temperature[i], top_k[i], top_p[i])
        np.testing.assert_array_equal(np.isfinite(out[i]), keep, err_msg=f"row {i}")
        np.testing.assert_allclose(out[i][keep], (logits[i] / temperature[i])[keep], rtol=1e-6)
        assert (out[i][~keep] == -np.inf).all()
        sizes.append(keep.sum())
    assert min(sizes) == 1 and max(sizes) == VOCAB and len(set(sizes)) > 10  # varied cuts


def test_top_k_alone_and_top_p_alone():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((1, VOCAB)).astype(np.float32)
    one = jnp.ones(1, jnp.float32)
    for k in (1, 2, 5, VOCAB - 1):
        out = np.asarray(filtered_logits(jnp.asarray(logits), one, jnp.full(1, k, jnp.int32), one))
        assert set(np.flatnonzero(np.isfinite(out[0]))) == set(np.argsort(-logits[0])[:k])
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    for n in (1, 2, 6):
        # top_p just above the mass of the first n - 1 tokens keeps exactly n tokens.
        p = probs[order[:n - 1]].sum() + 1e-4
        out = np.asarray(filtered_logits(jnp.asarray(logits), one, jnp.zeros(1, jnp.int32),
                                         jnp.full(1, p, jnp.float32)))
        assert set(np.flatnonzero(np.isfinite(out[0]))) == set(order[:n])


def test_top_p_one_cuts_nothing_even_when_the_tail_underflows():
    """top_p = 1.0 is 'no nucleus cut': far-tail tokens stay even where the float32 mass before
    them rounds to 1.0 (a cut comparing that mass with top_p would drop them)."""
    rng = np.random.default_rng(0)
    peaked = np.r_[10.0, 9.5, -np.linspace(0, 30, VOCAB - 2)]
    logits = np.stack([rng.standard_normal(VOCAB) * 8, peaked, peaked,
                       np.linspace(20.0, -20.0, VOCAB)])
    temperature = np.array([0.25, 0.5, 1.0, 0.5])
    out = filtered_logits(jnp.asarray(logits, jnp.float32), jnp.asarray(temperature, jnp.float32),
                          jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.float32))
    assert np.isfinite(np.asarray(out)).all()


def test_empirical_distribution_matches_renormalized_nucleus():
    rng = np.random.default_rng(4)
    vocab, n = 8, 20000
    logits = np.sort(rng.standard_normal(vocab) * 1.5)[::-1].astype(np.float32)
    temperature, top_p = 0.7, 0.9
    expected = numpy_distribution(logits, temperature, 0, top_p)
    assert 2 <= (expected > 0).sum() < vocab  # the nucleus cuts something and keeps several
    tokens = run_sample(np.broadcast_to(logits, (n, vocab)), np.full(n, temperature),
                        np.zeros(n), np.full(n, top_p), np.arange(n) * 7919 + 3,
                        rng.integers(0, 50, n))
    counts = np.bincount(tokens, minlength=vocab)
    assert (counts[expected == 0] == 0).all(), "drew a token outside the nucleus"
    empirical = counts / n
    # E[TV] <= 0.5 * sqrt(k / n) for k categories; allow four times that.
    bound = 4 * 0.5 * np.sqrt((expected > 0).sum() / n)
    tv = 0.5 * np.abs(empirical - expected).sum()
    assert tv < bound, (tv, bound, empirical, expected)
    # The bound is tight enough to notice a wrong temperature or a missing top-p cut.
    for wrong in (numpy_distribution(logits, 1.0, 0, top_p),
                  numpy_distribution(logits, temperature, 0, 1.0)):
        assert 0.5 * np.abs(wrong - expected).sum() > 2 * bound


def test_row_draw_depends_only_on_its_seed_and_step():
    rng = np.random.default_rng(5)
    b = 8
    logits = rng.standard_normal((b, VOCAB)).astype(np.float32)
    temperature = np.full(b, 1.5)
    top_k = np.zeros(b, np.int64)
    top_p = np.ones(b)
    seeds = rng.integers(0, 2**32, b)
    steps = rng.integers(0, 1000, b)
    full = run_sample(logits, temperature, top_k, top_p, seeds, steps)
    for i in range(b):  # alone, batch size 1
        alone = run_sample(logits[i:i + 1], temperature[:1], top_k[:1], top_p[:1],
                           seeds[i:i + 1], steps[i:i + 1])
        assert alone[0] == full[i], i
    perm = rng.permutation(b)
    shuffled = run_sample(logits[perm], temperature, top_k, top_p, seeds[perm], steps[perm])
    np.testing.assert_array_equal(shuffled, full[perm])
    # Other rows changed entirely (different logits, seeds, steps): rows 0..2 keep their draws.
    other = np.concatenate([logits[:3], rng.standard_normal((5, VOCAB))]).astype(np.float32)
    mixed = run_sample(other, temperature, top_k, top_p,
                       np.concatenate([seeds[:3], rng.integers(0, 2**32, 5)]),
                       np.concatenate([steps[:3], rng.integers(0, 1000, 5)]))
    np.testing.assert_array_equal(mixed[:3], full[:3])
    # ... and the draw does depend on the seed and on the step (flat logits: uniform over 32).
    flat = np.zeros((b, VOCAB), np.float32)
    by_seed = run_sample(flat, temperature, top_k, top_p, np.arange(b), np.zeros(b))
    by_step = run_sample(flat, temperature, top_k, top_p, np.full(b, 7), np.arange(b))
    assert len(set(by_seed.tolist())) > 3 and len(set(by_step.tolist())) > 3


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
    ("temperature", -0.5), ("temperature", float("nan")), ("top_k", -1), ("seed", -1),
    ("seed", 2**32),
])
def test_sampling_params_validation(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_valid_edges():
    SamplingParams(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    SamplingParams(temperature=2.0, top_k=1, top_p=1e-3, seed=2**32 - 1)


def test_sampling_modes_draw_the_same_tokens_as_the_general_path():
    """The host-chosen modes ("greedy": argmax only; "plain": no sort) draw exactly the tokens of
    mode "cuts" (every row through the cuts) on the rows they serve, and `sampling_mode` picks
    the cheapest mode that serves every row."""
    rng = np.random.default_rng(21)
    b = 64
    logits = jnp.asarray(rng.normal(0, 2, (b, VOCAB)), jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, b), jnp.uint32)
    steps = jnp.asarray(rng.integers(0, 100, b), jnp.int32)
    temperature = np.where(rng.random(b) < 0.3, 0.0, rng.uniform(0.3, 2.0, b)).astype(np.float32)
    none_k, none_p = np.zeros(b, np.int32), np.ones(b, np.float32)
    none_min = np.zeros(b, np.float32)
    args = lambda t, k, p, m: (logits, jnp.asarray(t), jnp.asarray(k), jnp.asarray(p),  # noqa: E731
                               seeds, steps, jnp.asarray(m))
    plain = np.asarray(sample(*args(temperature, none_k, none_p, none_min), mode="plain"))
    general = np.asarray(sample(*args(temperature, none_k, none_p, none_min), mode="cuts"))
    np.testing.assert_array_equal(plain, general)
    greedy_rows = temperature == 0
    assert (plain[~greedy_rows] != np.argmax(np.asarray(logits), -1)[~greedy_rows]).any()
    zeros = np.zeros(b, np.float32)
    np.testing.assert_array_equal(np.asarray(sample(*args(zeros, none_k, none_p, none_min),
                                                    mode="greedy")),
                                  np.argmax(np.asarray(logits), -1))
    assert sampling_mode(zeros, rng.integers(0, 5, b), none_p * 0.5, none_min) == "greedy"
    assert sampling_mode(temperature, none_k, none_p, none_min) == "plain"
    cut_on_greedy_row = none_k.copy()
    cut_on_greedy_row[np.argmax(greedy_rows)] = 3  # a cut on a greedy row needs no sort
    assert sampling_mode(temperature, cut_on_greedy_row, none_p, none_min) == "plain"
    for k, p, m in ((none_k + 5, none_p, none_min), (none_k, none_p * 0.9, none_min),
                    (none_k, none_p, none_min + 0.1)):
        assert sampling_mode(temperature, k, p, m) == "cuts"
    with pytest.raises(ValueError, match="sampling mode"):
        sample(*args(temperature, none_k, none_p, none_min), mode="fast")
