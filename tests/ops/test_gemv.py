"""ops.gemv (bf16 x @ w_t^T for a few rows, w_t bf16, INT8 or INT4 codes with their scales, with
RMSNorm, SiLU x up, bias and residual folded in) against a float64 numpy computation of the same
function on the same inputs.

On the CPU the Pallas kernel runs interpreted on small shapes (N not a multiple of the column
block, K not a multiple of the K block); on a GPU the same cases run compiled and the
Llama-3.1-8B layer shapes are added. A CPU test lowers every variant to Triton IR for an H200.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.gemv import GemvConfig, fused_gemv, gemv, gemv_reference
from ops.kernel_choice import KernelBackends
from ops.matmul import TransposedWeight, linear, reorder_k
from tests.marks import gpu_picks

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"
EPS = 1e-5
# (M, K, N of w_t, variant, config): variants name what is folded in
CASES = [
    (1, 256, 64, "plain", GemvConfig(8, 64, 4, 1)),
    (2, 200, 70, "norm_residual", GemvConfig(8, 64, 4, 1)),
    (1, 256, 96, "gated", GemvConfig(16, 128, 4, 1)),
    (3, 130, 40, "gated_residual", GemvConfig(8, 32, 4, 1)),
    (1, 192, 48, "norm_bias", GemvConfig(4, 128, 2, 2)),
    (2, 96, 36, "plain", None),  # gemv_config's tiles, masked on both axes
    # INT8 codes [N, K] with per-channel scales (symmetric), or scales and offsets (asym)
    (1, 256, 64, "int8", GemvConfig(8, 128, 4, 1)),
    (2, 196, 70, "int8_norm_residual", GemvConfig(8, 64, 4, 1, prefetch=True)),
    (1, 512, 96, "int8_gated", GemvConfig(16, 256, 4, 1)),
    (3, 132, 40, "asym_gated_residual", GemvConfig(8, 32, 4, 1)),
    (1, 192, 48, "asym_norm_bias", GemvConfig(4, 128, 2, 2)),
    (2, 96, 36, "int8", None),
    # INT4 words [N, K/8] in groups of g (per channel: g = K), tiles across groups
    (1, 256, 64, "int4_g64", GemvConfig(8, 256, 4, 1)),
    (2, 384, 70, "int4_g128_asym_norm_residual", GemvConfig(8, 128, 4, 1, prefetch=True)),
    (1, 512, 96, "int4_g32_gated", GemvConfig(16, 512, 4, 1)),
    (3, 136, 40, "int4_g136_asym_gated_residual", GemvConfig(8, 64, 4, 1)),
    (1, 320, 48, "int4_g128_norm_bias", None),  # a shorter last group
]
LLAMA_CASES = [(1, 4096, 6144, "norm"), (1, 4096, 4096, "residual"), (1, 4096, 28672, "gated"),
               (1, 14336, 4096, "residual"), (2, 4096, 28672, "gated"), (2, 14336, 4096, "residual"),
               (1, 4096, 6144, "int8_norm"), (1, 4096, 4096, "int8_residual"),
               (1, 4096, 28672, "int8_gated"), (1, 14336, 4096, "asym_residual"),
               (1, 4096, 28672, "int4_g128_gated"), (1, 14336, 4096, "int4_g128_asym_residual")]


def operands(seed: int, m: int, k: int, n: int, variant: str):
    """Fresh random bf16 operands (never zeros) and fused_gemv's keyword arguments."""
    rng = np.random.default_rng(seed)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    x = bf(rng.standard_normal((m, k)) + 0.3)
    gated = "gated" in variant
    n_out = n // 2 if gated else n
    kw = dict(gated=gated, eps=EPS)
    if variant.startswith(("int8", "asym", "int4")):  # codes; values of about the same size
        int4 = variant.startswith("int4")
        levels, group = (16, int(variant.split("_")[1][1:])) if int4 else (256, k)
        codes = rng.integers(0, levels, (n, k))
        if int4:  # eight codes per int32 word, K position 8w + j in bits 4j..4j+3
            words = (codes.reshape(n, k // 8, 8).astype(np.uint32)
                     << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
            w_t = jnp.asarray(words.view(np.int32))
            kw["group_size"] = group
        else:
            w_t = jnp.asarray(codes, jnp.uint8)
        groups = -(-k // group)
        kw["scales"] = bf(rng.uniform(0.5, 1.5, (groups, n)) / (0.29 * levels * np.sqrt(k)))
        if "asym" in variant:  # offset -zero * scale, zero near the middle
            kw["offsets"] = bf(-kw["scales"].astype(jnp.float32)
                               * rng.uniform(0.375, 0.625, (groups, n)) * levels)
    else:
        w_t = bf(rng.standard_normal((n, k)) / np.sqrt(k))
    if "norm" in variant or gated:
        kw["norm_weight"] = bf(1.0 + 0.2 * rng.standard_normal(k))
    if "bias" in variant:
        kw["bias"] = bf(0.5 * rng.standard_normal(n))
    if "residual" in variant:
        kw["residual"] = bf(rng.standard_normal((m, n_out)))
    return x, w_t, kw


def float64_want(x, w_t, norm_weight=None, eps=EPS, gated=False, bias=None, residual=None,
                 scales=None, offsets=None, group_size=None):
    """The function in float64 numpy from the bf16 operands (independent of jax's dot)."""
    f = lambda a: None if a is None else np.asarray(a.astype(jnp.float32), np.float64)  # noqa
    h = f(x)
    if norm_weight is not None:
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * f(norm_weight)
    w = np.asarray(w_t, np.float64) if scales is None else codes_of(w_t)
    if scales is not None:  # the codes' values (quant/qtensor.py), group by group
        k = w.shape[1]
        group = group_size or k
        per_k = lambda a: np.repeat(f(a).T, group, axis=1)[:, :k]  # noqa: E731  [N, K]
        zero = 8 if w_t.dtype == jnp.int32 else 128
        w = (per_k(scales) * (w - zero) if offsets is None
             else per_k(scales) * w + per_k(offsets))
    y = h @ w.T
    if bias is not None:
        y = y + f(bias)
    if gated:
        g, u = np.split(y, 2, axis=-1)
        y = g / (1.0 + np.exp(-g)) * u
    return y if residual is None else y + f(residual)


def codes_of(w_t) -> np.ndarray:
    """float64 codes [N, K] of uint8 codes or int32 INT4 words (unpacked in numpy)."""
    a = np.asarray(w_t)
    if a.dtype == np.int32:
        a = (a.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
        a = a.reshape(a.shape[0], -1)
    return a.astype(np.float64)


def check(out, want, dtype_ulp: float = 2.0 ** -8):
    """bf16 outputs: within about one rounding of the float64 value (plus float32 sums)."""
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert out.shape == want.shape and np.all(np.isfinite(out))
    scale = np.max(np.abs(want))
    np.testing.assert_array_less(np.abs(out - want), dtype_ulp * np.abs(want) + 1e-4 * scale)


@pytest.mark.parametrize("m,k,n,variant,config",
                         gpu_picks(CASES, {0, 1, 2, 5, 7, 9, 11, 13, 14, 16}))
def test_kernel_against_float64(m, k, n, variant, config):
    x, w_t, kw = operands(m * 1000 + k + n, m, k, n, variant)
    out = gemv(x, w_t, config=config, interpret=not ON_GPU, **kw)
    assert out.dtype == jnp.bfloat16
    check(out, float64_want(x, w_t, **kw))
    # the reference at full precision: a GPU's default is TF32 (x after the norm is float32),
    # too coarse for one bf16 rounding
    with jax.default_matmul_precision("highest"):
        ref = gemv_reference(x, w_t, **kw)
    check(ref, float64_want(x, w_t, **kw))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the Llama-3.1-8B shapes run compiled")
@pytest.mark.parametrize("m,k,n,variant", LLAMA_CASES)
def test_llama_shapes_on_gpu(m, k, n, variant):
    x, w_t, kw = operands(k + n + m, m, k, n, variant)
    check(fused_gemv(x, w_t, impl="pallas", **kw), float64_want(x, w_t, **kw))


@pytest.mark.gpu
def test_fused_gemv_dispatch(monkeypatch):
    x, w_t, kw = operands(3, 1, 64, 32, "norm_residual")
    ref = gemv_reference(x, w_t, **kw)
    if not ON_GPU:  # the CPU runs the reference unless told otherwise
        np.testing.assert_array_equal(fused_gemv(x, w_t, **kw), ref)
    interpreted = KernelBackends(gemv="pallas_interpret")
    check(fused_gemv(x, w_t, kernels=interpreted, **kw), float64_want(x, w_t, **kw))
    with pytest.raises(ValueError, match="impl 'triton'"):
        fused_gemv(x, w_t, impl="triton", **kw)
    # float32 operands, or more rows than MAX_ROWS, take the reference even with the kernel
    x3 = jnp.concatenate([x, x, x]).astype(jnp.float32)
    np.testing.assert_allclose(fused_gemv(x3, w_t.astype(jnp.float32), kernels=interpreted),
                               gemv_reference(x3, w_t.astype(jnp.float32)), rtol=1e-6)
    # INT8 codes: the same dispatch (the kernel on a GPU, else the reference)
    x, codes, kw = operands(9, 1, 64, 32, "asym_norm_residual")
    out = fused_gemv(x, codes, **kw)
    if not ON_GPU:
        np.testing.assert_array_equal(out, gemv_reference(x, codes, **kw))
    check(out, float64_want(x, codes, **kw))


@pytest.mark.parametrize("bad,match", [
    (dict(w_t=(32, 48)), r"x \(1, 64\) does not fit w_t \(32, 48\)"),
    (dict(norm_weight=(48,)), r"norm_weight \(48,\) is not \[K\]"),
    (dict(bias=(31,)), r"bias \(31,\) is not \[N\]"),
    (dict(residual=(1, 16)), r"residual \(1, 16\) is not the output's \(1, 32\)"),
    (dict(gated=True, w_t=(33, 64)), "gated w_t .* needs an even N"),
])
def test_shape_errors_name_the_operand(bad, match):
    x, w_t, kw = operands(4, 1, 64, 32, "norm_bias_residual")
    for name, shape in bad.items():
        if name == "gated":
            kw["gated"] = shape
        elif name == "w_t":
            w_t = jnp.ones(shape, jnp.bfloat16)
        else:
            kw[name] = jnp.ones(shape, jnp.bfloat16)
    if kw.get("gated"):
        kw.pop("residual")
    for fn in (gemv_reference, lambda *a, **k: gemv(*a, interpret=True, **k)):
        with pytest.raises(ValueError, match=match):
            fn(x, w_t, **kw)


@pytest.mark.parametrize("change,match", [
    ("bf16_codes", r"with scales, w_t holds uint8 \(INT8\) or int32 \(INT4\) codes, not bfloat16"),
    ("scales_shape", r"scales \(1, 31\) is not \[G, N\] = \(1, 32\) for groups of 64 over "
                     "K = 64"),
    ("offsets_shape", r"offsets \(32,\) is not \[G, N\]"),
    ("offsets_alone", "offsets without scales"),
    ("scales_missing", "w_t uint8 holds codes: give their scales"),
])
def test_code_errors_name_the_operand(change, match):
    x, w_t, kw = operands(7, 1, 64, 32, "asym")
    if change == "bf16_codes":
        w_t = w_t.astype(jnp.bfloat16)
    elif change == "scales_shape":
        kw["scales"] = kw["scales"][:, :31]
    elif change == "offsets_shape":
        kw["offsets"] = kw["offsets"].reshape(32)
    elif change == "offsets_alone":
        kw.pop("scales")
    else:
        kw.pop("scales"), kw.pop("offsets")
    for fn in (gemv_reference, lambda *a, **k: gemv(*a, interpret=True, **k)):
        with pytest.raises(ValueError, match=match):
            fn(x, w_t, **kw)


def test_code_kernel_needs_k_a_multiple_of_4():
    x, w_t, kw = operands(8, 1, 66, 16, "int8")
    with jax.default_matmul_precision("highest"):
        check(gemv_reference(x, w_t, **kw), float64_want(x, w_t, **kw))  # the reference takes it
    with pytest.raises(ValueError, match=r"\(bf16 or codes\) with K a multiple of 4"):
        gemv(x, w_t, interpret=True, **kw)


def test_kernel_refuses_other_dtypes():
    x, w_t, _ = operands(6, 1, 64, 32, "plain")
    with pytest.raises(ValueError, match=r"bf16 x \(1, 64\) float32"):
        gemv(x.astype(jnp.float32), w_t, interpret=True)


@pytest.mark.parametrize("variant", ["plain", "norm_bias", "gated", "residual", "gated_m2",
                                     "int8_norm", "int8_gated", "asym_residual",
                                     "int4_g128_gated", "int4_g64_asym_norm"])
def test_lowers_to_triton_for_h200(h200_lowering, variant):
    m = 2 if variant.endswith("m2") else 1
    x, w_t, kw = operands(5, m, 4096, 6144, variant)
    text = jax.jit(lambda x, w_t: gemv(x, w_t, **kw)).trace(x, w_t).lower(
        lowering_platforms=("cuda",)).as_text()
    name = ("gemv4_nk" if variant.startswith("int4") else
            "gemv8_nk" if variant.startswith(("int8", "asym")) else "gemv_nk")
    assert name in text and h200_lowering


@pytest.mark.parametrize("variant,m,impl", [
    ("int8", 3, None), ("asym", 1, None), ("int4_g32", 5, None), ("int4_g32_asym", 80, None),
    ("int4_g40", 2, None), ("int8", 3, "pallas_interpret"),
    pytest.param("int4_g32_asym", 20, IMPL, marks=pytest.mark.gpu)])
def test_linear_over_transposed_codes(variant, m, impl, monkeypatch):
    """ops.matmul.linear on a TransposedWeight of codes (the model's steps of more than one row):
    float32 x against float64, per channel and in groups (a shorter last group with g40). impl
    None: this machine's default (the CPU: XLA's product per group, past
    GROUPED_PRODUCT_MAX_ROWS rows dequantized; a GPU: ops/quant_matmul.py's kernels reading the
    codes in place); else that kernel by kernels.quant_matmul."""
    kernels = KernelBackends(quant_matmul=impl) if impl is not None else None
    x, w_t, kw = operands(m + len(variant), m, 96, 40, variant)
    weight = TransposedWeight(w_t, kw["scales"], kw.get("offsets"), kw.get("group_size", 96))
    x32 = x.astype(jnp.float32)
    want = float64_want(x32, w_t, scales=kw["scales"], offsets=kw.get("offsets"),
                        group_size=kw.get("group_size"))
    with jax.default_matmul_precision("highest"):
        got = np.asarray(linear(x32, weight, kernels=kernels), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,variant,config", [
    (1, 256, 64, "int4_g64_norm_residual", GemvConfig(8, 128, 4, 1)),
    (2, 384, 70, "int4_g128_asym_gated", GemvConfig(8, 128, 4, 1, prefetch=True)),
    (1, 160, 48, "int4_g32_norm_bias", None),
    (1, 256, 64, "int8_norm_residual", GemvConfig(8, 64, 4, 1)),
    (3, 176, 40, "asym_gated_residual", GemvConfig(8, 32, 4, 1))])
def test_codes_in_the_wgmma_k_order(m, k, n, variant, config):
    """Codes reordered along K for the Hopper kernel (ops.matmul.reorder_k, k_order "wgmma"):
    the kernel reads x's words (and the norm weight's) in the codes' order and computes the
    same function, against float64 of the natural codes; so does the reference."""
    x, w_t, kw = operands(m * 77 + k + n, m, k, n, variant)
    want = float64_want(x, w_t, **kw)
    natural = TransposedWeight(w_t, kw["scales"], kw.get("offsets"), kw.get("group_size", k))
    w = reorder_k(natural, "wgmma")
    assert w.k_order == "wgmma" and not np.array_equal(np.asarray(w.w_t), np.asarray(w_t))
    kw = kw | dict(scales=w.scales, offsets=w.offsets)
    out = gemv(x, w.w_t, config=config, interpret=not ON_GPU, k_order="wgmma", **kw)
    check(out, want)
    with jax.default_matmul_precision("highest"):
        check(gemv_reference(x, w.w_t, k_order="wgmma", **kw), want)
    with pytest.raises(ValueError, match="k_order 'wgmma' must be one of .* 'natural' for bf16"):
        gemv(x, jnp.ones((n, k), jnp.bfloat16), k_order="wgmma", interpret=True)
