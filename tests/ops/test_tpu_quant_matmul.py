"""ops.tpu_quant_matmul (W4A16 / W8A16 for TPU) in TPU interpret mode on the CPU (compiled on a
TPU), through the int4_matmul / int8_matmul entry points with the TPU kernel choice, against a
float64 numpy product of the dequantized weight and against the XLA reference; and lowered for
TPU.

Codes, scales, offsets and activations are fresh random draws (never zeros), packed by
quant/qtensor.py so kernel and references read the same arrays.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.kernel_choice import REFERENCE
from ops.quant_matmul import int4_matmul, int4_matmul_reference, int8_matmul, \
    int8_matmul_reference
from ops.tpu_chips import tpu_lowering
from ops.tpu_quant_matmul import tpu_matmul_blocks, tpu_quant_matmul
from quant.qtensor import dequantize, make_quantized_weight

# The TPU kernel choice, interpreted off a TPU (on a TPU the same cases run compiled).
TPU_INTERPRET = dataclasses.replace(REFERENCE, platform="tpu", quant_matmul=(
    "pallas" if jax.default_backend() == "tpu" else "pallas_interpret"))
# Relative L2 error: outputs rounded to the activation dtype (bf16: 2^-9 relative); the kernel
# multiplies exact integer codes and applies the scales in float32 (interpreted: float32 ~1e-7,
# bf16 ~2e-3 vs float64).
TOL = {"float32": 1e-5, "bfloat16": 6e-3}


def make_weight(rng, bits, k, n, group_size, asymmetric, act_order):
    codes = rng.integers(0, 2 ** bits, (k, n))
    groups = -(-k // group_size)
    scales = jnp.asarray(rng.uniform(0.5, 1.5, (groups, n)) / 2 ** bits, jnp.float32)
    offsets = (jnp.asarray(rng.normal(0.0, 0.3, (groups, n)), jnp.float32)
               if asymmetric else None)
    perm = rng.permutation(k) if act_order else None
    return make_quantized_weight(codes, scales, offsets, bits, group_size, perm=perm)


# (bits, m, k, n, group_size, asymmetric, dtype, act_order): one K block and several, one row
# block and two (m > 256), per group and per channel.
CASES = [
    (4, 3, 256, 256, 128, False, "float32", False),
    (4, 5, 512, 128, 128, True, "bfloat16", True),
    (4, 300, 256, 128, 256, False, "bfloat16", False),
    (8, 1, 384, 256, 384, False, "float32", False),
    (8, 17, 256, 384, 256, True, "bfloat16", False),
]


@pytest.mark.parametrize("bits,m,k,n,group_size,asymmetric,dtype,act_order", CASES)
def test_matches_float64_and_xla_references(bits, m, k, n, group_size, asymmetric, dtype,
                                            act_order):
    rng = np.random.default_rng(bits * 1000 + m)
    w = make_weight(rng, bits, k, n, group_size, asymmetric, act_order)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    fn, ref_fn = ((int4_matmul, int4_matmul_reference) if bits == 4
                  else (int8_matmul, int8_matmul_reference))
    kw = dict(group_size=group_size, perm=w.perm)
    out = fn(x, w.packed, w.scales, w.offsets, kernels=TPU_INTERPRET, **kw)
    program = jax.make_jaxpr(lambda x: fn(x, w.packed, w.scales, w.offsets,
                                          kernels=TPU_INTERPRET, **kw))(x)
    assert "tpu_quant_matmul" in str(program)  # the kernel ran, not the XLA path
    assert out.shape == (m, n) and out.dtype == x.dtype
    out = np.asarray(out.astype(jnp.float32), np.float64)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(
        dequantize(w, jnp.float32), np.float64)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < TOL[dtype]
    ref = np.asarray(ref_fn(x, w.packed, w.scales, w.offsets, **kw), np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2 * TOL[dtype]


def test_shapes_outside_the_kernel_take_xla():
    assert tpu_matmul_blocks(1, 4096, 14336, 128) is not None
    assert tpu_matmul_blocks(1, 4096, 96, 128) is None  # N not a multiple of 128
    assert tpu_matmul_blocks(1, 512, 256, 64) is None  # groups narrower than a lane tile
    x = jnp.ones((2, 512), jnp.float32)
    assert tpu_quant_matmul(x, jnp.zeros((512, 96), jnp.uint8), jnp.ones((1, 96)), bits=8,
                            group_size=512) is None
    with pytest.raises(ValueError, match="codes"):
        tpu_quant_matmul(x, jnp.zeros((32, 128), jnp.int32), jnp.ones((4, 128)), bits=4,
                         group_size=128)


@pytest.mark.parametrize("bits,m", [(4, 1), (4, 2048), (8, 16)])
def test_lowers_for_tpu(bits, m):
    """Llama-3.1-8B's gate/up product (4096 -> 14336) lowers to one Mosaic kernel."""
    k, n = 4096, 14336
    spec = jax.ShapeDtypeStruct
    codes = spec((k // 8, n), jnp.int32) if bits == 4 else spec((k, n), jnp.uint8)
    groups = k // 128 if bits == 4 else 1
    scales = spec((groups, n), jnp.bfloat16)

    def product(x, codes, scales, offsets):
        return tpu_quant_matmul(x, codes, scales, offsets, bits=bits,
                                group_size=128 if bits == 4 else k)

    with tpu_lowering("v5e"):
        text = jax.jit(product).trace(spec((m, k), jnp.bfloat16), codes, scales, scales).lower(
            lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1 and "tpu_quant_matmul" in text
