"""Transposed layers (models.llama.transpose_for_gemv, ModelConfig.gemv_layers) compute the same
function: greedy tokens equal and log-probabilities within rounding against the model as loaded
(float weights, or INT8 / INT4 codes stored transposed with their scales).

Steps of at most ops.gemv.MAX_ROWS tokens run `fused_gemv` (norm, SiLU x up, bias and residual
inside one product each); longer ones multiply by the transposed weights in XLA. On the CPU
`fused_gemv` runs its jnp reference in float32; the bf16 case runs the Pallas kernel
interpreted against that reference.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops.expert_gemm
import ops.expert_gemv
import ops.gemv
import ops.moe_router
import ops.quant_wgmma
from configs.model import TINY_LLAMA31, TINY_QWEN2, TINY_QWEN3_MOE
from engine.request import SamplingParams
from models.llama import fuse_projections, transpose_for_gemv
from models.weights import model_from_pure_dict
from ops.backends import select_kernels
from ops.matmul import TransposedWeight, dequantize_rows
from quant.model import QuantConfig, quantize_model
from quant.qtensor import QuantizedWeight, dequantize, make_quantized_weight
from tests.engine.test_fused_kernels import (ENGINE_CFG, assert_same_generations,
                                             assert_same_up_to_a_near_tie, generate,
                                             model_and_prompts)
from tests.engine.weights import unit_scale_pure_dict


def count_gemv_calls(monkeypatch) -> tuple[dict, dict]:
    """Counts fused_gemv calls by number of rows (traced calls: once per program): (all calls,
    {kind: calls}) with kind "gated" (gate/up), "down" (a residual added to a product whose
    input is wider than the residual: the MLP's down) or "o" (the other residual product)."""
    calls: dict[int, int] = {}
    kinds: dict[str, dict[int, int]] = {"gated": {}, "o": {}, "down": {}}
    inner = ops.gemv.fused_gemv

    def counted(x, *args, **kwargs):
        residual = kwargs.get("residual")
        kind = ("gated" if kwargs.get("gated") else None if residual is None
                else "down" if x.shape[1] > residual.shape[1] else "o")
        for counts in (calls, kinds[kind]) if kind else (calls,):
            counts[x.shape[0]] = counts.get(x.shape[0], 0) + 1
        return inner(x, *args, **kwargs)
    monkeypatch.setattr(ops.gemv, "fused_gemv", counted)
    return calls, kinds


def fused_case(base, seed: int, method: str | None, group: int, head: bool = False):
    """(cfg, the unit-scale model quantized by `method` (groups of `group`, 0: 128; `head`: the
    output head too) and fused, two prompts of 6 and 15 tokens, their SamplingParams: 6 and 10
    greedy tokens with log-probabilities)."""
    cfg, model, prompts = model_and_prompts(base, seed, False, (6, 15))
    if method:
        model = quantize_model(cfg, model, QuantConfig(method, group_size=group or 128,
                                                       lm_head=head), progress=False)
    cfg, model = fuse_projections(cfg, model)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    return cfg, model, prompts, [params, dataclasses.replace(params, max_tokens=10)]


@pytest.mark.parametrize("base,method,group,k_order,head,apart", [
    (TINY_QWEN2, None, 0, None, False, False), (TINY_LLAMA31, "int4_rtn", 32, None, False, False),
    (TINY_LLAMA31, "int4_rtn", 32, "wgmma", True, True),
    (TINY_LLAMA31, "int8", 0, "wgmma", False, False)])
def test_transposed_layers_give_the_same_tokens(monkeypatch, base, method, group, k_order,
                                                head, apart):
    """float32 products (a GPU's default is TF32), two prompts: decode at two rows, then one
    (the fused path once the shorter is done), prefill chunks (XLA's). Float weights on Qwen2's
    layout (one KV head for four query heads, a q/k/v bias, a tied head; the bf16 test below
    runs Llama 3.1's), and INT4 codes (asymmetric: scales and offsets per group of 32) stored
    [out, in] against the same quantized model as fused. (INT8 codes: the kernel and `linear`
    in tests/ops/test_gemv.py, an INT8 checkpoint end to end in tests/quant/test_scripts_quant.py.)
    k_order "wgmma": the codes reordered along K for the Hopper kernel (INT4 and INT8), which
    every product here (the fused one included) reads through x permuted to match. `head`:
    the untied output head quantized too (QuantConfig.lm_head), stored transposed like the
    layers; a float head keeps its layout. `apart` (ops.gemv.runs_apart always True): gate/up
    at one row as norm, `linear` and SiLU x up (what an H200 runs for INT4), o and down as
    `linear` then the residual added: only q/k/v fused."""
    if apart:
        monkeypatch.setattr(ops.gemv, "runs_apart", lambda *args, **kwargs: True)
    cfg, model, prompts, params = fused_case(base, 11, method, group, head)
    with jax.default_matmul_precision("highest"):
        want = generate(model, cfg, prompts, params)
        calls, kinds = count_gemv_calls(monkeypatch)
        jax.clear_caches()
        cfg_t, model = transpose_for_gemv(cfg, model, k_order)
        assert cfg_t.gemv_layers and not cfg.gemv_layers
        weight = model.layers[0].mlp.gate_up_proj.kernel.get_value()
        if method:
            assert weight.k_order == (k_order or "natural")  # a CPU: natural by default
        if method == "int4_rtn":
            k = weight.shape[0]
            assert weight.w_t.dtype == jnp.int32 and weight.w_t.shape[1] == k // 8
            assert weight.scales.shape == weight.offsets.shape == (-(-k // group),
                                                                    weight.shape[1])
        if not cfg.tie_word_embeddings:
            out_head = model.lm_head.kernel.get_value()
            assert isinstance(out_head, TransposedWeight) == head
            if head:
                assert out_head.k_order == k_order and out_head.shape == (cfg.hidden_size,
                                                                          cfg.vocab_size)
        got = generate(model, cfg_t, prompts, params)
    assert calls.get(1, 0) > 0 and max(calls) <= ops.gemv.MAX_ROWS
    for kind in ("gated", "o", "down"):  # apart: never fused
        assert bool(kinds[kind].get(1)) == (not apart), kind
    assert_same_generations(got, want, rtol=1e-5)


@pytest.mark.parametrize("method", [None, "int4_rtn"])
def test_a_mixture_of_experts_transposes_its_attention(monkeypatch, method):
    """tiny-qwen3-moe (q/k norms, 8 experts, 3 per token), float or INT4 codes in groups of
    32: q/k/v and o stored transposed and run by fused_gemv at one row (the input norm and the
    residual inside), the experts kept in their layout for the MoE layer; the same tokens."""
    cfg, model, prompts, params = fused_case(TINY_QWEN3_MOE, 5, method, 32)
    with jax.default_matmul_precision("highest"):
        want = generate(model, cfg, prompts, params)
        calls, kinds = count_gemv_calls(monkeypatch)
        jax.clear_caches()
        cfg_t, model = transpose_for_gemv(cfg, model)
        layer = model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj.kernel.get_value(), TransposedWeight)
        assert not isinstance(layer.mlp.gate_up_proj.kernel.get_value(), TransposedWeight)
        got = generate(model, cfg_t, prompts, params)
    assert kinds["o"].get(1) and not kinds["gated"] and not kinds["down"]
    # q/k/v and o of the one traced layer that every layer calls (models.llama.run_layer)
    assert cfg.num_layers > 1 and calls.get(1, 0) == 2
    assert_same_generations(got, want, rtol=1e-5)


@pytest.mark.parametrize("product", ["gated", "o", "down"])
def test_runs_apart_choice(monkeypatch, product):
    """Fused without the Hopper kernel in the kernel choice, for float weights and INT8 codes,
    and for o; INT4 gate/up and down apart where the Hopper kernel takes them. A bad product
    is named. (Only shapes and dtypes are read.)"""
    spec = jax.ShapeDtypeStruct
    scales = spec((4, 256), jnp.bfloat16)
    int4 = TransposedWeight(spec((256, 64), jnp.int32), scales, None, 128)  # [N, K/8] words
    int8 = TransposedWeight(spec((256, 512), jnp.uint8), spec((1, 256), jnp.bfloat16))
    bf16 = TransposedWeight(spec((256, 512), jnp.bfloat16))
    apart = functools.partial(ops.gemv.runs_apart, rows=1, product=product)
    hopper = select_kernels("gpu", hopper=True)
    assert not apart(int4) and not apart(int4, kernels=select_kernels("gpu"))
    assert apart(int4, kernels=hopper) == (
        product != "o"
        and ops.quant_wgmma.supports(4, 1, 512, 256, 128, jnp.bfloat16, jnp.bfloat16))
    assert not apart(int8, kernels=hopper) and not apart(bf16, kernels=hopper)
    with pytest.raises(ValueError, match="product 'qkv'"):
        ops.gemv.runs_apart(int4, 1, product="qkv")


def test_bf16_kernel_matches_the_reference(monkeypatch):
    """bf16 activations over INT4 codes in groups of 32 (the kernel's most involved path:
    the model's wiring is the same for bf16 weights and INT8 codes, whose kernels run
    interpreted in tests/ops/test_gemv.py): the interpreted kernel against the reference path,
    same tokens and log-probabilities within bf16 rounding."""
    cfg = TINY_LLAMA31.replace(num_heads=4, num_kv_heads=2, head_dim=16)
    model = model_from_pure_dict(cfg, unit_scale_pure_dict(cfg, 13), jnp.bfloat16)
    model = quantize_model(cfg, model, QuantConfig("int4_rtn", group_size=32), progress=False)
    cfg, model = transpose_for_gemv(*fuse_projections(cfg, model))
    prompts = [[5, 9, 44, 7], [3, 100, 21, 8, 90, 4, 17]]
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    params = [params, dataclasses.replace(params, max_tokens=9)]  # one row for 5 steps
    want = generate(model, cfg, prompts, params)
    monkeypatch.setenv("PALLASITE_GEMV", "pallas_interpret")
    calls, _ = count_gemv_calls(monkeypatch)
    jax.clear_caches()
    got = generate(model, cfg, prompts, params)
    assert calls.get(1, 0) > 0
    assert_same_generations(got, want, rtol=2e-2)


def test_transposed_codes_are_the_same_weight():
    """QuantizedWeight.transposed: x @ dequantize(w) is x @ dequantize_rows(transposed)^T, for
    INT8 per channel with and without an act-order permutation (undone), and INT4 in groups
    (a shorter last group) with and without offsets; act-order INT4 is refused."""
    rng = np.random.default_rng(int(np.random.randint(1 << 30)))
    k, n = 48, 10
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    uniform = lambda *shape: jnp.asarray(rng.uniform(0.01, 0.02, shape), jnp.float32)  # noqa
    cases = [(8, k, None, None), (8, k, None, rng.permutation(k)), (4, 32, None, None),
             (4, 16, uniform(3, n), None)]
    for bits, group, offsets, perm in cases:
        codes = rng.integers(0, 2 ** bits, (k, n))
        w = make_quantized_weight(codes, uniform(-(-k // group), n), offsets, bits=bits,
                                  group_size=group, perm=perm)
        t = w.transposed()
        assert t.shape == w.shape == (k, n)
        got = x @ dequantize_rows(t.w_t, t.scales, t.offsets, t.group_size).T
        np.testing.assert_allclose(np.asarray(got), np.asarray(x @ dequantize(w)), rtol=1e-5,
                                   atol=1e-6)
    w = make_quantized_weight(rng.integers(0, 16, (k, n)), uniform(3, n), None, bits=4,
                              group_size=16, perm=rng.permutation(k))
    with pytest.raises(ValueError, match="act-order 4-bit weights in groups of 16 cannot be "
                                         "stored transposed"):
        w.transposed()


def act_order_last_down(model, rng) -> None:
    """Gives the last layer's down_proj an act-order INT4 weight (random codes, groups of 32),
    which cannot be stored transposed."""
    last = model.layers[-1].mlp.down_proj
    k, n = last.kernel.get_value().shape
    last.kernel.set_value(make_quantized_weight(
        rng.integers(0, 16, (k, n)), jnp.asarray(rng.uniform(0.01, 0.02, (-(-k // 32), n))),
        None, bits=4, group_size=32, perm=rng.permutation(k)))


def test_transpose_errors_leave_the_model_whole():
    cfg, model, _ = model_and_prompts(TINY_LLAMA31, 3, False, ())
    with pytest.raises(ValueError, match="fuse the projections first"):
        transpose_for_gemv(cfg, model)
    qcfg, qmodel = fuse_projections(cfg, quantize_model(cfg, model, QuantConfig("int4_rtn"),
                                                        progress=False))
    act_order_last_down(qmodel, np.random.default_rng(5))
    with pytest.raises(ValueError, match="transpose_for_gemv: act-order 4-bit weights"):
        transpose_for_gemv(qcfg, qmodel)
    assert all(isinstance(lin.kernel.get_value(), QuantizedWeight)
               for layer in qmodel.layers for lin in (layer.self_attn.qkv_proj,
                                                      layer.mlp.gate_up_proj))  # untouched
    cfg, model = transpose_for_gemv(*fuse_projections(*model_and_prompts(
        TINY_LLAMA31, 3, False, ())[:2]))
    with pytest.raises(ValueError, match="already transposed"):
        transpose_for_gemv(cfg, model)


@pytest.mark.gpu
@pytest.mark.skipif(not ops.quant_wgmma.on_hopper(), reason="needs a Hopper GPU (wgmma)")
def test_wgmma_steps_give_the_tokens_of_the_triton_paths(monkeypatch):
    """A bf16 model with INT4 codes (groups of 128) stored transposed, shapes the Hopper kernel
    takes: decode steps of one (gate/up) to three rows run ops/quant_wgmma.py in one row tile,
    the prefill of a 90-token prompt in row tiles, and give the greedy tokens of the Triton "nk"
    and XLA paths (PALLASITE_WGMMA=off), log-probabilities within bf16 rounding."""
    cfg = TINY_LLAMA31.replace(hidden_size=256, intermediate_size=512, num_heads=4,
                               num_kv_heads=2, head_dim=64)
    model = model_from_pure_dict(cfg, unit_scale_pure_dict(cfg, 21), jnp.bfloat16)
    model = quantize_model(cfg, model, QuantConfig("int4_rtn", group_size=128), progress=False)
    cfg, model = transpose_for_gemv(*fuse_projections(cfg, model))
    long_prompt = np.random.default_rng(5).integers(3, cfg.vocab_size, 90).tolist()
    prompts = [[5, 9, 44, 7], [3, 100, 21, 8, 90, 4, 17], long_prompt]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    rows: list[int] = []
    inner = ops.quant_wgmma.wgmma_matmul

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return inner(x, *args, **kwargs)
    monkeypatch.setattr(ops.quant_wgmma, "wgmma_matmul", counted)
    # whole prompts in one prefill step (the default test engine's chunks are 16 tokens)
    engine_cfg = dataclasses.replace(ENGINE_CFG, max_model_len=128, max_num_batched_tokens=128)
    got = generate(model, cfg, prompts, params, engine_cfg)
    # (one row: gate/up and down, ops.gemv.runs_apart; the other one-row products: ops/gemv.py)
    assert rows and max(rows) > ops.quant_wgmma.MAX_ROWS  # row tiles
    assert any(r <= ops.quant_wgmma.MAX_ROWS for r in rows)  # decode steps: one tile
    monkeypatch.setenv("PALLASITE_WGMMA", "off")
    jax.clear_caches()
    rows.clear()
    want = generate(model, cfg, prompts, params, engine_cfg)
    assert not rows
    assert_same_generations(got, want, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the kernels compiled")
def test_a_mixture_decode_through_the_gpu_kernels_gives_the_reference_tokens(monkeypatch):
    """bf16 tiny-qwen3-moe at shapes the GPU kernels take (hidden 256, head_dim 64, 8 experts
    [256, 128]), INT4 codes in groups of 128, prepared as a GPU prepares it (fused, attention
    transposed): its decode steps run the q/k norms inside the RoPE kernel, q/k/v and o in
    ops/gemv.py, the norm and router in ops/moe_router.py and the one-row expert kernel over
    IndexedRows and GatedRows; its prefill (11 tokens, 33 pairs over 8 experts) the grouped
    expert kernel (ops/expert_gemm.py). They give the greedy tokens of every op's reference
    path (PALLASITE_ATTENTION/GEMV/MOE/MATMUL=reference) up to a near-tie, log-probabilities
    within bf16 rounding."""
    cfg = TINY_QWEN3_MOE.replace(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                 moe_intermediate_size=128)
    model = model_from_pure_dict(cfg, unit_scale_pure_dict(cfg, 24), jnp.bfloat16)
    model = quantize_model(cfg, model, QuantConfig("int4_rtn", group_size=128), progress=False)
    cfg, model = transpose_for_gemv(*fuse_projections(cfg, model))
    prompts = [[5, 9, 44, 7], [3, 100, 21, 8, 90, 4, 17]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    calls = []
    inner, router = ops.expert_gemv.expert_gemv, ops.moe_router._route_rows_pallas
    grouped = ops.expert_gemm.expert_group_matmul
    monkeypatch.setattr(ops.expert_gemv, "expert_gemv",
                        lambda *a, **kw: calls.append(type(a[0]).__name__) or inner(*a, **kw))
    monkeypatch.setattr(ops.moe_router, "_route_rows_pallas",
                        lambda *a, **kw: calls.append("router") or router(*a, **kw))
    monkeypatch.setattr(ops.expert_gemm, "expert_group_matmul",
                        lambda *a, **kw: calls.append("grouped") or grouped(*a, **kw))
    got = generate(model, cfg, prompts, params)
    assert {"IndexedRows", "GatedRows", "router", "grouped"} <= set(calls)
    for family in ("ATTENTION", "GEMV", "MOE", "MATMUL"):
        monkeypatch.setenv(f"PALLASITE_{family}", "reference")
    jax.clear_caches()
    calls.clear()
    want = generate(model, cfg, prompts, params)
    assert not calls
    # This model's next-token distributions are nearly flat (top two often within 0.01), and
    # the two paths round differently in bf16 (log-probabilities apart by up to 0.02 on an
    # H100), so a greedy flip may come where the reference leads by under 0.05; before it the
    # tokens must agree.
    assert_same_up_to_a_near_tie(got, want, rtol=2e-2, tie=0.05)


def test_auto_transposes_quantized_models_on_hopper():
    """gemv_layers None (auto, models.prepare.transpose_as_wanted): a quantized model on a
    Hopper GPU is stored transposed; a float model, a mixture of experts, another device, a
    mesh or an explicit False leave it as it is; an act-order model that auto cannot transpose
    stays whole with a note, where gemv_layers=True asked for it is an error."""
    from models.llama import has_quantized_layers
    from models.prepare import gemv_wanted, transpose_as_wanted
    assert gemv_wanted(None, True, True, None)
    assert not gemv_wanted(None, True, True, object())  # a mesh
    assert not gemv_wanted(None, True, False, None) and not gemv_wanted(None, False, True, None)
    assert gemv_wanted(True, False, False, None) and not gemv_wanted(False, True, True, None)
    assert not gemv_wanted(None, True, True, None, mixture=True)
    assert gemv_wanted(True, True, True, None, mixture=True)

    def fused(method=None):  # a fresh fused model, quantized by `method`
        cfg, model, _ = model_and_prompts(TINY_LLAMA31, 3, False, ())
        if method:
            model = quantize_model(cfg, model, QuantConfig(method), progress=False)
        return fuse_projections(cfg, model)

    fcfg, fmodel = fused()
    assert not has_quantized_layers(fmodel)
    assert transpose_as_wanted(fcfg, fmodel, None, True) == (fcfg, fmodel, [])  # float: as it was
    qcfg, qmodel = fused("int8")
    assert has_quantized_layers(qmodel)
    for requested, hopper in ((None, False), (False, True)):
        assert not transpose_as_wanted(qcfg, qmodel, requested, hopper)[0].gemv_layers
    tcfg, tmodel, notes = transpose_as_wanted(qcfg, qmodel, None, True)
    assert tcfg.gemv_layers and isinstance(tmodel.layers[0].mlp.down_proj.kernel.get_value(),
                                           TransposedWeight)
    assert notes == ["model: layers transposed for the batch-1 gemv kernel (auto: quantized, "
                     "Hopper GPU)"]
    mcfg, mmodel, _, _ = fused_case(TINY_QWEN3_MOE, 4, "int4_rtn", 0)
    assert has_quantized_layers(mmodel)
    assert transpose_as_wanted(mcfg, mmodel, None, True) == (mcfg, mmodel, [])  # a mixture
    acfg, amodel = fused("int4_rtn")
    act_order_last_down(amodel, np.random.default_rng(int(np.random.randint(1 << 30))))
    out_cfg, _, notes = transpose_as_wanted(acfg, amodel, None, True)
    assert not out_cfg.gemv_layers and "left in [in, out] (transpose_for_gemv: act-order" in (
        notes[0])
    with pytest.raises(ValueError, match="gemv_layers: transpose_for_gemv: act-order"):
        transpose_as_wanted(acfg, amodel, True, True)
