"""Register layouts and the K order of ops/quant_wgmma.py's inline code conversion: which
register layout the dequantized tile takes (`tile_layout`), where a Mosaic GPU layout puts
each element (`element_coords`) and how to relabel registers between two layouts that keep
every element in its thread (`register_relabeling`, for mma.sync's operand), the K position
each tile column multiplies (`wgmma_k_order`) and the stored K orders of the codes
(`K_ORDERS`, `stored_k_positions`; ops.matmul.reorder_k writes them). Pure functions over
shapes and layouts, numpy and Python only: they run on any backend (tests/ops/
test_quant_wgmma_layout.py).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu


def tile_layout(instruction: str):
    """The register layout of the dequantized tile: wgmma's A operand (WGMMA) or mma.sync's
    (MMA_LHS, four warps along the tile's rows)."""
    if instruction == "wgmma":
        return plgpu.Layout.WGMMA
    return plgpu.Layout.MMA_LHS(jnp.bfloat16, m_warps=4)


def element_coords(layout, shape: tuple[int, ...]) -> dict:
    """Where each register value of a Mosaic GPU TiledLayout lives: {(warp, lane, register
    index, vector element): element coordinates} over an array of `shape`, in plain integers
    (the arithmetic of TiledLayout.thread_idxs, for every thread of the warpgroup)."""
    contig = mgpu_utils.get_contiguous_strides(shape)
    strides = layout.tiling.tile_strides(contig)
    tiled = layout.tiled_tiling_shape
    suffix = strides[-layout.tiled_tiling_rank:]

    def spread(index: int, dims) -> list[int]:  # a warp / lane index -> tiled-dimension indices
        sizes = [d.times if isinstance(d, mgpu_fa.Replicated) else tiled[d] for d in dims]
        full = [0] * len(tiled)
        for d, stride, size in zip(dims, mgpu_utils.get_contiguous_strides(tuple(sizes)), sizes):
            if not isinstance(d, mgpu_fa.Replicated):
                full[d] = index // stride % size
        return full

    out = {}
    for warp in range(4):
        warp_at = spread(warp, layout.warp_dims)
        for lane in range(32):
            lane_at = spread(lane, layout.lane_dims)
            offset = sum((a + b) * st for a, b, st in zip(warp_at, lane_at, suffix))
            for reg in np.ndindex(layout.registers_shape(shape)):
                base = offset + sum(r * st for r, st in zip(reg, strides))
                for v in range(layout.vector_length):
                    flat = base + v * strides[layout.vector_dim]
                    out[(warp, lane, reg, v)] = tuple(int(c) for c in np.unravel_index(flat, shape))
    return out


@functools.cache
def register_relabeling(src, dst, shape: tuple[int, ...]) -> dict:
    """{register index under `src`: register index under `dst`} for two layouts that keep
    every element in the same thread and vector slot (so relabeling the registers moves no
    data); ValueError where they do not."""
    where_dst = {c: key for key, c in element_coords(dst, shape).items()}
    out = {}
    for (warp, lane, reg, v), c in element_coords(src, shape).items():
        warp2, lane2, reg2, v2 = where_dst[c]
        if (warp2, lane2, v2) != (warp, lane, v) or out.setdefault(reg, reg2) != reg2:
            raise ValueError(f"register_relabeling: {src} and {dst} place {c} in different "
                             "threads or slots")
    return out


def wgmma_k_order(bits: int, k: int):
    """The K position whose activation multiplies column c of the dequantized tile, for c in
    0..K-1 (numpy int32 [K]). Per thread, a loaded word holds codes of consecutive K positions,
    while wgmma's A fragment holds pairs (2t + 8j, 2t + 8j + 1) (t = lane mod 4).
    ops.quant_wgmma_convert.codes_to_bf16 makes register j of the word from the pair it converts without moving data: INT4 nibbles
    (j, j + 4) of the word of K positions 8t..8t+7 in each 32-column block; INT8 bytes (2j, 2j+1)
    of the word of positions 8 (t mod 2) + 4 (t div 2) + 0..3 in each 16-column block."""
    if bits == 4:  # c = 8j + 2t + h <- q = 8t + 4h + j
        j, t, h = np.meshgrid(np.arange(4), np.arange(4), np.arange(2), indexing="ij")
        q = (8 * t + 4 * h + j).reshape(-1)  # [32] in c order
        span = 32
    else:  # c = 8j + 2t + h <- q = 8 (t mod 2) + 4 (t div 2) + 2j + h
        j, t, h = np.meshgrid(np.arange(2), np.arange(4), np.arange(2), indexing="ij")
        q = (8 * (t % 2) + 4 * (t // 2) + 2 * j + h).reshape(-1)  # [16]
        span = 16
    return (np.arange(0, k, span)[:, None] + q[None, :]).reshape(-1).astype(np.int32)


K_ORDERS = ("natural", "wgmma")  # how stored [N, K] codes lie along K (TransposedWeight.k_order)
K_ORDER_SPAN = {4: 32, 8: 16}  # bits -> the K block within which `wgmma_k_order` permutes


def stored_k_positions(bits: int, k: int, k_order: str) -> np.ndarray | None:
    """The K position of x that stored column q of codes in `k_order` multiplies, for q in
    0..K-1 (numpy int32 [K]); None for "natural" (q itself). "wgmma": the codes reordered
    (ops.matmul.reorder_k) so that column c of this kernel's dequantized tile is K position c:
    stored column wgmma_k_order[c] holds position c, x enters the kernel as it is, and any other
    product of those codes takes x[:, positions] first. The permutation stays within blocks of
    K_ORDER_SPAN positions, so groups (of whole blocks) keep their scales."""
    if k_order not in K_ORDERS:
        raise ValueError(f"k_order {k_order!r} must be one of {K_ORDERS}")
    if k_order == "natural":
        return None
    if k % K_ORDER_SPAN[bits]:
        raise ValueError(f"k_order 'wgmma': K = {k} is not a multiple of {K_ORDER_SPAN[bits]}")
    return np.argsort(wgmma_k_order(bits, k)).astype(np.int32)
