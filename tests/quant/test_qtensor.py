"""quant.qtensor: packing round trips, the pytree node, and the matmul through ops.matmul.linear."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.matmul import linear
from quant.qtensor import (LAYOUT_INT4, LAYOUT_INT8, QuantizedWeight, abstract_quantized_weight,
                           dequantize, make_quantized_weight, pack_int4, split_columns,
                           unpack_codes, unpack_int4)
from quant.rtn import quantize_rtn


@pytest.mark.parametrize("shape", [(8, 1), (64, 24), (576, 40)])
def test_int4_pack_unpack_round_trips_exactly(shape):
    rng = np.random.default_rng(shape[0])
    codes = rng.integers(0, 16, shape)
    codes[0, 0], codes[-1, -1] = 15, 0  # the extremes, incl. the sign bit of the top nibble
    packed = pack_int4(jnp.asarray(codes))
    assert packed.dtype == jnp.int32 and packed.shape == (shape[0] // 8, shape[1])
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), codes)
    # Layout: row 8i + j sits in bits 4j..4j+3 of word i.
    words = np.asarray(packed).view(np.uint32)
    np.testing.assert_array_equal((words[0] >> 4) & 0xF, codes[1])


def test_int4_pack_rejects_k_not_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(jnp.zeros((12, 4), jnp.int32))


@pytest.mark.parametrize("bits", [4, 8])
def test_make_quantized_weight_round_trips_codes(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, (64, 16))
    scales = jnp.asarray(rng.uniform(0.1, 1, (2, 16)), jnp.float32)
    w = make_quantized_weight(codes, scales, None, bits, 32)
    assert w.layout == (LAYOUT_INT4 if bits == 4 else LAYOUT_INT8) and w.shape == (64, 16)
    np.testing.assert_array_equal(np.asarray(unpack_codes(w)), codes)
    want = np.repeat(np.asarray(scales), 32, axis=0) * (codes - 2 ** (bits - 1))
    np.testing.assert_allclose(np.asarray(dequantize(w)), want, rtol=1e-6)


def test_quantized_weight_is_a_pytree_with_static_metadata():
    w = quantize_rtn(jnp.asarray(np.random.default_rng(0).normal(size=(64, 8)), jnp.float32),
                     4, 32, symmetric=False)
    leaves, treedef = jax.tree.flatten(w)
    assert len(leaves) == 3  # packed, scales, offsets (perm None)
    assert jax.tree.unflatten(treedef, leaves).group_size == 32
    doubled = jax.jit(lambda q: dataclasses.replace(q, scales=q.scales * 2))(w)
    assert isinstance(doubled, QuantizedWeight) and doubled.bits == 4
    abstract = abstract_quantized_weight(64, 8, 4, 32, False, False, jnp.float32)
    assert jax.tree.structure(abstract) == treedef
    assert [a.shape for a in jax.tree.leaves(abstract)] == [a.shape for a in leaves]


@pytest.mark.parametrize("bits, group_size, symmetric", [(4, 32, True), (4, 64, False),
                                                         (8, -1, True), (8, -1, False)])
def test_linear_with_quantized_weight_is_dequantize_then_dot(bits, group_size, symmetric):
    rng = np.random.default_rng(1)
    w = quantize_rtn(jnp.asarray(rng.normal(size=(96, 24)), jnp.float32), bits, group_size,
                     symmetric)
    x = jnp.asarray(rng.normal(size=(2, 5, 96)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(24,)), jnp.float32)
    got = jax.jit(linear)(x, w, bias)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ dequantize(w) + bias),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        linear(x[..., :64], w)


def test_act_order_permutation_gathers_activations():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, (64, 8))
    perm = rng.permutation(64)
    w = make_quantized_weight(codes, jnp.ones((2, 8)), jnp.zeros((2, 8)), 4, 32, perm)
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    # Stored row k is input channel perm[k]: the float kernel has codes[k] at row perm[k].
    kernel = np.zeros((64, 8), np.float32)
    kernel[perm] = codes
    np.testing.assert_allclose(np.asarray(dequantize(w)), kernel)
    np.testing.assert_allclose(np.asarray(linear(x, w)), np.asarray(x) @ kernel, rtol=1e-5)


def test_split_columns_matches_separate_weights():
    rng = np.random.default_rng(3)
    kernel = jnp.asarray(rng.normal(size=(64, 30)), jnp.float32)
    parts = split_columns(quantize_rtn(kernel, 4, 32, False), [10, 20])
    for part, (a, b) in zip(parts, [(0, 10), (10, 30)]):
        np.testing.assert_array_equal(np.asarray(dequantize(part)),
                                      np.asarray(dequantize(quantize_rtn(kernel[:, a:b], 4, 32,
                                                                         False))))
