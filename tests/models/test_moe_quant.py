"""Quantized experts: the grouped product over INT8 / INT4 codes against float64 numpy on
codes packed here, and a quantized mixture of experts end to end (RTN per expert)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import get_preset
from engine.perplexity import full_sequence_logits
from models.moe import moe_mlp
from models.weights import random_model
from ops import moe_matmul
from ops.moe_matmul import grouped_coded_matmul
from quant.model import QuantConfig, quantize_model
from quant.qtensor import dequantize

ZERO = {8: 128, 4: 8}


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """[E, K, N] codes < 16 -> int32 [E, K/8, N]: row 8i + j of a column in bits 4j..4j+3."""
    e, k, n = codes.shape
    words = np.zeros((e, k // 8, n), np.uint32)
    for j in range(8):
        words |= codes[:, j::8, :].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


@pytest.mark.parametrize("form", moe_matmul.FORMS)
@pytest.mark.parametrize("bits,group,symmetric", [(8, 0, True), (8, 0, False), (4, 16, False),
                                                  (4, 24, True), (4, 0, True)])
def test_grouped_coded_matmul_matches_float64(monkeypatch, form, bits, group, symmetric):
    monkeypatch.setattr(moe_matmul, "TILE_ROWS", 4)
    rows = 13
    rng = np.random.default_rng(bits * 100 + group + symmetric)
    e, k, n = 5, 40, 24
    size = group or k
    g = -(-k // size)
    codes = rng.integers(0, 2 ** bits, (e, k, n))
    scales = rng.uniform(0.01, 0.05, (e, g, n)).astype(np.float32)
    offsets = None if symmetric else rng.uniform(-0.3, 0.3, (e, g, n)).astype(np.float32)
    per_row = lambda a: np.repeat(a.astype(np.float64), size, axis=1)[:, :k]  # noqa: E731
    w = per_row(scales) * (codes - ZERO[bits] if symmetric else codes)
    if not symmetric:
        w = w + per_row(offsets)
    sizes = rng.multinomial(rows - 3, np.ones(e) / e).astype(np.int32)  # 3 spare rows
    sizes[1] = 0
    sizes[0] += rows - 3 - sizes.sum()
    x = rng.standard_normal((rows, k)).astype(np.float32)
    want = np.zeros((rows, n))
    start = 0
    for i in range(e):
        want[start:start + sizes[i]] = x[start:start + sizes[i]] @ w[i]
        start += sizes[i]
    packed = pack_int4(codes) if bits == 4 else codes.astype(np.uint8)
    # bfloat16 once per form (its rounding is not the point here), float32 for every format
    for dtype, tol in ((jnp.float32, 1e-5),) + (((jnp.bfloat16, 2e-2),) if bits == 4 and
                                                 group == 16 else ()):
        got = grouped_coded_matmul(jnp.asarray(x, dtype), jnp.asarray(packed),
                                   jnp.asarray(scales), None if symmetric else
                                   jnp.asarray(offsets), jnp.asarray(sizes), bits=bits,
                                   group_size=size, form=form)
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err < tol, (dtype, err)


def test_quantized_experts_end_to_end():
    cfg = get_preset("tiny-qwen3-moe")
    model = random_model(cfg, seed=5)
    quantize_model(cfg, model, QuantConfig("int4_rtn", group_size=16), progress=False)
    layer = model.layers[0].mlp
    codes = layer.gate_proj.kernel.get_value()
    assert codes.packed.shape[0] == cfg.num_experts and codes.scales.shape[0] == cfg.num_experts
    # the layer over codes computes what it computes over their dequantized float experts
    weights = {name: getattr(layer, name).kernel.get_value()
               for name in ("gate_proj", "up_proj", "down_proj")}
    dense = {name: jax.vmap(dequantize)(w) for name, w in weights.items()}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((9, cfg.hidden_size)), jnp.float32)
    router = layer.router.kernel.get_value()
    settings = dict(top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob,
                    hidden_act="silu")
    np.testing.assert_allclose(moe_mlp(x, router, weights, **settings),
                               moe_mlp(x, router, dense, **settings), rtol=1e-4, atol=1e-5)
    # and the whole quantized model runs through the engine's step
    ids = (np.arange(10)[None] * 37 + 5) % cfg.vocab_size
    assert np.isfinite(np.asarray(full_sequence_logits(cfg, model, ids))).all()
    with pytest.raises(ValueError, match="RTN only"):
        quantize_model(cfg, model, QuantConfig("int4_gptq"), np.zeros((1, 8), np.int32))
