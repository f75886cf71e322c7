"""ops.quant_matmul (W4A16 / W8A16) against its jnp reference and a float32 HIGHEST product.

Every case draws fresh random codes, scales, offsets and activations (never zeros) and packs them
with quant/qtensor.py's packers, so kernel and references read the very same packed arrays. On
CPU the Pallas kernel runs with interpret=True on small K / N of the Llama structure (K a multiple
of the group or not, N not a multiple of the column block); on a GPU the same cases run compiled
and the Llama-3.1-8B shapes are added. A CPU test lowers every kernel path (fma, dot, and the
tensor-core decode path "mma") to Triton IR for an H200, which catches
unsupported constructs without a GPU (not what Triton's own compiler might reject later).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.switches import Switches
from ops.backends import device_kernels
from ops.kernel_choice import KernelBackends
from ops.matmul import linear
from ops.quant_matmul import (MatmulConfig, int4_matmul, int4_matmul_reference, int8_matmul,
                              int8_matmul_reference, matmul_config)
from quant.qtensor import dequantize, make_quantized_weight
from tests.marks import GPU_SWEEP, gpu_picks

ON_GPU = jax.default_backend() == "gpu"
IMPL = "pallas" if ON_GPU else "pallas_interpret"
# Relative L2 error against the reference: the outputs are rounded to the activation dtype (and
# XLA's float32 dot on GPU runs in TF32).
TOL = {"bfloat16": 1.5e-2, "float16": 3e-3, "float32": 1e-3}


def make_weight(rng, bits, k, n, group_size, asymmetric, act_order, scale_dtype):
    codes = rng.integers(0, 2 ** bits, (k, n))
    groups = -(-k // group_size)
    scales = jnp.asarray(rng.uniform(0.5, 1.5, (groups, n)) / 2 ** bits, scale_dtype)
    offsets = (jnp.asarray(rng.normal(0.0, 0.3, (groups, n)), scale_dtype)
               if asymmetric else None)
    perm = rng.permutation(k) if act_order else None
    return make_quantized_weight(codes, scales, offsets, bits, group_size, perm=perm)


def run_case(*, bits, m, k, n, group_size, asymmetric=False, dtype="bfloat16", act_order=False,
             config=None, impl=IMPL, seed=0, lead=None, layout="kn", kernels=None):
    rng = np.random.default_rng(seed)
    w = make_weight(rng, bits, k, n, group_size, asymmetric, act_order, dtype)
    shape = (*lead, k) if lead else (m, k)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    fn, ref_fn = ((int4_matmul, int4_matmul_reference) if bits == 4
                  else (int8_matmul, int8_matmul_reference))
    kw = dict(group_size=group_size, perm=w.perm)
    stored = w.packed.T if layout == "nk" else w.packed  # "nk": the same words, transposed
    out = fn(x, stored, w.scales, w.offsets, impl=impl, config=config, layout=layout,
             kernels=kernels, **kw)
    assert out.shape == (*shape[:-1], n) and out.dtype == x.dtype
    out = np.asarray(out.astype(jnp.float32)).reshape(-1, n)
    x2 = x.reshape(-1, k)
    ref = np.asarray(ref_fn(x2, w.packed, w.scales, w.offsets, **kw))
    assert np.all(np.isfinite(out))
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], f"vs reference: {err:.2e}"
    # Independent product: qtensor's dequantize (un-permuted), float32 at HIGHEST precision.
    want = np.asarray(jnp.dot(x2.astype(jnp.float32), dequantize(w, jnp.float32),
                              precision=jax.lax.Precision.HIGHEST))
    err = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert err < TOL[dtype], f"vs float32 product: {err:.2e}"


# (bits, m, k, n, group_size, asymmetric, dtype, act_order)
CASES = [
    (4, 1, 512, 384, 128, False, "bfloat16", False),
    (4, 1, 320, 96, 128, True, "float16", False),  # last group 64 rows, N % 64 != 0
    (4, 3, 512, 256, 32, False, "float16", True),
    (4, 3, 256, 384, 256, True, "bfloat16", False),  # per channel
    (4, 16, 512, 256, 64, True, "bfloat16", False),
    (4, 16, 320, 160, 32, False, "float16", False),
    (4, 64, 256, 128, 128, False, "bfloat16", True),
    (4, 64, 512, 192, 512, True, "float16", False),
    (4, 300, 256, 128, 64, False, "bfloat16", False),
    (4, 2, 256, 128, 64, False, "float32", False),
    (8, 1, 512, 384, 512, False, "bfloat16", False),  # per channel (the INT8 preset)
    (8, 1, 300, 96, 300, True, "float16", False),  # K not a multiple of 8 or 16
    (8, 2, 520, 256, 520, False, "float32", False),  # the word kernel, two rows
    (8, 1, 256, 98, 256, False, "bfloat16", False),  # N % 4 != 0: the byte kernel
    (8, 3, 256, 256, 128, True, "bfloat16", True),
    (8, 16, 384, 128, 32, False, "float16", False),
    (8, 16, 256, 256, 64, True, "bfloat16", False),
    (8, 64, 256, 128, 256, False, "bfloat16", False),
    (8, 300, 128, 128, 128, True, "float16", False),
]


@pytest.mark.parametrize("bits,m,k,n,group_size,asymmetric,dtype,act_order",
                         gpu_picks(CASES, {0, 1, 3, 4, 8, 9, 10, 12, 13, 16, 18}))
def test_matches_references(bits, m, k, n, group_size, asymmetric, dtype, act_order):
    run_case(bits=bits, m=m, k=k, n=n, group_size=group_size, asymmetric=asymmetric,
             dtype=dtype, act_order=act_order, seed=m + k + n + group_size)


@pytest.mark.parametrize("bits,config", gpu_picks([
    (4, MatmulConfig(block_m=1, block_n=32, block_k=64, num_splits=3)),  # splits > tiles/split
    (4, MatmulConfig(block_m=2, block_n=64, block_k=128, num_splits=1)),
    (4, MatmulConfig(block_m=16, block_n=32, block_k=128, num_splits=2)),  # 16 words of 8 rows
    (4, MatmulConfig(block_m=32, block_n=64, block_k=256, num_splits=1)),
    (8, MatmulConfig(block_m=1, block_n=64, block_k=16, num_splits=4)),
    (8, MatmulConfig(block_m=2, block_n=32, block_k=32, num_splits=2)),
    (8, MatmulConfig(block_m=16, block_n=64, block_k=32, num_splits=1)),
], {0, 2, 4}))
def test_explicit_configs(bits, config):
    # K = 448: 14 groups of 32, a partial last tile for every block_k above.
    run_case(bits=bits, m=5, k=448, n=96, group_size=32, asymmetric=True, config=config,
             seed=config.block_m * 7 + config.num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("m,config", [
    (1, MatmulConfig(block_m=1, block_n=64, block_k=16, num_splits=3)),  # K % 16 != 0
    (2, MatmulConfig(block_m=2, block_n=32, block_k=32, num_splits=2)),
    (3, MatmulConfig(block_m=2, block_n=16, block_k=4, num_splits=1)),  # one row per chain
])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_int8_word_kernel_configs(m, config, asymmetric):
    """ops/quant_gemv8.py: per-channel INT8, four codes per word (path "auto" below 16 rows),
    K = 452 (a partial last tile of every block_k), N = 100 (a partial column block)."""
    run_case(bits=8, m=m, k=452, n=100, group_size=452, asymmetric=asymmetric, config=config,
             dtype="float32", seed=config.block_k + m + asymmetric)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 66])
def test_int8_one_row_precision_with_biased_activations(n):
    """The one-row kernels cancel large excess terms in float32 (ops/quant_gemv8.py for N a
    multiple of 4, else ops/quant_gemv.py); with activations of mean 1 over K = 14336 in one
    split, both must still match a float64 product to 2e-4."""
    rng = np.random.default_rng(11)
    k = 14336
    w = make_weight(rng, 8, k, n, k, False, False, "float32")
    x = jnp.asarray(rng.standard_normal((1, k)) + 1.0, jnp.float32)
    config = MatmulConfig(block_m=1, block_n=64, block_k=32, num_splits=1)
    out = np.asarray(int8_matmul(x, w.packed, w.scales, group_size=k, impl=IMPL, config=config),
                     np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(dequantize(w, jnp.float32), np.float64)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 2e-4


# The tensor-core decode paths (MatmulConfig.path): (bits, m, k, n, group_size, asymmetric, dtype,
# block_k). Groups: a tile in one group (the scale after the dot), a tile of several whole groups
# (one dot chain per group), groups that cut the dot's K (weights scaled before the dot).
MMA_CASES = [
    (4, 1, 512, 96, 128, False, "bfloat16", 128),  # one group per tile; N % 32 != 0
    (4, 3, 1024, 64, 128, True, "bfloat16", 512),  # four groups per tile
    (4, 16, 448, 64, 32, False, "float16", 128),  # 4-word groups: pre-scaled; partial tile
    (4, 3, 320, 64, 320, True, "float16", 256),  # per channel, K % block_k != 0
    (4, 16, 512, 64, 128, True, "bfloat16", 256),  # two groups per tile
    (4, 1, 256, 32, 64, True, "float32", 128),
    (8, 1, 300, 64, 300, False, "bfloat16", 32),  # per channel, K not a multiple of 16
    (8, 16, 256, 64, 64, True, "float16", 128),  # fp16 magic codes, two groups per tile
    (8, 3, 192, 32, 48, False, "bfloat16", 32),  # 48-row groups cut 32-row tiles
]


@pytest.mark.parametrize("bits,m,k,n,group_size,asymmetric,dtype,block_k",
                         gpu_picks(MMA_CASES, {0, 1, 2, 5, 7}))
def test_mma_path(bits, m, k, n, group_size, asymmetric, dtype, block_k):
    config = MatmulConfig(block_m=16, block_n=32, block_k=block_k, num_splits=2, path="mma")
    run_case(bits=bits, m=m, k=k, n=n, group_size=group_size, asymmetric=asymmetric,
             dtype=dtype, config=config, seed=m + k + n + block_k + 3)


# Weights stored transposed, [N, K/8] / [N, K] (layout "nk": ops.matmul.TransposedWeight, the
# --gemv_layers models' steps of more than one row): the tensor-core paths read them in place.
# (bits, m, k, n, group_size, asymmetric, dtype, config; None: matmul_config's tiles)
NK_CASES = [
    (4, 2, 512, 96, 128, False, "bfloat16", None),  # "mma" from two rows, N % 256 != 0
    (4, 5, 448, 96, 32, True, "float16", MatmulConfig(16, 32, 128, 2, path="mma")),
    (4, 20, 512, 64, 64, True, "bfloat16", None),  # the "auto" dot path, 32-row blocks
    (8, 3, 256, 64, 256, False, "bfloat16", MatmulConfig(16, 32, 64, 2, path="mma")),
    (8, 40, 192, 96, 48, True, "float16", None),  # 48-row groups cut 64-row tiles
    (4, 7, 256, 64, 256, False, "float32", MatmulConfig(16, 64, 128, 1, path="mma")),
]


@pytest.mark.parametrize("bits,m,k,n,group_size,asymmetric,dtype,config",
                         gpu_picks(NK_CASES, {0, 2, 4, 5}))
def test_transposed_layout(bits, m, k, n, group_size, asymmetric, dtype, config):
    run_case(bits=bits, m=m, k=k, n=n, group_size=group_size, asymmetric=asymmetric,
             dtype=dtype, config=config, layout="nk", seed=m + k + n + bits)


def test_transposed_layout_errors():
    rng = np.random.default_rng(12)
    w = make_weight(rng, 4, 256, 64, 64, False, False, "bfloat16")
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    one_row = MatmulConfig(block_m=2, block_n=64, block_k=128)
    with pytest.raises(ValueError, match=r"layout 'nk'\) take the tensor-core paths"):
        int4_matmul(x, w.packed.T, w.scales, group_size=64, impl=IMPL, config=one_row,
                    layout="nk")
    with pytest.raises(ValueError, match=r"layout 'xy' must be one of"):
        int4_matmul(x, w.packed, w.scales, group_size=64, impl=IMPL, layout="xy")
    with pytest.raises(ValueError, match=r"x \(3, 256\) does not fit packed weights \(32, 64\)"):
        int4_matmul(x, w.packed, w.scales, group_size=64, impl=IMPL, layout="nk")


@pytest.mark.gpu
def test_leading_dims_and_linear_dispatch():
    run_case(bits=4, m=None, k=256, n=128, group_size=64, lead=(2, 3), seed=3)
    rng = np.random.default_rng(4)
    w = make_weight(rng, 4, 256, 128, 64, True, True, "bfloat16")
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    ref = np.asarray(linear(x, w).astype(jnp.float32))  # kernels None: the reference
    want = int4_matmul_reference(x, w.packed, w.scales, w.offsets, group_size=64,
                                 perm=w.perm).astype(jnp.bfloat16)
    np.testing.assert_array_equal(ref, np.asarray(want.astype(jnp.float32)))
    kernels = KernelBackends(quant_matmul=IMPL)  # the kernel through linear
    out = np.asarray(linear(x, w, kernels=kernels).astype(jnp.float32))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL["bfloat16"]


def test_heuristic_configs_are_valid():
    for bits in (4, 8):
        for m in (1, 2, 3, 4, 16, 17, 64, 128, 256, 1024):
            for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (512, 96)):
                cfg = matmul_config(bits, m, k, n, 128)
                nk = matmul_config(bits, m, k, n, 128, stored_nk=True)
                assert (nk is None) == (cfg is None)
                if cfg is None:
                    assert m > 16
                    continue
                assert nk.block_m >= 16  # what "nk" takes
                per_word = 8 if bits == 4 else 1
                assert cfg.block_m >= m or cfg.block_m >= 16
                assert cfg.num_splits >= 1 and cfg.block_k % per_word == 0


@pytest.mark.parametrize("bits", [4, 8])
def test_mantissa_codes_and_prescale_are_exact(bits):
    """ops/quant_gemv.py (the one/two-row path): each code c of a packed element becomes the
    float 1 + c 2^(p-23) exactly, and x 2^(23-p) times it is x c plus the excess the kernel
    subtracts (numpy on fresh random words; the PTX lop3 of the GPU build is the same bits)."""
    from ops.quant_gemv import code_positions, mantissa_codes, prescale
    rng = np.random.default_rng(7)
    if bits == 4:
        words = rng.integers(0, 2 ** 32, (5, 6), dtype=np.uint64).astype(np.uint32)
        codes = [(words >> np.uint32(4 * j)) & np.uint32(0xF) for j in range(8)]
        words = words.view(np.int32)
    else:
        words = rng.integers(0, 256, (5, 6)).astype(np.int32)
        codes = [words]
    got = mantissa_codes(jnp.asarray(words), bits, interpret=True)
    positions = code_positions(bits)
    assert len(got) == len(codes) == len(positions)
    for v, c, p in zip(got, codes, positions):
        np.testing.assert_array_equal(np.asarray(v), 1.0 + c.astype(np.float64) * 2.0 ** (p - 23))
    x = rng.standard_normal((2, 16 * len(positions))).astype(np.float32)
    factors = np.resize([2.0 ** (23 - p) for p in positions], x.shape[1])
    np.testing.assert_array_equal(np.asarray(prescale(jnp.asarray(x), bits)), x * factors)


def test_word_codes_are_exact():
    """ops/quant_gemv8.py: byte j of a word becomes 1 + c_j 2^(p-23) exactly (numpy; the PTX
    prmt of the GPU build places the same bits)."""
    from ops.quant_gemv8 import CODE_POSITION, word_codes
    rng = np.random.default_rng(8)
    words = rng.integers(0, 2 ** 32, (4, 7), dtype=np.uint64).astype(np.uint32)
    got = word_codes(jnp.asarray(words.view(np.int32)), interpret=True)
    for j, v in enumerate(got):
        c = (words >> np.uint32(8 * j)) & np.uint32(0xFF)
        np.testing.assert_array_equal(np.asarray(v),
                                      1.0 + c.astype(np.float64) * 2.0 ** (CODE_POSITION - 23))


def test_validation():
    rng = np.random.default_rng(5)
    w = make_weight(rng, 4, 256, 64, 64, False, False, "bfloat16")
    x = jnp.ones((2, 256), jnp.bfloat16) * 0.5
    bad = [
        dict(x=x[:, :128]),  # K mismatch
        dict(x=x.astype(jnp.int32)),
        dict(packed=w.packed.astype(jnp.uint8)),
        dict(scales=w.scales[:2]),
        dict(offsets=w.scales[:, :32]),
        dict(group_size=60),  # not a multiple of 8
        dict(perm=jnp.arange(128)),
        dict(config=MatmulConfig(block_m=16, block_n=64, block_k=64)),  # 8 words < 16 for tl.dot
        dict(config=MatmulConfig(block_m=3, block_n=64, block_k=64)),
        dict(config=MatmulConfig(block_m=8, block_n=64, block_k=128, path="mma")),  # < 16 rows
        dict(config=MatmulConfig(block_m=16, block_n=64, block_k=128, path="wgmma")),
        dict(config=MatmulConfig(block_m=16, block_n=64, block_k=64, path="mma_t")),
        dict(config=MatmulConfig(block_m=2, block_n=64, block_k=64, path="fma")),
    ]
    base = dict(x=x, packed=w.packed, scales=w.scales, offsets=None, group_size=64, perm=None,
                config=None)
    for change in bad:
        a = {**base, **change}
        with pytest.raises(ValueError, match="int4_matmul"):
            int4_matmul(a["x"], a["packed"], a["scales"], a["offsets"],
                        group_size=a["group_size"], perm=a["perm"], config=a["config"],
                        impl="pallas_interpret")
    with pytest.raises(ValueError, match=r"\(32, 64\) int32"):
        int8_matmul(x, w.packed, w.scales, group_size=64)  # int32 words given to int8
    with pytest.raises(ValueError, match="impl"):
        int4_matmul(x, w.packed, w.scales, group_size=64, impl="triton")


# Llama-3.1-8B's shapes: q/k/v and down by default, every projection and the lm head in the sweep
LLAMA = ([(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)] if GPU_SWEEP
         else [(4096, 6144), (14336, 4096)])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: the Llama-3.1-8B shapes run compiled")
@pytest.mark.parametrize("k,n", LLAMA)
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_llama_shapes(bits, k, n):
    for m, group, asym, dtype in ((1, 128, False, "bfloat16"), (3, 32, True, "float16"),
                                  (16, 64, False, "bfloat16"), (64, k, True, "bfloat16"),
                                  (300, 128, False, "float16")):
        if bits == 8 and group != k and m in (1, 16):
            group = k  # the INT8 preset is per channel
        # the dispatch this GPU's runner would choose, then the kernel forced
        for impl, kernels in ((None, device_kernels(Switches())), ("pallas", None)):
            run_case(bits=bits, m=m, k=k, n=n, group_size=group, asymmetric=asym, dtype=dtype,
                     impl=impl, kernels=kernels, seed=m + n)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the `gpu` tests compile the kernel for real")
@pytest.mark.parametrize("bits,block_m,asymmetric,path,dtype,group", [
    (4, 1, False, None, "bfloat16", 128), (4, 2, True, None, "bfloat16", 128),
    (4, 1, True, None, "float16", 32),  # groups finer than the fma path's tile
    (8, 1, False, None, "bfloat16", 4096), (8, 2, True, None, "float16", 4096),  # int8 words
    (4, 16, True, None, "bfloat16", 128), (8, 1, True, None, "bfloat16", 128),
    (8, 16, False, None, "bfloat16", 128),
    (4, 1, False, "mma", "bfloat16", 128), (4, 16, True, "mma", "float16", 128),
    (8, 1, False, "mma", "bfloat16", 128), (8, 16, True, "mma", "float16", 128),
    (4, 1, True, "mma", "bfloat16", 64),  # 8-word groups: weights scaled before the dot
    (4, 1, False, "mma", "float16", 4096),  # per channel: one dot per tile
    (4, 2, True, "nk", "bfloat16", 128), (4, 32, False, "nk", "bfloat16", 128),  # stored [N, K]
    (8, 16, False, "nk", "bfloat16", 4096), (8, 64, True, "nk", "bfloat16", 4096)])
def test_lowers_to_triton_for_h200(h200_lowering, bits, block_m, asymmetric, path, dtype, group):
    spec = jax.ShapeDtypeStruct
    k, n = 4096, 6144
    layout = "nk" if path == "nk" else "kn"  # "nk": matmul_config's tiles for [N, K] weights
    packed = spec((k // 8, n), jnp.int32) if bits == 4 else spec((k, n), jnp.uint8)
    if layout == "nk":
        packed = spec(packed.shape[::-1], packed.dtype)
        path = None
    scales = spec((k // group, n), dtype)
    config = matmul_config(bits, block_m, k, n, group, stored_nk=layout == "nk")
    if path is not None:  # block_k 512 (int4) spans four groups of 128 rows
        config = MatmulConfig(block_m=16, block_n=256, block_k=512 if bits == 4 else 128,
                              num_splits=2, num_warps=8, num_stages=2, path=path)
    fn = int4_matmul if bits == 4 else int8_matmul

    def f(x, w, s, o):
        return fn(x, w, s, o, group_size=group, impl="pallas", config=config, layout=layout)

    text = jax.jit(f).trace(spec((block_m, k), dtype), packed, scales,
                            scales if asymmetric else None).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and h200_lowering
