"""quant.awq: folding the scales keeps the float model, and the search never loses to RTN."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import TINY_GEMMA3, TINY_LLAMA31, TINY_QWEN2
from engine.perplexity import full_sequence_logits
from models.weights import random_model
from quant import awq
from quant.rtn import fake_quantize


@pytest.mark.parametrize("cfg", [TINY_LLAMA31, TINY_QWEN2, TINY_GEMMA3], ids=lambda c: c.name)
def test_awq_scaled_float_model_equals_the_unscaled_one(cfg):
    """GQA (v -> o scales per KV channel) and q/k/v biases (Qwen2) included."""
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 24))
    model = random_model(cfg, seed=3)
    before = full_sequence_logits(cfg, model, ids)
    rng = np.random.default_rng(1)
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    for layer in model.layers:
        scales = {name: jnp.asarray(rng.lognormal(0, 1, size), jnp.float32)
                  for name, size in (("qkv", h), ("vo", kv), ("mlp", h), ("down", i))}
        awq.apply_scales(layer, cfg, scales)
    after = full_sequence_logits(cfg, model, ids)
    np.testing.assert_allclose(after, before, rtol=2e-4, atol=2e-4)
    # ... while the weights did change.
    assert not np.allclose(np.asarray(model.layers[0].input_layernorm.weight.get_value()), 1.0)


def test_scale_search_includes_rtn_and_picks_the_smallest_block_error():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(256, 64)) * rng.lognormal(0, 1.5, 64), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 32)) * 0.1, jnp.float32)
    s, alpha, losses = awq.search_scale(jnp.mean(jnp.abs(x), 0), {"w": w},
                                        lambda fake: x @ fake["w"], x @ w, 4, 32, False)
    rtn_loss = float(jnp.mean((x @ fake_quantize(w, 4, 32, False) - x @ w) ** 2))
    np.testing.assert_allclose(losses[0], rtn_loss, rtol=1e-5)  # alpha = 0 is plain RTN
    assert min(losses) == losses[int(round(alpha * awq.SCALE_GRID))] and min(losses) < rtn_loss
    assert s.shape == (64,) and float(jnp.min(s)) > 0


def test_clip_search_lowers_each_groups_error():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(512, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_t(2, size=(64, 16)) * 0.1, jnp.float32)  # heavy tails
    ratios = awq.search_clip(w, x, 4, 32, False)
    assert ratios.shape == (2, 16) and float(ratios.min()) < 1.0
    clipped = fake_quantize(awq.clip_weights(w, ratios, 32), 4, 32, False)
    plain = fake_quantize(w, 4, 32, False)
    assert float(jnp.linalg.norm(x @ clipped - x @ w)) < float(jnp.linalg.norm(x @ plain - x @ w))
