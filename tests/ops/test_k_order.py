"""Codes stored along K in the Hopper kernel's order (TransposedWeight.k_order "wgmma",
ops.matmul.reorder_k): the same weight for every product. The order is a permutation within
blocks of K_ORDER_SPAN positions; `linear` and int4_matmul / int8_matmul over reordered codes
give what the natural codes give (on the CPU through x permuted to match); the Hopper kernel
lowers without its gather of x when the codes are reordered."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.switches import Switches
from ops import quant_wgmma as qw
from ops.backends import select_kernels
from ops.kernel_choice import KernelBackends
from ops.matmul import TransposedWeight, device_k_order, linear, reorder_k, stored_inputs
from ops.quant_matmul import int4_matmul, int8_matmul


def random_weight(rng, bits: int, k: int, n: int, group: int, asymmetric: bool):
    """A TransposedWeight of random codes [N, K] (INT4 packed in words) with bf16 scales."""
    codes = rng.integers(0, 2 ** bits, (n, k))
    if bits == 4:
        w_t = (codes.reshape(n, k // 8, 8).astype(np.uint32)
               << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)
    else:
        w_t = codes.astype(np.uint8)
    groups = -(-k // group)
    scales = jnp.asarray(rng.uniform(0.5, 1.5, (groups, n)) / 2 ** bits, jnp.bfloat16)
    offsets = (jnp.asarray(rng.normal(0.0, 0.3, (groups, n)), jnp.bfloat16) if asymmetric
               else None)
    return TransposedWeight(jnp.asarray(w_t), scales, offsets, group_size=group)


@pytest.mark.parametrize("bits,k", [(4, 96), (8, 48), (4, 4096), (8, 14336)])
def test_stored_positions_permute_within_blocks(bits, k):
    positions = qw.stored_k_positions(bits, k, "wgmma")
    span = qw.K_ORDER_SPAN[bits]
    assert sorted(positions.tolist()) == list(range(k))
    assert np.array_equal(positions // span, np.arange(k) // span)  # no block is left
    assert not np.array_equal(positions, np.arange(k))
    # the kernel's tile column c reads stored column wgmma_k_order[c]: K position c itself
    assert np.array_equal(positions[qw.wgmma_k_order(bits, k)], np.arange(k))
    assert qw.stored_k_positions(bits, k, "natural") is None
    with pytest.raises(ValueError, match="k_order 'tiled' must be one of"):
        qw.stored_k_positions(bits, k, "tiled")
    with pytest.raises(ValueError, match="not a multiple of"):
        qw.stored_k_positions(bits, k + span // 2, "wgmma")


@pytest.mark.parametrize("bits,k,n,group,asymmetric", [
    (4, 96, 40, 32, True), (4, 320, 24, 128, False), (8, 48, 16, 48, False),
    (8, 64, 40, 16, True)])
def test_reordered_codes_are_the_same_weight(bits, k, n, group, asymmetric):
    """linear (the CPU's XLA product, x permuted to the stored order), int4/int8_matmul's
    reference and interpreted Pallas "nk" paths, all against the natural codes; the reorder
    is undone exactly."""
    rng = np.random.default_rng(int(np.random.randint(1 << 30)))
    natural = random_weight(rng, bits, k, n, group, asymmetric)
    w = reorder_k(natural, "wgmma")
    assert w.k_order == "wgmma" and w.w_t.shape == natural.w_t.shape
    assert not np.array_equal(np.asarray(w.w_t), np.asarray(natural.w_t))
    back = reorder_k(w, "natural")
    assert back.k_order == "natural"
    assert np.array_equal(np.asarray(back.w_t), np.asarray(natural.w_t))
    assert stored_inputs(natural) is None and stored_inputs(w) is not None
    x = jnp.asarray(rng.standard_normal((5, k)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(linear(x, natural))
        np.testing.assert_allclose(np.asarray(linear(x, w)), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())
        product = int4_matmul if bits == 4 else int8_matmul
        for impl, m in (("reference", 5), ("pallas_interpret", 16)):
            xb = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            args = dict(group_size=group, layout="nk", impl=impl)
            ref = np.asarray(product(xb, natural.w_t, natural.scales, natural.offsets, **args),
                             np.float32)
            got = np.asarray(product(xb, w.w_t, w.scales, w.offsets, k_order="wgmma", **args),
                             np.float32)
            # bf16 outputs of the same sums in another order: about one rounding apart
            np.testing.assert_allclose(got, ref, rtol=2 ** -7, atol=2 ** -7 * np.abs(ref).max())


def test_reorder_refuses_what_it_cannot_store():
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="float weights keep the natural order"):
        reorder_k(TransposedWeight(jnp.ones((8, 64), jnp.bfloat16)), "wgmma")
    w = random_weight(rng, 4, 96, 16, 48, False)  # groups of 48: not whole blocks of 32
    with pytest.raises(ValueError, match="groups of 48 are not whole blocks of 32"):
        reorder_k(w, "wgmma")
    with pytest.raises(ValueError, match="k_order 'wgmma' is for codes stored"):
        int4_matmul(jnp.ones((2, 96), jnp.bfloat16), w.w_t.T, w.scales, group_size=48,
                    k_order="wgmma")
    assert device_k_order(w) == "natural"  # no Hopper kernel chosen, and the groups do not fit
    assert device_k_order(w, KernelBackends(wgmma=True, k_order="wgmma")) == "natural"


@pytest.mark.skipif(qw.on_hopper(), reason="the Hopper tests compile and run the kernel")
@pytest.mark.parametrize("bits,k_order,gathered", [
    (4, "wgmma", False), (4, "natural", True), (8, "wgmma", False), (8, "natural", True)])
def test_the_kernel_reads_reordered_x_as_it_is(bits, k_order, gathered, monkeypatch):
    """Codes stored in the kernel's K order need no gather of x; natural codes do."""
    monkeypatch.setattr(qw, "on_hopper", lambda: True)
    m, k, n = 16, 512, 256
    group = 128 if bits == 4 else k
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k // 8) if bits == 4 else (n, k),
                             jnp.int32 if bits == 4 else jnp.uint8)
    s = jax.ShapeDtypeStruct((k // group, n), jnp.bfloat16)
    cfg = qw.WgmmaConfig(block_k=128, stages=2)
    fn = jax.jit(lambda x, w, s: qw.wgmma_matmul(x, w, s, bits=bits, group_size=group,
                                                 config=cfg, k_order=k_order))
    text = fn.trace(x, w, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert ("gather" in text) == gathered


@pytest.mark.gpu
@pytest.mark.skipif(not qw.on_hopper(), reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("bits,m,k,n,group,asymmetric", [
    (4, 16, 4096, 28672, 128, True), (4, 1, 14336, 4096, 128, False),
    (8, 16, 4096, 6144, 4096, False), (4, 300, 4096, 4096, 128, True)])
def test_reordered_codes_on_the_kernel(bits, m, k, n, group, asymmetric, monkeypatch):
    """The dispatch's kernel over reordered codes (x as it is) against the reference over the
    natural ones; device_k_order picks "wgmma" here, and "natural" under PALLASITE_K_ORDER."""
    rng = np.random.default_rng(m + k + n)
    natural = random_weight(rng, bits, k, n, group, asymmetric)
    kernels = select_kernels("gpu", hopper=True)
    assert device_k_order(natural, kernels) == "wgmma"
    w = reorder_k(natural, device_k_order(natural, kernels))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    fn = jax.jit(lambda x: linear(x, w, kernels=kernels))
    text = fn.lower(x).as_text()
    assert "mosaic_gpu" in text and "gather" not in text  # x enters as it is
    got = np.asarray(fn(x).astype(jnp.float32))
    product = int4_matmul if bits == 4 else int8_matmul
    ref = np.asarray(product(x, natural.w_t, natural.scales, natural.offsets, group_size=group,
                             layout="nk", impl="reference").astype(jnp.float32))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    natural_order = select_kernels("gpu", hopper=True, switches=Switches(k_order="natural"))
    assert device_k_order(natural, natural_order) == "natural"
