"""quant.gptq: GPTQ's layer output error ||XW - XQ|| below RTN's, on random and real layers."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ops.matmul import linear
from quant.calibration import LayerwiseRunner, calibration_ids
from quant.gptq import gptq_quantize, hessian
from quant.qtensor import dequantize
from quant.rtn import quantize_rtn


def output_error(x, w, q) -> float:
    x = jnp.asarray(x, jnp.float32)
    return float(jnp.linalg.norm(x @ jnp.asarray(w) - linear(x, q)))


def correlated_inputs(tokens, k, seed):
    """Activations with correlated channels of very different sizes, like a real layer's."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(k, k)) / np.sqrt(k)
    x = rng.normal(size=(tokens, k)) @ mix * rng.lognormal(0, 1, k)
    return x.astype(np.float32)


@pytest.mark.parametrize("bits, group_size, symmetric, act_order", [
    (4, 32, True, False), (4, 64, False, False), (4, -1, False, False), (4, 128, True, True),
    (4, 64, False, True), (8, -1, True, False)])
def test_gptq_beats_rtn_on_random_layers(bits, group_size, symmetric, act_order):
    k, n = 256, 96
    x = correlated_inputs(1024, k, seed=k + group_size)
    w = np.random.default_rng(1).normal(size=(k, n)).astype(np.float32) * 0.05
    q = gptq_quantize(w, hessian(x), bits, group_size, symmetric, act_order=act_order)
    assert (q.perm is not None) == act_order and q.symmetric == symmetric
    rtn = quantize_rtn(jnp.asarray(w), bits, group_size, symmetric)
    gptq_err, rtn_err = output_error(x, w, q), output_error(x, w, rtn)
    assert gptq_err < 0.9 * rtn_err, (gptq_err, rtn_err)


def test_gptq_handles_dead_inputs_and_a_short_last_group():
    k, n = 72, 16  # groups of 32: 32, 32, 8
    x = correlated_inputs(512, k, seed=3)
    x[:, 10] = 0.0  # an input channel that never fires
    w = np.random.default_rng(4).normal(size=(k, n)).astype(np.float32)
    q = gptq_quantize(w, hessian(x), 4, 32, symmetric=False, act_order=True)
    assert q.scales.shape == (3, n)
    assert np.all(np.isfinite(np.asarray(dequantize(q))))
    assert output_error(x, w, q) < output_error(x, w, quantize_rtn(jnp.asarray(w), 4, 32, False))


def test_gptq_beats_rtn_on_real_smollm2_layers(smollm2):
    """Layers 0 and 3 of the real model, on 512 tokens of the built-in calibration text."""
    ids, _ = calibration_ids(smollm2.tokenizer, None, 512, 256)
    runner = LayerwiseRunner(smollm2.cfg, smollm2.model, ids)
    x = runner.embed()
    for index in range(4):
        record = ("q_proj", "down_proj") if index in (0, 3) else ()
        y, rec = runner.run_layer(index, x, record=record)
        for name in record:
            parent = smollm2.model.layers[index].self_attn if name == "q_proj" else \
                smollm2.model.layers[index].mlp
            w = np.asarray(getattr(parent, name).kernel.get_value())
            xs = np.asarray(rec[name])
            q = gptq_quantize(w, hessian(xs), 4, 128, symmetric=False)
            rtn = quantize_rtn(jnp.asarray(w), 4, 128, symmetric=False)
            gptq_err, rtn_err = output_error(xs, w, q), output_error(xs, w, rtn)
            assert gptq_err < 0.95 * rtn_err, (index, name, gptq_err, rtn_err)
        x = y
