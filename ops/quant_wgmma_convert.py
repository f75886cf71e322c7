"""The in-kernel building blocks of the Hopper kernels (ops/quant_wgmma.py, one warpgroup;
ops/quant_wgmma_ws.py, warp-specialized): the conversion of loaded code words to bf16 in
wgmma's register layout, the group and channel scales, and the output store. See
ops/quant_wgmma.py for the design.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu


def swizzled(block_minor: int, bits: int):
    """TMA / wgmma transforms for a tile whose minor dimension holds block_minor elements."""
    swizzle = plgpu.find_swizzle(block_minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _asm(code: str, word):
    """One inline-PTX block over a 32-bit register -> a 32-bit register (two bf16)."""
    return mgpu_utils.inline_ptx(code, word, result_types=ir.IntegerType.get_signless(32))


def _int4_pairs(word, j: int, zero: int = 8):
    """bf16x2 (c_j - zero, c_{j+4} - zero) of nibbles j and j + 4 of a 32-bit word of eight
    codes (zero 8: symmetric codes; 0: the codes themselves, for offsets): a shift, one LOP3
    (nibbles under bf16 128.0's exponent: 128 + c) and one bf16x2 subtraction of 128 + zero,
    all exact."""
    shift = f"shr.u32 t, $1, {4 * j}; " if j else "mov.b32 t, $1; "
    lop3 = "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
    bias = 0x4300 + zero  # bf16 128 + zero (the mantissa's unit is 1 between 128 and 256)
    return _asm("{ .reg .b32 t, k; " + shift + lop3 +
                f"mov.b32 k, {bias << 16 | bias:#010x}; sub.bf16x2 $0, t, k; }}", word)


def _int8_pairs(word, j: int):
    """bf16x2 (c_2j - 128, c_2j+1 - 128) of bytes 2j and 2j + 1 of a 32-bit word of four codes:
    one PRMT puts each byte under 0x43 (128 + c when c < 128, 2c when not), one AND clears the
    byte's top bit (128 + (c mod 128)), one LOP3 builds 256 - 128 [c >= 128], and a bf16x2
    subtraction of the two gives c - 128, exactly."""
    sel = 0x4140 if j == 0 else 0x4342
    return _asm("{ .reg .b32 s0, s1, s2; "
                f"prmt.b32 s0, $1, 0x43, {sel:#06x}; and.b32 s1, s0, 0xff7fff7f; "
                "lop3.b32 s2, s0, 0xff80ff80, 0x00800080, 0x6A; sub.bf16x2 $0, s1, s2; }", word)


def codes_to_bf16(bits: int, block_n: int, block_k: int, unsigned: bool = False):
    """An inline Mosaic GPU function: the code tile [BN, BK] as loaded (one 32-bit register of
    eight INT4 / four INT8 codes per thread, layout WGMMA_UPCAST_4X / _2X) -> bf16 c - z
    [BN, BK] (INT4 only: `unsigned`, c itself) in wgmma's A layout (WGMMA), each register
    converted in place, with no shuffle between threads. What moves is the K order: register j
    of a loaded word holds the codes listed in `wgmma_k_order`, and the caller permutes x's
    columns to match."""
    upcast = plgpu.Layout.WGMMA_UPCAST_4X if bits == 4 else plgpu.Layout.WGMMA_UPCAST_2X
    per_word, pairs = (8, _int4_pairs) if bits == 4 else (4, _int8_pairs)
    if unsigned:
        if bits != 4:
            raise ValueError("codes_to_bf16: unsigned codes are for INT4")
        pairs = functools.partial(_int4_pairs, zero=0)
    shape = (block_n, block_k)
    layout = plgpu.Layout.WGMMA.to_mgpu()

    @plgpu.inline_mgpu(arg_types=(upcast,), return_type=plgpu.ShapeDtypeStruct(
        shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def convert(_, codes):
        i32 = ir.IntegerType.get_signless(32)
        vec = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(layout.registers_shape(shape), dtype=object)
        ndim = out.ndim
        for idx, reg in np.ndenumerate(codes.registers):
            word = mgpu_utils.bitcast(reg, i32)
            for j in range(per_word // 2):  # WGMMA registers per loaded word
                new = (idx[0], idx[1] * (per_word // 2) + j) + idx[2:ndim]
                out[new] = mgpu_utils.bitcast(pairs(word, j), vec)
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)
    return upcast, convert


def group_scaled(w, s_row_ref, layout, o_row_ref=None):
    """The dequantized tile w [BN, BK] times its step's group scale per row, from s_row_ref
    [BN] (shared memory) loaded in `layout`'s row layout: the bf16 rounding of s (c - z);
    with o_row_ref (w the codes c themselves), plus the group's offset per row: s c + o."""
    rows = lambda ref: jax.lax.broadcast_in_dim(  # noqa: E731  [BN] -> [BN, BK]
        plgpu.load(ref, layout=layout.reduce(1)), w.shape, [0])
    w = w * rows(s_row_ref)
    return w if o_row_ref is None else w + rows(o_row_ref)


def scaled_parts(w, group_count: int, layout, scales=None, offsets=None):
    """A step's dequantized tile w [BN, BK] in `group_count` parts of its columns, each times
    its own group's scales (plus offsets): [(bf16 [BN, BK / group_count], its columns)].
    scales(j) / offsets(j): the [BN] shared-memory rows of part j's group (scales None:
    per-channel scales, applied to the sum later; the parts are the codes as they are)."""
    width = w.shape[1] // group_count
    out = []
    for j in range(group_count):
        cols = slice(j * width, (j + 1) * width) if group_count > 1 else slice(None)
        part = w[:, cols] if group_count > 1 else w
        if scales is not None:
            part = group_scaled(part, scales(j), layout, offsets(j) if offsets else None)
        out.append((part, cols))
    return out


def channel_scaled(acc, s_ref):
    """The float32 sum acc [BN, MP] (WGMMA layout) times per-channel scales s_ref [BN] read
    from global memory once."""
    s = plgpu.load(s_ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    return acc * jax.lax.broadcast_in_dim(s.astype(jnp.float32), acc.shape, [0])


def store_tile(acc, tile_smem, dst, direct: bool):
    """The float32 sum acc [BN, BM] (WGMMA layout) to global memory `dst` through `tile_smem`:
    `direct`, as bf16 transposed on its way to shared memory (tile and dst [BM, BN]), else as
    it is (float32 partials, [BN, BM])."""
    if direct:
        tile_smem.T[...] = plgpu.layout_cast(acc.astype(tile_smem.dtype),
                                             plgpu.Layout.WGMMA_TRANSPOSED)
    else:
        tile_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile_smem, dst)
