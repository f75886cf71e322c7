"""Transposed layers (models.llama.transpose_for_gemv, ModelConfig.gemv_layers) compute the same
function: greedy tokens equal and log-probabilities within rounding against the model as loaded
(float weights, or INT8 per-channel codes stored transposed with their scales).

Steps of at most ops.gemv.MAX_ROWS tokens run `fused_gemv` (norm, SiLU x up, bias and residual
inside one product each); longer ones multiply by the transposed weights in XLA. On the CPU
`fused_gemv` runs its jnp reference in float32; the bf16 case runs the Pallas kernel
interpreted against that reference.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops.gemv
from configs.model import TINY_LLAMA31, TINY_QWEN2
from engine.request import SamplingParams
from models.llama import fuse_projections, transpose_for_gemv
from models.weights import model_from_pure_dict
from ops.matmul import dequantize_rows
from quant.model import QuantConfig, quantize_model
from quant.qtensor import QuantizedWeight, dequantize, make_quantized_weight
from tests.engine.test_fused_kernels import assert_same_generations, generate, model_and_prompts
from tests.engine.weights import unit_scale_pure_dict


def count_gemv_calls(monkeypatch) -> dict:
    """Counts fused_gemv calls by number of rows (traced calls: once per program)."""
    calls: dict[int, int] = {}
    inner = ops.gemv.fused_gemv

    def counted(x, *args, **kwargs):
        calls[x.shape[0]] = calls.get(x.shape[0], 0) + 1
        return inner(x, *args, **kwargs)
    monkeypatch.setattr(ops.gemv, "fused_gemv", counted)
    return calls


def test_transposed_layers_give_the_same_tokens(monkeypatch):
    """float32 products (a GPU's default is TF32), two prompts: decode at two rows, then one
    (the fused path once the shorter is done), prefill chunks (XLA's), on Qwen2's layout: one
    KV head for four query heads, a q/k/v bias, a tied head. (The bf16 test below runs Llama
    3.1's.)"""
    cfg, model, prompts = model_and_prompts(TINY_QWEN2, 11, True, (6, 19))
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    with jax.default_matmul_precision("highest"):
        want = generate(model, cfg, prompts, [params, dataclasses.replace(params, max_tokens=12)])
        calls = count_gemv_calls(monkeypatch)
        jax.clear_caches()
        cfg_t, model = transpose_for_gemv(cfg, model)
        assert cfg_t.gemv_layers and not cfg.gemv_layers
        got = generate(model, cfg_t, prompts,
                       [params, dataclasses.replace(params, max_tokens=12)])
    assert calls.get(1, 0) > 0 and max(calls) <= ops.gemv.MAX_ROWS
    assert_same_generations(got, want, rtol=1e-5)


def test_bf16_kernel_matches_the_reference(monkeypatch):
    """bf16 weights: the interpreted kernel against the reference path, same tokens and
    log-probabilities within bf16 rounding."""
    cfg = TINY_LLAMA31.replace(num_heads=4, num_kv_heads=2, head_dim=16)
    model = model_from_pure_dict(cfg, unit_scale_pure_dict(cfg, 13), jnp.bfloat16)
    cfg, model = transpose_for_gemv(*fuse_projections(cfg, model))
    prompts = [[5, 9, 44, 7], [3, 100, 21, 8, 90, 4, 17]]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    params = [params, dataclasses.replace(params, max_tokens=9)]  # one row for 5 steps
    want = generate(model, cfg, prompts, params)
    monkeypatch.setenv("PALLASITE_GEMV", "pallas_interpret")
    calls = count_gemv_calls(monkeypatch)
    jax.clear_caches()
    got = generate(model, cfg, prompts, params)
    assert calls.get(1, 0) > 0
    assert_same_generations(got, want, rtol=2e-2)


@pytest.mark.parametrize("method", ["int8", "int8_asym"])
def test_int8_transposed_layers_give_the_same_tokens(monkeypatch, method):
    """INT8 per-channel weights stored transposed (codes [out, in] with their scales) against
    the same quantized model as fused: float32 activations, same tokens and log-probabilities."""
    cfg, model, prompts = model_and_prompts(TINY_LLAMA31, 17, False, (5, 11))
    cfg, model = fuse_projections(cfg, quantize_model(cfg, model, QuantConfig(method),
                                                      progress=False))
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    params = [params, dataclasses.replace(params, max_tokens=9)]
    with jax.default_matmul_precision("highest"):
        want = generate(model, cfg, prompts, params)
        calls = count_gemv_calls(monkeypatch)
        jax.clear_caches()
        cfg, model = transpose_for_gemv(cfg, model)
        weight = model.layers[0].mlp.gate_up_proj.kernel.get_value()
        assert weight.w_t.dtype == jnp.uint8 and weight.scales.ndim == 1
        assert (weight.offsets is None) == (method == "int8")
        got = generate(model, cfg, prompts, params)
    assert calls.get(1, 0) > 0
    assert_same_generations(got, want, rtol=1e-5)


def test_int8_bf16_kernel_matches_the_reference(monkeypatch):
    """bf16 activations over INT8 codes: the interpreted kernel against the reference path."""
    cfg = TINY_LLAMA31.replace(num_heads=4, num_kv_heads=2, head_dim=16)
    model = model_from_pure_dict(cfg, unit_scale_pure_dict(cfg, 19), jnp.bfloat16)
    model = quantize_model(cfg, model, QuantConfig("int8"), progress=False)
    cfg, model = transpose_for_gemv(*fuse_projections(cfg, model))
    prompts = [[8, 61, 2, 33, 9], [12, 7, 70, 5]]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    params = [params, dataclasses.replace(params, max_tokens=8)]  # one row for 4 steps
    want = generate(model, cfg, prompts, params)
    monkeypatch.setenv("PALLASITE_GEMV", "pallas_interpret")
    calls = count_gemv_calls(monkeypatch)
    jax.clear_caches()
    got = generate(model, cfg, prompts, params)
    assert calls.get(1, 0) > 0
    assert_same_generations(got, want, rtol=2e-2)


def test_transposed_codes_undo_act_order():
    """QuantizedWeight.transposed: codes in input-channel order, so x @ dequantize(w) is
    x @ dequantize_rows(transposed)^T, with and without an act-order permutation."""
    rng = np.random.default_rng(int(np.random.randint(1 << 30)))
    k, n = 24, 10
    codes = rng.integers(0, 256, (k, n))
    scales = jnp.asarray(rng.uniform(0.01, 0.02, (1, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    for perm in (None, rng.permutation(k)):
        w = make_quantized_weight(codes, scales, None, bits=8, group_size=k, perm=perm)
        t = w.transposed()
        assert t.w_t.shape == (n, k) and t.shape == w.shape
        np.testing.assert_allclose(np.asarray(x @ dequantize_rows(t.w_t, t.scales).T),
                                   np.asarray(x @ dequantize(w)), rtol=1e-5, atol=1e-6)


def test_transpose_errors_leave_the_model_whole():
    cfg, model, _ = model_and_prompts(TINY_LLAMA31, 3, False, ())
    with pytest.raises(ValueError, match="fuse the projections first"):
        transpose_for_gemv(cfg, model)
    qcfg, qmodel = fuse_projections(cfg, quantize_model(cfg, model, QuantConfig("int4_rtn"),
                                                        progress=False))
    with pytest.raises(ValueError, match="4-bit weights in groups of .* only INT8 with "
                                         "per-channel scales"):
        transpose_for_gemv(qcfg, qmodel)
    assert all(isinstance(layer.mlp.down_proj.kernel.get_value(), QuantizedWeight)
               for layer in qmodel.layers)  # nothing transposed
    cfg, model = transpose_for_gemv(*fuse_projections(*model_and_prompts(
        TINY_LLAMA31, 3, False, ())[:2]))
    with pytest.raises(ValueError, match="already transposed"):
        transpose_for_gemv(cfg, model)
