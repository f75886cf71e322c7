"""The warp-specialized, persistent form of ops/quant_wgmma.py's kernel
(`WgmmaConfig(consumers=C)`, C = 2 or 3): the same conversion, scales and product per 64-column
slice, arranged so that more warps share one copy of x.

One program per SM (`grid` = the SM count), each of C + 1 warpgroups:
- the last warpgroup only issues the TMA copies (`plgpu.emit_pipeline_warp_specialized`, with
  few registers);
- each of the C consumer warpgroups converts and multiplies its own `block_n` rows of a code
  tile [C * block_n, block_k], all of them against the same x tile [BM, block_k] in shared
  memory (the one-warpgroup kernel re-reads x for every block_n columns). BM is all the rows
  (padded to a multiple of 8, up to 64) or, with `block_m`, one row tile of that many.

The programs walk the work units (a C * block_n column tile times a row tile times one of
`num_splits` K ranges) in turn (`plgpu.nd_loop`); a unit's pipeline starts and drains inside
the unit. With one split each consumer writes its bf16 tile of the product [MP, N] itself,
transposed on its way through shared memory; with more, float32 partials [splits, N, MP], which
ops.quant_wgmma.wgmma_matmul sums. INT4 group offsets are added in the kernel (s c + o), and
steps may span whole groups (`group_parts`), as in the one-warpgroup kernel.

Why: sharing x's tile halves the x bytes per product at many rows. The dispatch runs it from
LARGE_M_ROWS rows (256-row tiles, two consumers: 8-12% faster than the one-warpgroup row tiles
at 1024 rows on the H200); at decode sizes it is slower than the one-warpgroup kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ops.quant_wgmma_convert import (channel_scaled, codes_to_bf16, scaled_parts, store_tile,
                                     swizzled)
from ops.quant_wgmma_tiles import WgmmaConfig, group_parts

MEMORY_REGISTERS = 40  # registers per thread of the copy warpgroup (the rest go to consumers)


def _ws_kernel(x_gmem, w_gmem, s_gmem, *refs, bits: int, grouped: bool, offsets: bool,
               steps: int, block_n: int, block_k: int, group_steps: int, group_count: int,
               stages: int, block_m: int, consumers: int,
               splits: int, row_tiles: int, units: int, direct: bool):
    # x_gmem [MP, K] bf16 (columns in wgmma_k_order); w_gmem [N, K] codes; s_gmem [G, N]
    # (a step lies in one group, group_steps steps each, or spans group_count whole groups);
    # refs: with `offsets` (INT4 groups) first o_gmem [G, N], each group's offset added to its
    # scaled codes (s c + o); then out_gmem: `direct` [MP, N] bf16 (one split), else
    # [splits, N, MP] float32 partials; out_smem: each consumer's tile, [consumers, BM,
    # block_n] bf16 / [consumers, block_n, BM] float32 (BM = block_m rows of x per unit, MP / BM
    # row tiles)
    refs = list(refs)
    o_gmem = refs.pop(0) if offsets else None
    out_gmem, out_smem = refs
    wg = lax.axis_index("wg")
    cta_n = consumers * block_n  # a unit's output columns
    upcast, inline = codes_to_bf16(bits, block_n, block_k, unsigned=offsets)
    tables = (s_gmem, o_gmem) if offsets else (s_gmem,) if grouped else ()  # per step

    def get_pipeline(body, context, first):
        specs = [plgpu.BlockSpec((cta_n, block_k), lambda k: (0, k),
                                 transforms=swizzled(block_k, bits)),
                 plgpu.BlockSpec((block_m, block_k), lambda k: (0, k),
                                 transforms=swizzled(block_k, 16))]
        for _ in tables:  # this step's groups' scales (and offsets) of the tile's columns
            specs.append(plgpu.BlockSpec((group_count, cta_n),
                                         lambda k: ((first + k) // group_steps, 0)))
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs,
            wg_axis="wg", num_compute_wgs=consumers, max_concurrent_steps=stages,
            compute_context=context)

    def views(nb, mb, split):  # a unit's slices of the inputs
        cols = pl.ds(nb * cta_n, cta_n)
        ks = pl.ds(split * steps * block_k, steps * block_k)
        x_rows = x_gmem.at[pl.ds(mb * block_m, block_m), ks]
        return [w_gmem.at[cols, ks], x_rows] + [t.at[:, cols] for t in tables]

    def multiply(acc_ref, w_tile, x_tile, s_smem, table_row):
        # acc_ref [block_n, BM] += dequant(w_tile [block_n, block_k]) @ x_tile [BM, block_k]^T
        # in `group_count` group parts; table_row(table, j): part j's [block_n] row of a table
        w = inline(plgpu.load(w_tile, layout=upcast))  # bf16 c - z (c: offsets)
        for part, cols in scaled_parts(
                w, group_count, plgpu.Layout.WGMMA,
                (lambda j: table_row(s_smem[0], j)) if grouped else None,
                (lambda j: table_row(s_smem[1], j)) if offsets else None):
            plgpu.wgmma(acc_ref, part, x_tile.at[:, cols].T)  # [block_n, width] @ [width, BM]
        plgpu.wgmma_wait(0)

    ignore = lambda *_, **__: None  # noqa: E731  (allocations depend on the specs only)

    @functools.partial(pl.run_scoped,
                       allocs=get_pipeline(ignore, ignore, 0).get_allocations(*views(0, 0, 0)),
                       collective_axes="wg")
    def _scope(allocs):
        @plgpu.nd_loop((units,), collective_axes="sm")
        def _unit(info):
            (u,) = info.index
            split, tile = u % splits, u // splits
            mb, nb = tile % row_tiles, tile // row_tiles
            rows = pl.ds(wg * block_n, block_n)  # this consumer's rows of the code tile
            out_cols = pl.ds(nb * cta_n + wg * block_n, block_n)
            out_rows = pl.ds(mb * block_m, block_m)
            dst = (out_gmem.at[out_rows, out_cols] if direct
                   else out_gmem.at[split, out_cols, out_rows])

            def store(acc):  # [block_n, BM] float32: scaled per channel, to the output
                if not grouped:  # per-channel scales, once per unit
                    acc = channel_scaled(acc, s_gmem.at[0, out_cols])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last unit's copy
                store_tile(acc, out_smem.at[wg], dst, direct)

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped,
                                   acc_ref=plgpu.ACC((block_n, block_m), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    store(acc_ref[...])

            def body(_, w_smem, x_smem, *rest):
                *s_smem, acc_ref = rest  # this consumer's rows of the code tile, all of x's
                multiply(acc_ref, w_smem.at[rows], x_smem, s_smem,
                         lambda table, j: table.at[j, rows])
                return acc_ref

            get_pipeline(body, context, split * steps)(*views(nb, mb, split),
                                                       allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def sm_count() -> int:
    """Programs of the persistent grid: the GPU's SMs (132 on an H200 where unknown)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def ws_product(xp, codes, scales, offsets=None, *, bits: int, group_size: int,
               cfg: WgmmaConfig, block_m: int, direct: bool, out_rows: int | None = None):
    """xp [MP, K] (columns in wgmma_k_order; MP a multiple of block_m) times the codes [N, K]
    (jnp.int4 / int8) with scales [G, N] (and INT4 group offsets [G, N], added in the kernel:
    ops.quant_wgmma.offsets_in_kernel), by the warp-specialized kernel: the product
    [out_rows, N] bf16 when `direct` (one split; out_rows default MP: the stores past them are
    dropped), else float32 partials [splits, N, MP]."""
    k = xp.shape[1]
    mp = -(-xp.shape[0] // block_m) * block_m
    n = codes.shape[0]
    row_tiles = mp // block_m
    units = n // (cfg.consumers * cfg.block_n) * row_tiles * cfg.num_splits
    group_steps, group_count = group_parts(k, group_size, cfg.block_k)
    steps = k // cfg.block_k // cfg.num_splits
    kernel = functools.partial(
        _ws_kernel, bits=bits, grouped=scales.shape[0] > 1, offsets=offsets is not None,
        steps=steps, block_n=cfg.block_n, block_k=cfg.block_k,
        group_steps=group_steps, group_count=group_count, stages=cfg.stages,
        block_m=block_m, consumers=cfg.consumers, splits=cfg.num_splits, row_tiles=row_tiles,
        units=units, direct=direct)
    tiles = cfg.consumers  # output tiles in shared memory
    if direct:
        out_type = jax.ShapeDtypeStruct((out_rows or mp, n), jnp.bfloat16)
        tile = plgpu.SMEM((tiles, block_m, cfg.block_n), jnp.bfloat16,
                          transforms=swizzled(cfg.block_n, 16))
    else:
        out_type = jax.ShapeDtypeStruct((cfg.num_splits, n, mp), jnp.float32)
        tile = plgpu.SMEM((tiles, cfg.block_n, block_m), jnp.float32)
    return plgpu.kernel(
        kernel, out_type=out_type, grid=(min(sm_count(), units),), grid_names=("sm",),
        num_threads=cfg.consumers + 1, thread_name="wg", scratch_types=[tile],
        kernel_name=f"int{bits}_wgmma_ws")(
            xp, codes, scales, *(() if offsets is None else (offsets,)))
