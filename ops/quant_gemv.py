"""The quantized matmul's decode path for one or two activation rows ("fma" path of
ops/quant_matmul.py): x [M, K] @ dequantize(W) with W4A16 / W8A16 packed weights, float32
multiply-adds instead of tensor cores.

This kernel is bound by its instructions, not by memory (Nsight Compute on an H200: reading the
packed words alone runs at 3.3 TB/s), so each weight is made to cost as few as possible:

* Mantissa codes. A code c moved to mantissa bits p.. under the exponent of 1.0 is the float
  v = 1 + c 2^(p-23), exactly, with no integer-to-float conversion. For int4 one funnel shift
  (SHF) serves two nibbles and one LOP3 per weight places a nibble and ORs the exponent in:
  rotating the word by 16, 8 or 24 bits puts nibble pairs (0, 7), (1, 2), (5, 6) at bits 16 and
  12, and nibbles 3 and 4 already sit there, so p is 16 or 12. For int8 one shift and one LOP3
  put the byte at p = 15. The LOP3 is PTX through inline assembly (compiled from jnp, the
  mask and the OR come out as two LOP3 per weight).
* Pre-scaled activations. The kernel reads x' = x 2^(23-p) as float32 (computed outside, K
  values per row), so x' v = x c + x 2^(23-p) costs one fused multiply-add per weight, PTX
  fma.rn.f32 (Triton does not contract Pallas's separate multiply and add).
* The excess x 2^(23-p) and the zero point's x zero do not depend on the output column: where
  a K tile lies in one scale group (group_size a multiple of block_k, or per channel), they are
  subtracted once per tile from a [1, BN] row, s (sum(x') + zero sum(x)), from two 1-D sums of
  the tile's activations. Finer groups subtract them per packed row instead.
* The group scale multiplies a word's 8-code sum once (one more fma into the [R, BN]
  accumulator, reduced over R at the end); asymmetric offsets add o sum(x) per tile.

Its reference is ops/quant_matmul.py's `int4_matmul_reference` / `int8_matmul_reference` (the
tests compare both on the same packed arrays); `int4_matmul` / `int8_matmul` dispatch here.

Precision: x' 2^(23-p) carries up to 2^11 x, summed and cancelled in float32, which leaves
about 1e-5 of the output's size (the tests' float32 tolerance is 1e-3).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.ptx import fma
from ops.quant_tiles import _load, _program_tiles, _tile_rows_and_scales

ONE_BITS = 0x3F800000  # float32 1.0
# int4: per nibble j, the left rotation of the word that brings it to bit p_j.
NIBBLE_ROTATIONS = (16, 8, 8, 0, 0, 24, 24, 16)
NIBBLE_POSITIONS = tuple((4 * j + r) % 32 for j, r in enumerate(NIBBLE_ROTATIONS))  # 16 / 12
BYTE_POSITION = 15  # int8: the code's mantissa position


def code_positions(bits: int) -> tuple[int, ...]:
    """Mantissa position p of each code of a packed element (8 nibbles, or the byte)."""
    return NIBBLE_POSITIONS if bits == 4 else (BYTE_POSITION,)


def prescale(x: jax.Array, bits: int) -> jax.Array:
    """x [M, K] -> float32 x 2^(23-p) of each K row's code position (exact)."""
    positions = code_positions(bits)
    factors = np.array([2.0 ** (23 - p) for p in positions], np.float32)
    k = x.shape[-1]
    return x.astype(jnp.float32) * jnp.asarray(np.resize(factors, k))


def mantissa_codes(word, bits: int, interpret: bool) -> list:
    """The floats 1 + c 2^(p-23) [R, BN] of each code c of a packed tile (int32 [R, BN]), in
    code order (p: `code_positions`). The rotations are shared by nibble pairs (LLVM emits a
    funnel shift); the mask-and-OR is one PTX lop3 per code when compiled."""
    u = jax.lax.bitcast_convert_type(word, jnp.uint32)
    if bits == 4:
        rotated = {r: _rotl(u, r) for r in set(NIBBLE_ROTATIONS)}
        sources = [rotated[r] for r in NIBBLE_ROTATIONS]
    else:
        sources = [u << BYTE_POSITION]
    width = 0xF if bits == 4 else 0xFF
    return [_under_one(src, width << p, interpret)
            for src, p in zip(sources, code_positions(bits))]


def _rotl(u, r: int):
    """uint32 left rotation by r bits (LLVM emits one funnel shift)."""
    return (u << r) | jax.lax.shift_right_logical(u, jnp.uint32(32 - r)) if r else u


def _under_one(src, mask: int, interpret: bool):
    """float32 with bits (src & mask) | 1.0 (src uint32): one PTX LOP3 when compiled."""
    if interpret:
        bits_ = (src & jnp.uint32(mask)) | jnp.uint32(ONE_BITS)
    else:  # (src & mask) | 1.0 in one LOP3 (0xEA: (a & b) | c); Triton's asm op takes
        # signless integers: int32, not uint32
        [bits_] = plgpu.elementwise_inline_asm(
            f"lop3.b32 $0, $1, {mask:#010x}, {ONE_BITS:#010x}, 0xEA;",
            args=[jax.lax.bitcast_convert_type(src, jnp.int32)], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(src.shape, jnp.int32)])
    return jax.lax.bitcast_convert_type(bits_, jnp.float32)


def gemv_kernel(xs_ref, w_ref, s_ref, *refs, bits: int, m: int, n: int, rows: int,
                group_rows: int, num_groups: int, block_m: int, block_n: int, step: int,
                num_splits: int, asymmetric: bool, interpret: bool):
    # xs_ref: [M, K] float32 activations pre-scaled by `prescale` (act-order already gathered)
    # w_ref:  [K/8, N] int32 (int4) or [K, N] uint8 (int8): the packed weights, `rows` rows
    # s_ref:  [G, N] group scales; refs: (o_ref [G, N] offsets when asymmetric), x_ref [M, K]
    #         the activations, out_ref [M, N] in x's dtype (one split) or float32 (a partial)
    o_ref = refs[0] if asymmetric else None
    x_ref, out_ref = refs[-2], refs[-1]
    mb = pl.program_id(0)
    per_word = 8 if bits == 4 else 1  # K rows per packed row
    k_total = rows * per_word
    zero = 0 if asymmetric else 2 ** (bits - 1)
    cols, col_ok, _, _, first, last = _program_tiles(m, n, rows, block_m, block_n, step,
                                                     num_splits)
    uniform = group_rows % step == 0 or num_groups == 1  # a tile lies in one group

    def full(a):  # -> [R, BN]
        return jnp.broadcast_to(a, (step, block_n))

    def body(t, carry):  # carry: block_m x ([R, BN] accumulator, [1, BN] tile corrections)
        r, r_ok, s, o = _tile_rows_and_scales(t, step, rows, group_rows, num_groups, s_ref,
                                              o_ref, cols, col_ok)  # s, o [1 or R, BN]
        word = _load(w_ref, r, cols, r_ok, col_ok, jnp.int32)  # [R, BN]
        codes = mantissa_codes(word, bits, interpret)  # per code j: [R, BN]
        out = []
        for i, (acc, cor) in enumerate(carry):
            row = jnp.minimum(mb * block_m + i, m - 1)

            def load_x(ref, kc):
                view = ref.at[row, kc]
                if r_ok is None:
                    return plgpu.load(view).astype(jnp.float32)
                return plgpu.load(view, mask=kc < k_total, other=0.0).astype(jnp.float32)

            xs = [load_x(xs_ref, r * per_word + j) for j in range(per_word)]  # [R] each
            if uniform:  # the column-free terms once per tile, from 1-D sums
                kk = t * step * per_word + jnp.arange(step * per_word, dtype=jnp.int32)
                x1 = jnp.sum(load_x(xs_ref, kk))
                x0 = jnp.sum(load_x(x_ref, kk))
                cor = cor - s * (x1 + zero * x0)
                if asymmetric:
                    cor = cor + o * x0
                part = full(xs[0][:, None]) * codes[0]
            else:  # per packed row
                xr = [load_x(x_ref, r * per_word + j) for j in range(per_word)]
                x0 = sum(xr[1:], xr[0])  # [R]
                part = fma(full(xs[0][:, None]), codes[0],
                           full((-(sum(xs[1:], xs[0]) + zero * x0))[:, None]), interpret)
                if asymmetric:
                    acc = fma(full(x0[:, None]), full(o), acc, interpret)
            for x, v in zip(xs[1:], codes[1:]):
                part = fma(full(x[:, None]), v, part, interpret)  # [R, BN]
            out.append((fma(part, full(s), acc, interpret), cor))
        return tuple(out)

    init = tuple((jnp.zeros((step, block_n), jnp.float32), jnp.zeros((1, block_n), jnp.float32))
                 for _ in range(block_m))
    carry = jax.lax.fori_loop(first, last, body, init)
    for i, (acc, cor) in enumerate(carry):
        row_vec = jnp.full((1,), mb * block_m + i, jnp.int32)
        result = jnp.sum(acc, axis=0)[None, :] + cor  # [1, BN]
        ok = jnp.broadcast_to((row_vec < m)[:, None], result.shape)
        if col_ok is not None:
            ok &= col_ok[None, :]
        out_row = jnp.where(row_vec < m, row_vec, m)
        plgpu.store(out_ref.at[out_row[:, None], cols[None, :]], result.astype(out_ref.dtype),
                    mask=ok)
