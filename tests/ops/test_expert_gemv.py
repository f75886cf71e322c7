"""ops.expert_gemv (x [M, K] @ w[expert[m]] per row, bf16) against float64 numpy on fresh random
inputs, its dispatch and fallback, and its lowering for an H200, alone and in a tiny mixture's
decode step.

On the CPU the kernel runs interpreted on small shapes; on a GPU the same cases run compiled and
qwen3-30b-a3b's decode shapes are added.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import get_preset
from models.moe import moe_mlp
from ops import expert_gemm as expert_gemm_module
from ops import expert_gemv as expert_gemv_module
from ops.backends import select_kernels
from ops.expert_gemm import expert_group_matmul
from ops.expert_gemv import (ExpertGemvConfig, expert_gemv, expert_gemv_config,
                              expert_rows_coded_matmul, expert_rows_matmul, kernel_refusal)
from ops.kernel_choice import KernelBackends
from ops.matmul import code_bits
from ops.moe_matmul import GatedRows, IndexedRows, rows_coded_matmul, rows_matmul
from quant.model import quantize_experts
from tests.marks import gpu_picks
from tests.models.lowering import lowered_step_text

ON_GPU = jax.default_backend() == "gpu"
# (M, E, K, N, variant, config): bf16 experts, INT8 codes (per channel or groups of g K rows,
# symmetric or asym) and INT4 words; no split, even and uneven K splits, prefetch off, the
# default tiles
CASES = [
    (3, 5, 64, 48, "bf16", ExpertGemvConfig(block_n=16, block_k=16, splits=1)),
    (8, 6, 128, 64, "bf16", ExpertGemvConfig(block_n=32, block_k=16, splits=4)),
    (8, 4, 128, 32, "bf16", ExpertGemvConfig(block_n=16, block_k=16, splits=3, prefetch=False)),
    (5, 3, 96, 80, "bf16", None),
    (3, 5, 64, 48, "int8", ExpertGemvConfig(block_n=16, block_k=16, splits=2)),
    (8, 4, 128, 32, "int8_g32_asym", ExpertGemvConfig(block_n=16, block_k=16, splits=3)),
    (5, 3, 128, 64, "int4_g32", ExpertGemvConfig(block_n=32, block_k=32, splits=2,
                                                 prefetch=False)),
    (8, 6, 256, 32, "int4_g128_asym", None),
    (3, 4, 96, 16, "int4_asym", ExpertGemvConfig(block_n=16, block_k=32, splits=1)),
]


def operands(seed: int, m: int, e: int, k: int, n: int, variant: str = "bf16"):
    """bf16 x [M, K], experts [E, K, N] (bf16 values, or codes with the keyword arguments of
    their scales) of fresh random values, and random expert ids [M] with a repeat (two rows of
    one expert)."""
    rng = np.random.default_rng(seed)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    x = bf(rng.standard_normal((m, k)) + 0.3)
    expert = rng.integers(0, e, m)
    expert[-1] = expert[0]
    expert = jnp.asarray(expert, jnp.int32)
    if variant == "bf16":
        return x, bf(rng.standard_normal((e, k, n)) / np.sqrt(k)), expert, {}
    int4 = variant.startswith("int4")
    levels = 16 if int4 else 256
    group = int(variant.split("_")[1][1:]) if "_g" in variant else k
    codes = rng.integers(0, levels, (e, k, n))
    if int4:  # eight codes per int32 word, K row 8w + j in bits 4j..4j+3
        words = (codes.reshape(e, k // 8, 8, n).astype(np.uint32)
                 << (4 * np.arange(8, dtype=np.uint32))[None, None, :, None]).sum(
                     2, dtype=np.uint32)
        w = jnp.asarray(words.view(np.int32))
    else:
        w = jnp.asarray(codes, jnp.uint8)
    groups = -(-k // group)
    scales = bf(rng.uniform(0.5, 1.5, (e, groups, n)) / (0.29 * levels * np.sqrt(k)))
    kw = dict(scales=scales, offsets=None, group_size=group)
    if variant.endswith("asym"):  # offset -zero * scale, zero near the middle
        kw["offsets"] = bf(-scales.astype(jnp.float32)
                           * rng.uniform(0.375, 0.625, (e, groups, n)) * levels)
    return x, w, expert, kw


def float64_want(x, w, expert, scales=None, offsets=None, group_size=None) -> np.ndarray:
    """The products in float64 numpy from the bf16 operands, codes turned into their values
    (quant/qtensor.py) group by group."""
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    if scales is None:
        values = f(w)
    else:
        codes = np.asarray(w)
        if codes.dtype == np.int32:
            codes = (codes.view(np.uint32)[:, :, None, :]
                     >> (4 * np.arange(8, dtype=np.uint32))[None, None, :, None]) & 0xF
            codes = codes.reshape(w.shape[0], -1, w.shape[2])
        codes = codes.astype(np.float64)
        k = codes.shape[1]
        per_k = lambda a: np.repeat(f(a), group_size, axis=1)[:, :k]  # noqa: E731
        zero = 8 if w.dtype == jnp.int32 else 128
        values = (per_k(scales) * (codes - zero) if offsets is None
                  else per_k(scales) * codes + per_k(offsets))
    xs = f(x)
    return np.stack([xs[r] @ values[i] for r, i in enumerate(np.asarray(expert))])


def check(out, want):
    """bf16 outputs: within one bf16 rounding (2^-8 relative) of the float64 value, plus float32
    sums' error (1e-4 of the largest value)."""
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert out.shape == want.shape and np.all(np.isfinite(out))
    np.testing.assert_array_less(np.abs(out - want),
                                 2.0 ** -8 * np.abs(want) + 1e-4 * np.abs(want).max())


def reference(x, w, expert, scales=None, offsets=None, group_size=None):
    if scales is None:
        return rows_matmul(x, w, expert)
    return rows_coded_matmul(x, w, scales, offsets, expert, bits=code_bits(w),
                             group_size=group_size)


@pytest.mark.parametrize("m,e,k,n,variant,config", gpu_picks(CASES, set(range(len(CASES)))))
def test_kernel_against_float64(m, e, k, n, variant, config):
    x, w, expert, kw = operands(m * 100 + k + n, m, e, k, n, variant)
    out = expert_gemv(x, w, expert, config=config, interpret=not ON_GPU, **kw)
    assert out.dtype == jnp.bfloat16
    want = float64_want(x, w, expert, **kw)
    check(out, want)
    with jax.default_matmul_precision("highest"):  # a GPU's default TF32 is coarser than bf16
        check(reference(x, w, expert, **kw), want)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["bf16", "int4_g32"])
def test_indexed_rows_read_in_place(variant):
    """IndexedRows: each of 6 rows reads its token's row of x [3, K] in place (two pairs per
    token, as a decode step's pairs of top-k 2), against float64 of the gathered rows."""
    x, w, expert, kw = operands(21, 6, 4, 64, 32, variant)
    tokens = x[:3]
    index = jnp.asarray([0, 0, 1, 1, 2, 2], jnp.int32)
    config = ExpertGemvConfig(block_n=16, block_k=32, splits=2)
    out = expert_gemv(IndexedRows(tokens, index), w, expert, config=config,
                      interpret=not ON_GPU, **kw)
    check(out, float64_want(tokens[index], w, expert, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("variant,act,config", [
    ("bf16", "silu", ExpertGemvConfig(block_n=16, block_k=16, splits=3)),
    ("int4_g32", "gelu_tanh", ExpertGemvConfig(block_n=16, block_k=32, splits=2))])
def test_gated_rows_between_two_products_against_float64(variant, act, config):
    """An expert MLP's two products as the MoE layer runs them: the gate-up product's split
    partials [S, M, 2 I] unsummed, then the down product over GatedRows of them, the kernel
    summing the partials and applying act(gate) * up as it loads them. Against float64: the
    partials' sum within float32 sums; the output within the bf16 rounding of the gated rows
    (each |h| 2^-8 at most, carried through |W_down|) and of the output."""
    m, e, hidden, inter = 5, 4, 96, 32  # K = 96: 6 or 3 tiles, split 3 or 2 ways
    x, gate_up, expert, kw_up = operands(11, m, e, hidden, 2 * inter, variant)
    _, down, _, kw_down = operands(12, m, e, inter, hidden, variant)
    partials = expert_gemv(x, gate_up, expert, config=config, partials=True,
                           interpret=not ON_GPU, **kw_up)
    assert partials.dtype == jnp.float32 and partials.shape[1:] == (m, 2 * inter)
    assert partials.shape[0] == config.splits
    sums = float64_want(x, gate_up, expert, **kw_up)  # [M, 2 I]
    total = np.asarray(jnp.sum(partials, axis=0), np.float64)
    np.testing.assert_allclose(total, sums, rtol=0, atol=1e-5 * np.abs(sums).max())
    gate, up = sums[:, :inter], sums[:, inter:]
    act64 = (gate / (1 + np.exp(-gate)) if act == "silu" else 0.5 * gate * (
        1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))))
    h = act64 * up  # [M, I] float64
    rows = GatedRows(partials, act, jnp.bfloat16)
    np.testing.assert_array_less(np.abs(np.asarray(rows.rows().astype(jnp.float32)) - h),
                                 2.0 ** -8 * np.abs(h) + 1e-6 * np.abs(h).max())
    out = expert_gemv(rows, down, expert, interpret=not ON_GPU, **kw_down)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, hidden)
    values = float64_want(jnp.eye(inter, dtype=jnp.bfloat16)[None].repeat(m, 0).reshape(
        m * inter, inter), down, jnp.repeat(expert, inter), **kw_down).reshape(m, inter, hidden)
    want = np.einsum("mk,mkn->mn", h, values)
    bound = 2.0 ** -8 * (np.einsum("mk,mkn->mn", np.abs(h), np.abs(values)) + np.abs(want))
    np.testing.assert_array_less(np.abs(np.asarray(out.astype(jnp.float32)) - want),
                                 bound + 1e-4 * np.abs(want).max())
    # The dispatch's reference path computes the same product from GatedRows.rows().
    ref = (expert_rows_matmul(rows, down, expert, partials=True) if variant == "bf16" else
           expert_rows_coded_matmul(rows, down, kw_down["scales"], kw_down["offsets"], expert,
                                    bits=4, group_size=32, partials=True))
    assert ref.shape == (1, m, hidden) and ref.dtype == jnp.float32
    np.testing.assert_array_less(np.abs(np.asarray(ref[0], np.float64) - want),
                                 bound + 1e-4 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: qwen3-30b-a3b's decode shapes run compiled")
@pytest.mark.parametrize("m,k,n,variant", [(8, 2048, 768, "bf16"), (8, 768, 2048, "bf16"),
                                           (128, 2048, 768, "bf16"), (8, 2048, 768, "int8"),
                                           (8, 768, 2048, "int4_g128"),
                                           (16, 2048, 768, "int4_g128_asym")])
def test_qwen3_moe_shapes_on_gpu(m, k, n, variant):
    x, w, expert, kw = operands(m + k, m, 16, k, n, variant)  # 16 of the 128 experts
    out = expert_gemv(x, w, expert, **kw)
    check(out, float64_want(x, w, expert, **kw))


def test_dispatch_follows_the_choice_and_falls_back():
    x, w, expert, _ = operands(7, 4, 5, 64, 32)
    ref = rows_matmul(x, w, expert)
    np.testing.assert_array_equal(expert_rows_matmul(x, w, expert), ref)  # kernels None
    interpreted = KernelBackends(moe="pallas_interpret")
    check(expert_rows_matmul(x, w, expert, kernels=interpreted), float64_want(x, w, expert))
    # shapes and dtypes the kernel does not take run the reference, whatever the choice
    odd = jnp.pad(w, ((0, 0), (0, 0), (0, 8)))  # N = 40: no whole column blocks
    assert "not whole tiles" in kernel_refusal(x, odd, expert)
    np.testing.assert_array_equal(expert_rows_matmul(x, odd, expert, kernels=interpreted),
                                  rows_matmul(x, odd, expert))
    x32 = x.astype(jnp.float32)
    assert "bf16" in kernel_refusal(x32, w, expert)
    np.testing.assert_array_equal(expert_rows_matmul(x32, w, expert, kernels=interpreted),
                                  rows_matmul(x32, w, expert))
    with pytest.raises(ValueError, match="impl 'triton'"):
        expert_rows_matmul(x, w, expert, impl="triton")


def test_coded_dispatch_follows_the_choice_and_falls_back():
    x, w, expert, kw = operands(9, 4, 3, 128, 32, "int4_g32_asym")
    codes = dict(bits=4, group_size=kw["group_size"])
    args = (x, w, kw["scales"], kw["offsets"], expert)
    want = float64_want(x, w, expert, **kw)
    np.testing.assert_array_equal(expert_rows_coded_matmul(*args, **codes),
                                  rows_coded_matmul(*args, **codes))  # kernels None
    interpreted = KernelBackends(moe="pallas_interpret")
    check(expert_rows_coded_matmul(*args, **codes, kernels=interpreted), want)
    # groups of 16 K rows: the default tiles shrink to them; 32-row tiles refuse them and the
    # reference runs
    x, w, expert, kw = operands(10, 4, 3, 128, 32, "int4_g16")
    args = (x, w, kw["scales"], None, expert)
    check(expert_rows_coded_matmul(*args, bits=4, group_size=16, kernels=interpreted),
          float64_want(x, w, expert, **kw))
    tiles = ExpertGemvConfig(block_n=16, block_k=32)
    assert "groups of 16 K rows" in kernel_refusal(x, w, expert, tiles, **kw)
    np.testing.assert_array_equal(
        expert_rows_coded_matmul(*args, bits=4, group_size=16, kernels=interpreted,
                                 config=tiles),
        rows_coded_matmul(*args, bits=4, group_size=16))
    with pytest.raises(ValueError, match="codes int32 are not 8-bit"):
        expert_rows_coded_matmul(*args, bits=8, group_size=16)


def test_bad_input_raises():
    x, w, expert, _ = operands(8, 3, 4, 32, 16)
    with pytest.raises(ValueError, match=r"x \(3, 16\) must be \[M, K\]"):
        expert_gemv(x[:, :16], w, expert, interpret=True)
    with pytest.raises(ValueError, match=r"expert ids \(2,\) int32 must be integers \[M\]"):
        expert_gemv(x, w, expert[:2], interpret=True)
    with pytest.raises(ValueError, match=r"expert ids \(3,\) float32"):
        expert_rows_matmul(x, w, expert.astype(jnp.float32))
    with pytest.raises(ValueError, match="the kernel takes bf16"):
        expert_gemv(x.astype(jnp.float32), w, expert, interpret=True)
    with pytest.raises(ValueError, match=r"not whole tiles \(16 x 64\)"):
        expert_gemv(x, w, expert, config=ExpertGemvConfig(block_n=64, block_k=16),
                    interpret=True)
    x, w, expert, kw = operands(8, 3, 4, 64, 16, "int8_g32")
    with pytest.raises(ValueError, match=r"scales \(4, 2, 8\) and offsets None must be"):
        expert_gemv(x, w, expert, scales=kw["scales"][:, :, :8], interpret=True)
    with pytest.raises(ValueError, match="2 groups of 16 K rows do not cover K=64"):
        expert_gemv(x, w, expert, scales=kw["scales"], group_size=16, interpret=True)
    with pytest.raises(ValueError, match="offsets without scales"):
        expert_gemv(x, w, expert, offsets=kw["scales"], interpret=True)
    with pytest.raises(ValueError, match="with scales, the experts hold uint8"):
        expert_gemv(x, w.astype(jnp.bfloat16), expert, **kw, interpret=True)
    with pytest.raises(ValueError, match=r"INT4 words \[E, K/8, N\]"):
        expert_gemv(x, w.astype(jnp.int32), expert, **kw, interpret=True)


@pytest.mark.parametrize("tokens,kernels_taking", [(2, ("gemv", "gemv")), (8, ("gemm", "gemv")),
                                                   (16, ("gemm", None))],
                         ids=["decode", "batched decode", "prefill"])
@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("fused", [False, True], ids=["gate, up", "gate_up"])
def test_a_mixture_step_through_the_kernel(monkeypatch, bits, tokens, kernels_taking, fused):
    """models.moe.moe_mlp of 8 experts, 3 per token, bf16 experts or asymmetric RTN INT4 codes
    in groups of 32, with the kernels chosen (interpreted) against the reference path: equal up
    to bf16 roundings of the rows between the products. 2 tokens (6 rows <= 8 experts) keep
    their rows in token order and take the one-row kernel for their three products (two with
    gate and up fused into one [E, hidden, 2 I]). 8 tokens (24 rows, 3 per expert) and 16 (6
    per expert) sort them by expert and take the grouped kernel (ops/expert_gemm.py); INT4
    groups of 32 are not whole K tiles of it, so there 8 tokens take the one-row kernel over
    the sorted rows and 16 tokens XLA's grouped products."""
    e, h, i, k = 8, 64, 32, 3
    keys = jax.random.split(jax.random.key(bits), 5)
    x = jax.random.normal(keys[0], (tokens, h), jnp.bfloat16)
    router = jax.random.normal(keys[1], (h, e), jnp.bfloat16)
    weights = {name: (jax.random.normal(key, shape) / np.sqrt(shape[1])).astype(jnp.bfloat16)
               for name, key, shape in (("gate_proj", keys[2], (e, h, i)),
                                        ("up_proj", keys[3], (e, h, i)),
                                        ("down_proj", keys[4], (e, i, h)))}
    if bits != 16:
        weights = {name: quantize_experts(w, bits, 32, False, jnp.bfloat16)
                   for name, w in weights.items()}
    settings = dict(top_k=k, normalize=True, hidden_act="silu")
    ref = moe_mlp(x, router, weights, **settings)
    if fused:  # as models.llama.fuse_projections stores them
        gate, up = weights.pop("gate_proj"), weights.pop("up_proj")
        weights["gate_up_proj"] = (jnp.concatenate([gate, up], axis=-1) if bits == 16 else
                                   dataclasses.replace(gate, **{
                                       f: None if getattr(gate, f) is None else jnp.concatenate(
                                           [getattr(gate, f), getattr(up, f)], axis=-1)
                                       for f in ("packed", "scales", "offsets")}))
    calls = []
    monkeypatch.setattr(expert_gemv_module, "expert_gemv",
                        lambda *a, **kw: calls.append("gemv") or expert_gemv(*a, **kw))
    monkeypatch.setattr(expert_gemm_module, "expert_group_matmul",
                        lambda *a, **kw: calls.append("gemm") or expert_group_matmul(*a, **kw))
    got = moe_mlp(x, router, weights, **settings, kernels=KernelBackends(moe="pallas_interpret"))
    taking = kernels_taking[bits == 4]
    assert calls == ([taking] * (2 if fused else 3) if taking else [])
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                               atol=2.0 ** -7 * float(np.abs(np.asarray(ref)).max()))


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("variant,prefetch", [("bf16", True), ("bf16", False), ("int8", True),
                                              ("int4_g128", False), ("int8_g128_asym", False),
                                              ("int4_asym", True)])
def test_lowers_to_triton_for_h200(h200_lowering, variant, prefetch):
    """qwen3-30b-a3b's gate shapes (8 rows, 128 experts [2048, 768]) as shapes only, the
    default tiles with prefetch on or off."""
    spec = jax.ShapeDtypeStruct
    e, k, n = 128, 2048, 768
    group = 128 if "_g128" in variant else k
    w = {"bf16": spec((e, k, n), jnp.bfloat16), "int8": spec((e, k, n), jnp.uint8),
         "int4": spec((e, k // 8, n), jnp.int32)}[variant.split("_")[0][:4]]
    scales = None if variant == "bf16" else spec((e, k // group, n), jnp.bfloat16)
    offsets = scales if variant.endswith("asym") else None
    bits = 16 if variant == "bf16" else int(variant[3])
    config = dataclasses.replace(expert_gemv_config(k, n, bits, group),
                                 prefetch=prefetch)
    text = jax.jit(lambda x, w, ex, s, o: expert_gemv(x, w, ex, scales=s, offsets=o,
                                                      group_size=group, config=config)).trace(
        spec((8, k), jnp.bfloat16), w, spec((8,), jnp.int32), scales, offsets).lower(
        lowering_platforms=("cuda",)).as_text()
    name = {"bf": "expert_gemv", "in": f"expert_gemv{variant[3]}"}[variant[:2]]
    assert f'"{name}"' in text and h200_lowering


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_rows_lower_to_triton_for_h200(h200_lowering, act):
    """qwen3-30b-a3b's down product (8 rows, INT4 experts [768, 2048] in groups of 128) over
    GatedRows of 8 float32 partials [8, 8, 1536]."""
    spec = jax.ShapeDtypeStruct
    e, k, n = 128, 768, 2048
    scales = spec((e, k // 128, n), jnp.bfloat16)
    text = jax.jit(lambda p, w, ex, s: expert_gemv(
        GatedRows(p, act, jnp.bfloat16), w, ex, scales=s, group_size=128, partials=True)).trace(
        spec((8, 8, 2 * k), jnp.float32), spec((e, k // 8, n), jnp.int32), spec((8,), jnp.int32),
        scales).lower(lowering_platforms=("cuda",)).as_text()
    assert '"expert_gemv4"' in text and h200_lowering


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("tokens", [2, 8], ids=["decode", "batched decode"])
@pytest.mark.parametrize("fused", [False, True])
def test_decode_step_of_a_tiny_mixture_reaches_the_kernel(h200_lowering, tokens, fused):
    """tiny-qwen3-moe's decode step (2 tokens x 3 experts: 6 rows <= 8 experts, in token
    order; 8 tokens: 24 rows sorted by expert) with the GPU's kernel choice runs its three
    expert products per layer (two with gate and up fused) through the one-row kernel, or for
    sorted rows the grouped kernel (ops/expert_gemm.py); with the reference choice, neither.
    Each distinct product is lowered once, in the one traced layer that every layer calls."""
    cfg = get_preset("tiny-qwen3-moe")
    shapes = dict(num_pages=8, page_size=4, tokens=tokens, seqs=tokens, width=4, fused=fused)
    gpu = select_kernels("gpu", hopper=True)
    assert gpu.moe == "pallas"
    text = lowered_step_text(cfg, gpu, **shapes)
    rows = tokens * cfg.num_experts_per_tok <= cfg.num_experts
    name, function = ("expert_gemv", "expert_gemv") if rows else ("expert_gemm",
                                                                  "expert_group_matmul")
    calls = re.findall(rf"call @{function}(?:_\d+)?\(", text)  # in the one traced layer
    layers = re.findall(r"call @_layer_program(?:_\d+)?\(", text)
    assert len(calls) == (2 if fused else 3) and h200_lowering
    assert len(layers) == cfg.num_layers > 1
    assert text.count(f'"{name}"') == 2  # gate-up (or gate and up alike) and down, once each
    text = lowered_step_text(cfg, dataclasses.replace(gpu, moe="reference"), **shapes)
    assert '"expert_gemv"' not in text and '"expert_gemm"' not in text
