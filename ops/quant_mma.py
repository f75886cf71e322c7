"""The tensor-core decode path of the quantized matmul ("mma"; see ops/quant_matmul.py's module
docstring): the kernel and its code unpacking straight into the activation dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from ops.quant_tiles import _dequant_tile, _load, _load_codes, _program_tiles

# 16-bit magic numbers whose lowest mantissa bit is worth 1: bf16 128.0 (7 mantissa bits: codes
# < 128) and fp16 1024.0 (10 bits: codes < 1024). bits | magic is exactly base + code.
MAGIC16 = {jnp.dtype(jnp.bfloat16): (0x4300, 128), jnp.dtype(jnp.float16): (0x6400, 1024)}


def _codes_as(word, j: int, zero: int, bits: int, dtype):
    """Code j of each packed element as `dtype`, exactly c - zero + excess: (tile, excess).

    16-bit activations (int8: fp16 only) take the magic-number bits straight in their own
    dtype, c | magic16 = base + c (one LOP3, plus a shift for nibbles 1..7, and no float
    instruction): excess = base + zero, which the caller removes from the product once per tile
    (excess x the activations' row sums). Otherwise the exact float32 c - zero, cast (excess 0).
    """
    dtype = jnp.dtype(dtype)
    if dtype in MAGIC16 and not (bits == 8 and dtype == jnp.dtype(jnp.bfloat16)):
        magic, base = MAGIC16[dtype]
        if bits == 4:
            c = word if j == 0 else jax.lax.shift_right_logical(word, 4 * j)
            pattern = (c & 0xF) | magic
        else:
            pattern = word | magic  # int32 codes < 256
        return jax.lax.bitcast_convert_type(pattern.astype(jnp.int16), dtype), base + zero
    return _dequant_tile(word, j, zero, bits).astype(dtype), 0


def _mma_kernel(x_ref, w_ref, s_ref, *refs, bits: int, m: int, n: int, rows: int,
                group_rows: int, num_groups: int, block_m: int, block_n: int, step: int,
                num_splits: int, asymmetric: bool, stored_nk: bool = False):
    # Path "mma"; refs as in _matmul_kernel: x_ref [M, K], w_ref [K/8, N] int32 or [K, N]
    # uint8, s_ref (and o_ref) [G, N], out_ref [M, N] (x dtype, or this split's float32
    # partial); `stored_nk`: w_ref [N, K/8] / [N, K] (the same words, stored transposed).
    # Tiles: x [BM, R] @ w [R, BN] -> acc [BM, BN] per code j.
    o_ref = refs[0] if asymmetric else None
    out_ref = refs[-1]
    per_word = 8 if bits == 4 else 1
    zero = 0 if asymmetric else 2 ** (bits - 1)
    dtype = x_ref.dtype
    cols, col_ok, x_rows, x_row_ok, first, last = _program_tiles(
        m, n, rows, block_m, block_n, step, num_splits)
    if group_rows % step == 0 or num_groups == 1:
        sub = step  # every tile lies in one group
    elif step % group_rows == 0 and group_rows >= 16:
        sub = group_rows  # a tile is step / group_rows whole groups, one dot chain each
    else:
        sub = None  # groups cut across the dot's K: scale every weight before the dot
    k_total = rows * per_word
    acc_shape = (block_m, block_n)
    f32 = jnp.float32

    def x_tile(kc, r_ok):  # [BM, len(kc)]: the activation columns kc
        return _load(x_ref, x_rows, kc, x_row_ok, kc < k_total if r_ok is not None else None)

    def packed_rows(first_row, size):  # [size] packed rows from first_row, their mask
        r = first_row + jnp.arange(size, dtype=jnp.int32)
        return r, (r < rows if rows % step else None)

    def operands(first_row, size, code):
        """Yields (x tile, weight tile, excess) whose dots sum to x @ w over the R = size packed
        rows from first_row.

        code(word, j) -> (weight tile, excess) of code j of `word`: [R, BN].
        """
        r, r_ok = packed_rows(first_row, size)
        word = _load_codes(w_ref, r, cols, r_ok, col_ok, stored_nk=stored_nk)  # [R, BN]
        for j in range(per_word):  # x [BM, R]: columns 8 r + j (int4) or r (int8)
            yield x_tile(r * per_word + j, r_ok), *code(word, j)

    def product(pairs, sums: bool):
        """(sum of the dots of `pairs`, x summed over them or None, their excess); x's sum
        [BM, R] float32 where `sums` and there is excess or offset."""
        out = jnp.zeros(acc_shape, f32)
        xsum, excess = None, 0
        for xt, wt, excess in pairs:
            if sums and (excess or asymmetric):
                xsum = xt.astype(f32) if xsum is None else xsum + xt.astype(f32)
            out += plgpu.dot(xt, wt)
        return out, xsum, excess

    def prescaled(first_row):  # x @ w over a tile, weights scaled before the dot
        g = jnp.minimum(packed_rows(first_row, step)[0] // group_rows, num_groups - 1)  # [R]
        s = _load(s_ref, g, cols, None, col_ok, f32)  # [R, BN]
        o = _load(o_ref, g, cols, None, col_ok, f32) if asymmetric else None

        def code(word, j):  # exact float32 c - zero, scaled
            w = _dequant_tile(word, j, zero, bits)
            return (w * s + o if asymmetric else w * s).astype(dtype), 0
        return product(operands(first_row, step, code), sums=False)[0]

    def one_group(first_row, g):  # x @ w over `sub` rows (all in group g), scaled after
        pairs = operands(first_row, sub, lambda word, j: _codes_as(word, j, zero, bits, dtype))
        tile, xsum, excess = product(pairs, sums=True)  # tile: sum of x * (c - zero + excess)
        gv = jnp.full((1,), g, jnp.int32)
        s = _load(s_ref, gv, cols, None, col_ok, f32)  # [1, BN]
        if xsum is not None:
            xs = jnp.sum(xsum, axis=1)[:, None]  # [BM, 1]
            if excess:
                tile -= float(excess) * xs
        out = s * tile
        if asymmetric:
            out += _load(o_ref, gv, cols, None, col_ok, f32) * xs
        return out

    def body(t, acc):  # acc [BM, BN] float32
        if sub is None:
            return acc + prescaled(t * step)
        for q in range(step // sub):  # the tile's groups, `sub` packed rows each
            first_row = t * step + q * sub
            acc += one_group(first_row, jnp.minimum(first_row // group_rows, num_groups - 1))
        return acc

    acc = jax.lax.fori_loop(first, last, body, jnp.zeros(acc_shape, f32))
    out_rows = jnp.where(x_rows < m, x_rows, m)  # masked rows go past the end
    ok = None
    if x_row_ok is not None or col_ok is not None:
        ok = jnp.ones(acc_shape, jnp.bool_)
        if x_row_ok is not None:
            ok &= x_row_ok[:, None]
        if col_ok is not None:
            ok &= col_ok[None, :]
    plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=ok)
