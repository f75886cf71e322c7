"""Transposed layers (models.llama.transpose_for_gemv, ModelConfig.gemv_layers) compute the same
function: greedy tokens equal and log-probabilities within rounding against the model as loaded.

Steps of at most ops.gemv.MAX_ROWS tokens run `fused_gemv` (norm, SiLU x up, bias and residual
inside one product each); longer ones multiply by the transposed weights in XLA. On the CPU
`fused_gemv` runs its jnp reference in float32; the bf16 case runs the Pallas kernel
interpreted against that reference.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import ops.gemv
from configs.model import TINY_LLAMA31, TINY_QWEN2
from engine.request import SamplingParams
from models.llama import fuse_projections, transpose_for_gemv
from models.weights import model_from_pure_dict
from quant.model import QuantConfig, quantize_model
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


def test_transpose_errors_leave_the_model_whole():
    cfg, model, _ = model_and_prompts(TINY_LLAMA31, 3, False, ())
    with pytest.raises(ValueError, match="fuse the projections first"):
        transpose_for_gemv(cfg, model)
    qcfg, qmodel = fuse_projections(cfg, quantize_model(cfg, model, QuantConfig("int8"),
                                                        progress=False))
    with pytest.raises(ValueError, match="not float arrays"):
        transpose_for_gemv(qcfg, qmodel)
    cfg, model = transpose_for_gemv(*fuse_projections(*model_and_prompts(
        TINY_LLAMA31, 3, False, ())[:2]))
    with pytest.raises(ValueError, match="already transposed"):
        transpose_for_gemv(cfg, model)
