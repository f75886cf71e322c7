"""ops.quant_wgmma on a Hopper GPU: the kernel against ops.quant_matmul's references on the very
same random codes, for 1 to 64 rows in one tile and up to 1024 in row tiles, every group size it
takes, with and without offsets (`HOPPER_CASES`), and the model's `linear` reaching it. On any
machine: every case is one the kernel's rules (`supports`) take. The CPU-side checks (lowering,
tile rules, errors) are in tests/ops/test_quant_wgmma.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import quant_wgmma as qw
from ops.backends import select_kernels
from ops.matmul import TransposedWeight, linear
from ops.quant_matmul import int4_matmul_reference, int8_matmul_reference
from quant.qtensor import make_quantized_weight
from tests.marks import gpu_picks

ON_HOPPER = qw.on_hopper()


def random_case(bits, m, k, n, group, asymmetric, seed=0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** bits, (k, n))
    groups = -(-k // group)
    scales = jnp.asarray(rng.uniform(0.5, 1.5, (groups, n)) / 2 ** bits, jnp.bfloat16)
    offsets = (jnp.asarray(rng.normal(0.0, 0.3, (groups, n)), jnp.bfloat16) if asymmetric
               else None)
    w = make_quantized_weight(codes, scales, offsets, bits, group)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return w, x


def reference(bits, x, w):
    ref = int4_matmul_reference if bits == 4 else int8_matmul_reference
    return np.asarray(ref(x, w.packed, w.scales, w.offsets, group_size=w.group_size))


# the kernel's cases on the H200: bits, rows, K, N, group, offsets, tiles (None: the dispatch's)
HOPPER_CASES = [
    (4, 1, 4096, 6144, 128, False, None),
    (4, 3, 4096, 4096, 64, False, qw.WgmmaConfig(block_k=64, num_splits=4)),
    (4, 16, 4096, 28672, 128, False, None),
    (4, 16, 2048, 1024, 256, True, None),
    (4, 64, 14336, 4096, 14336, False, None),
    (4, 40, 1024, 512, 1024, True, qw.WgmmaConfig(block_k=256, num_splits=2, stages=2)),
    (8, 1, 4096, 4096, 4096, False, None),
    (8, 3, 4096, 6144, 128, False, None),
    (8, 16, 14336, 4096, 14336, True, None),
    (8, 64, 4096, 4096, 4096, False, qw.WgmmaConfig(block_k=256, num_splits=2, stages=3)),
    (4, 16, 4096, 4096, 128, False, qw.WgmmaConfig(block_k=128, block_n=256, stages=2)),
    (4, 3, 384, 576, 128, True, None),  # odd multiples of the group and of 64 columns
    (8, 16, 1536, 576, 1536, False, None),  # SmolLM2's down projection
    (8, 64, 576, 960, 64, False, None),  # SmolLM2's q/k/v, INT8 in groups of 64
    (8, 5, 4096, 4096, 4096, True, qw.WgmmaConfig(block_k=256, block_n=128)),  # XLA offsets
    # row tiles (block_m) past MAX_ROWS rows: ragged rows, offsets, K splits
    pytest.param(4, 300, 4096, 4096, 128, False,
                 qw.WgmmaConfig(block_k=64, block_m=128, stages=4), id="rowtiles-a"),
    pytest.param(4, 520, 4096, 4096, 128, True,
                 qw.WgmmaConfig(block_k=128, block_m=128, stages=3),
                 id="rowtiles-b"),
    pytest.param(4, 1024, 4096, 6144, 128, True, None, id="rowtiles-c"),
    pytest.param(8, 200, 4096, 4096, 4096, False,
                 qw.WgmmaConfig(block_k=128, block_m=256, stages=2), id="rowtiles-d"),
    pytest.param(4, 130, 2048, 1024, 256, False,
                 qw.WgmmaConfig(block_k=128, block_n=128, block_m=64, num_splits=2, stages=3),
                 id="rowtiles-e"),
    pytest.param(8, 96, 1024, 512, 1024, True,
                 qw.WgmmaConfig(block_k=128, block_m=32, stages=2),
                 id="rowtiles-f"),
    pytest.param(4, 1000, 4096, 4096, 128, False,
                 qw.WgmmaConfig(block_k=64, block_m=256, stages=3, consumers=2),
                 id="rowtiles-ws"),
    pytest.param(8, 300, 2048, 1536, 2048, True,
                 qw.WgmmaConfig(block_k=128, block_m=128, stages=2, num_splits=2, consumers=3),
                 id="rowtiles-ws-splits"),
    pytest.param(8, 600, 4096, 4096, 4096, False, None, id="rowtiles-ws-int8"),  # the dispatch
    pytest.param(4, 1000, 4096, 4096, 128, True,  # offsets in the warp-specialized kernel
                 qw.WgmmaConfig(block_k=64, block_m=256, stages=4, consumers=2),
                 id="rowtiles-ws-offsets"),
    pytest.param(4, 200, 2048, 1536, 64, True,
                 qw.WgmmaConfig(block_k=64, block_m=128, stages=2, num_splits=2, consumers=3),
                 id="rowtiles-ws-offsets-splits"),
    pytest.param(4, 16, 4096, 4096, 128, True,
                 qw.WgmmaConfig(block_k=128, stages=3, consumers=2), id="ws-offsets"),
    # the warp-specialized persistent kernel (ops/quant_wgmma_ws.py)
    pytest.param(4, 16, 4096, 28672, 128, False,
                 qw.WgmmaConfig(block_k=256, num_splits=2, stages=4, consumers=2), id="ws-a"),
    pytest.param(4, 1, 4096, 6144, 64, True,
                 qw.WgmmaConfig(block_k=64, num_splits=8, stages=4, consumers=3), id="ws-b"),
    pytest.param(4, 3, 384, 576, 128, False,
                 qw.WgmmaConfig(block_k=128, stages=2, consumers=3), id="ws-c"),
    pytest.param(8, 16, 14336, 4096, 14336, False,
                 qw.WgmmaConfig(block_k=256, num_splits=8, stages=2, consumers=2), id="ws-d"),
    pytest.param(8, 64, 4096, 6144, 4096, True,
                 qw.WgmmaConfig(block_k=256, num_splits=2, stages=2, consumers=2), id="ws-e"),
    # steps spanning several groups, each part of the tile its own group's scales
    pytest.param(4, 16, 4096, 28672, 128, False,
                 qw.WgmmaConfig(block_k=256, block_n=128, stages=3), id="span-a"),
    pytest.param(4, 1, 4096, 4096, 64, True,
                 qw.WgmmaConfig(block_k=256, num_splits=4, stages=3), id="span-b"),
    pytest.param(4, 64, 2048, 1024, 64, False,
                 qw.WgmmaConfig(block_k=512, num_splits=2, stages=2), id="span-c"),
    pytest.param(8, 5, 4096, 4096, 128, True,
                 qw.WgmmaConfig(block_k=256, block_n=128, stages=2), id="span-d"),
    pytest.param(4, 300, 4096, 4096, 64, False,
                 qw.WgmmaConfig(block_k=128, block_m=128, stages=3), id="span-rowtiles"),
    pytest.param(4, 1, 4096, 28672, 128, True,  # warp-specialized, steps of two groups
                 qw.WgmmaConfig(block_k=256, stages=4, consumers=2), id="span-ws-a"),
    pytest.param(4, 16, 4096, 4096, 64, False,
                 qw.WgmmaConfig(block_k=256, num_splits=4, stages=3, consumers=2),
                 id="span-ws-b"),
    pytest.param(4, 5, 2048, 768, 128, True,
                 qw.WgmmaConfig(block_k=256, num_splits=2, stages=2, consumers=3),
                 id="span-ws-c"),
    # direct outputs of fewer rows than the tile: x unpadded, y unsliced (TMA's bounds)
    pytest.param(4, 1, 4096, 28672, 128, False, None, id="ragged-a"),
    pytest.param(8, 3, 4096, 28672, 4096, False, None, id="ragged-b"),
    pytest.param(4, 5, 1024, 512, 128, False,
                 qw.WgmmaConfig(block_k=256, block_n=128, stages=2), id="ragged-c"),
    pytest.param(4, 200, 2048, 1024, 128, False,
                 qw.WgmmaConfig(block_k=64, block_m=128, stages=3), id="ragged-rowtiles"),
    # INT4 group offsets added in the kernel (s c + o): decode's tiles, direct and split
    pytest.param(4, 16, 4096, 28672, 128, True, None, id="offsets-a"),
    pytest.param(4, 16, 14336, 4096, 128, True, None, id="offsets-b"),
    pytest.param(4, 1, 4096, 6144, 128, True, None, id="offsets-c"),
    pytest.param(4, 64, 4096, 4096, 64, True, None, id="offsets-d"),
    # the dispatch from MANY_ROWS rows: about 192 programs, INT8 in 64-column programs
    pytest.param(4, 48, 4096, 6144, 128, True, None, id="many-rows-a"),
    pytest.param(8, 64, 4096, 28672, 4096, True, None, id="many-rows-b"),
]


@pytest.mark.parametrize("bits,m,k,n,group,asymmetric,config", HOPPER_CASES)
def test_hopper_cases_are_supported(bits, m, k, n, group, asymmetric, config):
    """Every H200 case is one `supports` takes (checked here on any machine: a case outside
    the rules would only show as a ValueError on the rare runs that have a Hopper GPU)."""
    assert qw.supports(bits, m, k, n, group, jnp.bfloat16, jnp.bfloat16, config)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (wgmma)")
@pytest.mark.parametrize("bits,m,k,n,group,asymmetric,config",
                         gpu_picks(HOPPER_CASES, {0, 2, 6, 9, 11, 13, 15, 18, 23}))
def test_kernel_against_reference(bits, m, k, n, group, asymmetric, config):
    check_kernel(bits, m, k, n, group, asymmetric, config)


def check_kernel(bits, m, k, n, group, asymmetric, config):
    """wgmma_matmul against the reference on fresh random codes."""
    w, x = random_case(bits, m, k, n, group, asymmetric, seed=m + k + n)
    out = qw.wgmma_matmul(x, w.packed.T, w.scales, w.offsets, bits=bits, group_size=group,
                          config=config)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    ref = reference(bits, x, w)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-2, f"relative L2 error {err:.2e}"  # bf16 outputs: about 3e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (wgmma)")
def test_linear_dispatches_transposed_codes_to_the_kernel():
    w, x = random_case(4, 16, 4096, 4096, 128, False, seed=5)
    weight = TransposedWeight(w.packed.T, w.scales, None, group_size=128)
    fn = jax.jit(lambda x: linear(x, weight, kernels=select_kernels("gpu", hopper=True)))
    assert "mosaic_gpu" in fn.lower(x).as_text()
    out = np.asarray(fn(x).astype(jnp.float32))
    ref = reference(4, x, w)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
