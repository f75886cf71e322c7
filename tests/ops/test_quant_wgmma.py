"""ops.quant_wgmma (Pallas Mosaic GPU, Hopper): INT4 / INT8 codes stored [N, K] times a few bf16
rows, against ops.quant_matmul's references on the very same codes.

The kernel runs only on a Hopper GPU: Mosaic GPU's interpreter has no wgmma with a register
operand. On the CPU these tests check what can be checked without one (the bit tricks of the
inline PTX and the K order: tests/ops/test_quant_wgmma_layout.py): the
kernel's lowering to Mosaic GPU for an H200 (layout inference and the register conversions run
at lowering time), the dispatch rule and the errors. The kernel itself against the reference
on an H200: tests/ops/test_quant_wgmma_hopper.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from ops import quant_wgmma as qw
from tests.ops.test_quant_wgmma_hopper import random_case

ON_HOPPER = qw.on_hopper()


def test_supports_and_config():
    assert qw.supports(4, 16, 4096, 4096, 128, jnp.bfloat16, jnp.bfloat16)
    assert qw.supports(8, 64, 14336, 4096, 14336, jnp.bfloat16, jnp.bfloat16)  # per channel
    assert not qw.supports(8, 64, 14336, 4096, 14336, jnp.bfloat16, jnp.float32)  # f32 scales
    assert not qw.supports(4, 65, 4096, 4096, 128, jnp.bfloat16, jnp.bfloat16,
                           qw.WgmmaConfig(block_k=128))  # rows: more than one tile holds
    assert not qw.supports(4, 16, 4096, 4000, 128, jnp.bfloat16, jnp.bfloat16)  # N
    assert not qw.supports(4, 16, 4096, 4096, 32, jnp.bfloat16, jnp.bfloat16)  # group < 64
    # steps spanning whole groups (of at least 64): wgmma only (one warpgroup or several)
    span = qw.WgmmaConfig(block_k=256, block_n=128, stages=3)
    assert not qw.supports(4, 16, 4096, 4096, 32, jnp.bfloat16, jnp.bfloat16, span)
    for group in (64, 128):
        assert qw.supports(4, 16, 4096, 4096, group, jnp.bfloat16, jnp.bfloat16, span)
        assert qw.group_parts(4096, group, 256) == (1, 256 // group)
    assert qw.group_parts(4096, 256, 128) == (2, 1) and qw.group_parts(4096, 4096, 256) == (16, 1)
    assert not qw.supports(4, 16, 4096, 4096, 96, jnp.bfloat16, jnp.bfloat16, span)  # not whole
    assert qw.supports(4, 16, 4096, 4096, 128, jnp.bfloat16, jnp.bfloat16,
                       dataclasses.replace(span, consumers=2, block_n=64))
    assert not qw.supports(4, 16, 4096, 4096, 128, jnp.bfloat16, jnp.float32)  # f32 groups
    assert not qw.supports(4, 16, 4096, 4096, 128, jnp.float32, jnp.bfloat16)  # x dtype
    cfg = qw.wgmma_config(4, 16, 4096, 4096, 128)  # 64 column blocks: 4 splits of 4 steps
    assert (cfg.block_k, cfg.block_n, cfg.num_splits, cfg.stages) == (256, 64, 4, 4)
    cfg = qw.wgmma_config(4, 1, 4096, 128256, 128)  # up to 8 rows without a split: 2 stages
    assert (cfg.block_k, cfg.block_n, cfg.num_splits, cfg.stages) == (256, 128, 1, 2)
    assert qw.wgmma_config(4, 16, 4096, 128256, 128).stages == 4
    assert qw.wgmma_config(4, 1, 14336, 4096, 128).stages == 4  # K splits
    cfg = qw.wgmma_config(4, 17, 4096, 4096, 128)  # past WIDE_STEP_ROWS: 8 splits of 4 steps
    assert (cfg.block_k, cfg.block_n, cfg.num_splits, cfg.stages) == (128, 64, 8, 3)
    assert qw.wgmma_config(4, 16, 4096, 4096, 64).block_k == 256  # spans 4 groups
    assert qw.wgmma_config(4, 16, 384, 576, 128).block_k == 128  # K not of 256-K steps
    cfg = qw.wgmma_config(8, 16, 4096, 28672, 4096)  # 224 column blocks of 128: no split
    assert (cfg.block_k, cfg.block_n, cfg.num_splits) == (256, 128, 1)
    assert qw.wgmma_config(8, 16, 4096, 28736, 4096).block_n == 64  # N not a multiple of 128
    # from MANY_ROWS rows: K splits for about 192 programs, INT8 in 64-column programs
    for bits, m, k, n, group, tiles in (
            (4, qw.MANY_ROWS - 1, 4096, 4096, 128, (128, 64, 8)),  # 512 programs below it
            (4, qw.MANY_ROWS, 4096, 4096, 128, (128, 64, 4)),  # o: 256 programs
            (4, 64, 4096, 6144, 128, (128, 64, 2)),  # q/k/v: 192
            (4, 64, 14336, 4096, 128, (128, 64, 4)),  # down: 256
            (4, 64, 4096, 28672, 128, (128, 128, 1)),  # gate/up: 224 of 128 columns
            (8, 64, 4096, 6144, 4096, (256, 64, 2)),
            (8, 64, 4096, 28672, 4096, (256, 64, 1)),  # 448 of 64 columns
            (8, 64, 4096, 128256, 4096, (256, 128, 1))):  # the lm head keeps 128 columns
        cfg = qw.wgmma_config(bits, m, k, n, group)
        assert (cfg.block_k, cfg.block_n, cfg.num_splits) == tiles, (bits, m, k, n, cfg)
    for bits, k, n, group in ((4, 4096, 6144, 64), (8, 14336, 4096, 14336), (4, 1024, 512, 256)):
        assert qw.supports(bits, 16, k, n, group, jnp.bfloat16, jnp.bfloat16)
    ws = qw.WgmmaConfig(block_k=128, consumers=3)  # warp-specialized: N of 3 x 64 columns
    assert qw.supports(4, 16, 4096, 576, 128, jnp.bfloat16, jnp.bfloat16, ws)
    assert not qw.supports(4, 16, 4096, 512, 128, jnp.bfloat16, jnp.bfloat16, ws)
    for consumers in (1, 4):
        assert not qw.supports(4, 16, 4096, 768, 128, jnp.bfloat16, jnp.bfloat16,
                               qw.WgmmaConfig(block_k=128, consumers=consumers))
    # past MAX_ROWS rows: row tiles (block_m), within wgmma's N and the accumulator's registers
    cfg = qw.wgmma_config(4, 1024, 4096, 28672, 128)
    assert cfg.block_m and qw.supports(4, 1024, 4096, 28672, 128, jnp.bfloat16, jnp.bfloat16)
    assert qw.row_tiling(1000, cfg) == (cfg.block_m, -(-1000 // cfg.block_m) * cfg.block_m)
    assert qw.row_tiling(13, qw.WgmmaConfig()) == (16, 16)
    for bad in (qw.WgmmaConfig(block_m=100), qw.WgmmaConfig(block_m=512),
                qw.WgmmaConfig(block_m=256, block_n=128)):
        assert not qw.supports(4, 1024, 4096, 4096, 128, jnp.bfloat16, jnp.bfloat16, bad), bad
    assert qw.supports(4, 1024, 4096, 4096, 128, jnp.bfloat16, jnp.bfloat16,
                       qw.WgmmaConfig(block_k=64, block_m=256, consumers=2))
    assert all(qw.supports(4, 1024, 4096, 28672, 128, jnp.bfloat16, jnp.bfloat16, c)
               for c in qw.sweep_configs(4, 4096, 28672, 1024))
    # from LARGE_M_ROWS rows: the warp-specialized kernel's 256-row tiles, stages by shared memory
    for bits, stages in ((4, 4), (8, 3)):
        cfg = qw.wgmma_config(bits, qw.LARGE_M_ROWS, 4096, 4096, 128 if bits == 4 else 4096)
        assert (cfg.consumers, cfg.block_m, cfg.block_k, cfg.stages) == (2, 256, 64, stages)
        assert qw.smem_bytes(bits, 256, 64, 128, stages) <= qw.WS_SMEM_BYTES
    assert not qw.wgmma_config(4, qw.LARGE_M_ROWS - 1, 4096, 4096, 128).consumers
    # q/k/v (N = 6144 = 32 x 192): three consumers of 128 rows fill the SMs' rounds better
    cfg = qw.wgmma_config(4, 1024, 4096, 6144, 128)  # 256 units, against 192 of 256 rows
    assert (cfg.consumers, cfg.block_m, cfg.stages) == (3, 128, 4)
    assert qw.ws_balance(cfg, 1024, 6144) > 0.95 > 0.75 > qw.ws_balance(
        qw.ws_config(4, 1024, 4096, 6144, 128), 1024, 6144)
    assert qw.wgmma_config(4, 1024, 4096, 28672, 128).consumers == 2  # N: not of 192 columns


def lowered_for_hopper(monkeypatch, bits, m, k, n, group, cfg, asymmetric=False) -> str:
    """The StableHLO text of wgmma_matmul(config=cfg) on x [m, k] and codes [n, k] of `bits`
    with groups of `group` (offsets too when asymmetric), lowered for CUDA with the Hopper
    check told yes: the Mosaic GPU kernel is built in Python, no GPU needed."""
    monkeypatch.setattr(qw, "on_hopper", lambda: True)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k // 8) if bits == 4 else (n, k),
                             jnp.int32 if bits == 4 else jnp.uint8)
    s = jax.ShapeDtypeStruct((k // group, n), jnp.bfloat16)
    args = (x, w, s) + ((s,) if asymmetric else ())
    fn = jax.jit(lambda *a: qw.wgmma_matmul(*a, bits=bits, group_size=group, config=cfg))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("bits,group,consumers,m,block_m", [
    (4, 128, 0, 16, 0), (8, 256, 0, 16, 0), (4, 128, 2, 16, 0), (8, 512, 2, 16, 0),
    (4, 128, 0, 300, 128), (8, 512, 0, 200, 256), (4, 128, 2, 300, 128), (8, 512, 2, 200, 64),
    (4, 64, 0, 16, 0), (4, 64, 0, 300, 128), (4, 64, 2, 16, 0)])
def test_lowers_for_an_h200(bits, group, consumers, m, block_m, monkeypatch):
    """Lowers the kernel to Mosaic GPU as for the GPU: the layouts, the inline conversion and
    the pipeline are built in Python at this point (the Hopper check is told yes); with
    block_m, row tiles over many activation rows."""
    block_n = 128 if not consumers and block_m <= 128 else 64
    cfg = qw.WgmmaConfig(block_k=128, block_n=block_n, num_splits=1 if bits == 4 else 2,
                         stages=2, consumers=consumers, block_m=block_m)
    text = lowered_for_hopper(monkeypatch, bits, m, 512, 128, group, cfg)
    assert "mosaic_gpu" in text
    assert ("int%d_wgmma_ws" % bits in text) == bool(consumers)


@pytest.mark.skipif(ON_HOPPER, reason="the Hopper tests compile and run the kernel")
@pytest.mark.parametrize("m,config,padded,sliced", [
    (3, qw.WgmmaConfig(block_k=128, block_n=128, stages=2), False, False),  # direct: y [3, N]
    (200, qw.WgmmaConfig(block_k=128, block_m=128, stages=2), False, False),  # row tiles
    (300, qw.WgmmaConfig(block_k=128, block_m=128, stages=2), True, True),  # 300: not of 8 rows
    (3, qw.WgmmaConfig(block_k=128, num_splits=2, stages=2), False, True),  # float32 partials
    (16, qw.WgmmaConfig(block_k=128, num_splits=2, stages=2), False, False),  # whole tiles
    (12, qw.WgmmaConfig(block_k=128, num_splits=2, stages=2), True, True),
    (3, qw.WgmmaConfig(block_k=128, num_splits=2, stages=2, consumers=2), True, True)])
def test_direct_outputs_need_no_padding(m, config, padded, sliced, monkeypatch):
    """Fewer than 8 rows or a multiple of 8 lower without XLA's pad of x (the copies' bounds
    stand for it), and a direct output without the slice of y too; float32 partials keep
    their sum's slice to M rows; other row counts, and the warp-specialized kernel, keep x
    padded to whole tiles."""
    monkeypatch.setattr(qw, "on_hopper", lambda: True)
    k, n = 512, 256
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k // 8), jnp.int32)
    s = jax.ShapeDtypeStruct((k // 128, n), jnp.bfloat16)
    fn = jax.jit(lambda x, w, s: qw.wgmma_matmul(x, w, s, bits=4, group_size=128,
                                                 config=config))
    text = fn.trace(x, w, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert ("stablehlo.pad" in text) == padded
    assert ("stablehlo.slice" in text) == sliced


@pytest.mark.skipif(ON_HOPPER, reason="the Hopper tests compile and run the kernel")
@pytest.mark.parametrize("bits,group,config,in_kernel", [
    (4, 128, None, True),  # decode tiles: s c + o in the kernel, the output direct
    (4, 128, qw.WgmmaConfig(block_k=128, num_splits=2, stages=2), True),  # split partials
    (4, 128, qw.WgmmaConfig(block_k=128, stages=2, consumers=2), True),  # warp-specialized
    (4, 128, qw.WgmmaConfig(block_k=64, stages=2, consumers=2, num_splits=2), True),
    (4, 128, qw.WgmmaConfig(block_k=64, stages=2, consumers=2, block_m=64), True),  # row tiles
    (4, 512, None, False),  # per channel: offsets times the sums of x, after the kernel
    (8, 128, None, False)])  # INT8: the same, in XLA
def test_where_the_offsets_are_added(bits, group, config, in_kernel, monkeypatch):
    """INT4 group offsets enter the kernel (its conversion then
    subtracts 128, not 136, and no XLA product of the activations' group sums by o' follows);
    the other forms keep that XLA product."""
    monkeypatch.setattr(qw, "on_hopper", lambda: True)
    m, k, n = 16, 512, 256
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k // 8) if bits == 4 else (n, k),
                             jnp.int32 if bits == 4 else jnp.uint8)
    s = jax.ShapeDtypeStruct((k // group, n), jnp.bfloat16)
    fn = jax.jit(lambda x, w, s, o: qw.wgmma_matmul(x, w, s, o, bits=bits, group_size=group,
                                                    config=config))
    text = fn.trace(x, w, s, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert ("stablehlo.dot_general" not in text) == in_kernel
    if bits == 4:
        assert ("mov.b32 k, 0x43004300" in text) == in_kernel  # c itself, or c - 8
        assert ("mov.b32 k, 0x43084308" in text) != in_kernel


def test_float32_tiles_of_the_warp_specialized_kernel_fit_shared_memory(monkeypatch):
    """With K splits the warp-specialized row tiles write float32 partials, twice the bytes of
    the bf16 output: wgmma_matmul lowers the stages until they fit an SM. INT4 offsets enter
    the kernel (s c + o), so with one split the output stays bf16 and direct, 4 stages."""
    monkeypatch.setattr(qw, "on_hopper", lambda: True)
    seen = []

    def record(xp, codes, scales, offsets=None, *, cfg, block_m, direct, **_):
        seen.append((cfg, block_m, direct, offsets is not None))
        if direct:
            return jnp.zeros((xp.shape[0], codes.shape[0]), jnp.bfloat16)
        return jnp.zeros((cfg.num_splits, codes.shape[0], xp.shape[0]), jnp.float32)
    monkeypatch.setattr(qw, "ws_product", record)  # the name wgmma_matmul calls
    m, k, n = 1024, 4096, 4096
    cfg = qw.wgmma_config(4, m, k, n, 128)
    assert cfg.consumers == 2 and cfg.stages == 4 and cfg.block_m == 256
    w, x = random_case(4, m, k, n, 128, True, seed=7)
    qw.wgmma_matmul(x, w.packed.T, w.scales, w.offsets, bits=4, group_size=128)
    qw.wgmma_matmul(x, w.packed.T, w.scales, w.offsets, bits=4, group_size=128,
                    config=dataclasses.replace(cfg, num_splits=2))  # float32 partials
    (direct_cfg, _, direct, offsets_in), (got, block_m, split_direct, _) = seen
    assert direct and offsets_in and direct_cfg.stages == 4
    assert not split_direct and got.stages == 2 and got.consumers == 2
    columns = 2 * got.block_n
    assert qw.smem_bytes(4, block_m, got.block_k, columns, got.stages, 4) <= qw.WS_SMEM_BYTES
    assert qw.smem_bytes(4, block_m, got.block_k, columns, 3, 4) > qw.WS_SMEM_BYTES
