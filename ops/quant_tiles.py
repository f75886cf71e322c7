"""Tile helpers shared by the quantized matmul kernels (ops/quant_matmul.py, ops/quant_mma.py,
ops/quant_gemv.py): masked tile loads, a program's tile bounds, and codes unpacked into exact
float32.

Packed layouts (quant/qtensor.py): int4 packed int32 [K/8, N], nibble j of word i = K row 8i + j;
int8 codes uint8 [K, N].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

EXP_ONE = {0: 150, 1: 146, 2: 142, 3: 138}  # biased exponent making bit 4j worth 1.0
MAGIC_BITS = 0x4B000000  # float32 2^23: its lowest mantissa bit is worth 1


def _dequant_tile(word, j: int, zero: int, bits: int):
    """Code j of each packed element (int32 [R, BN]) minus `zero`, as exact float32 [R, BN]."""
    if bits == 8:  # word holds one code in bits 0..7
        f = jax.lax.bitcast_convert_type(word | MAGIC_BITS, jnp.float32)
        return f - (float(2 ** 23) + zero)
    half = word if j < 4 else jax.lax.shift_right_logical(word, 16)
    jj = j % 4
    bits_ = (half & (0xF << (4 * jj))) | (EXP_ONE[jj] << 23)
    f = jax.lax.bitcast_convert_type(bits_, jnp.float32)
    return f - (float(2 ** (23 - 4 * jj)) + zero)


def _load(ref, rows, cols, row_ok, col_ok, dtype=None, transposed=False):
    """ref[rows, cols] as [len(rows), len(cols)] ([len(cols), len(rows)] when `transposed`),
    masked by row_ok / col_ok (None: known in bounds); masked reads are 0."""
    lay = (lambda a: a[None, :]) if transposed else (lambda a: a[:, None])  # noqa: E731
    lay_c = (lambda a: a[:, None]) if transposed else (lambda a: a[None, :])  # noqa: E731
    view = ref.at[lay(rows), lay_c(cols)]
    if row_ok is None and col_ok is None:
        out = plgpu.load(view)
    else:
        shape = ((cols.shape[0], rows.shape[0]) if transposed
                 else (rows.shape[0], cols.shape[0]))
        mask = jnp.ones(shape, jnp.bool_)
        if row_ok is not None:
            mask = mask & lay(row_ok)
        if col_ok is not None:
            mask = mask & lay_c(col_ok)
        zero = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
        out = plgpu.load(view, mask=mask, other=zero)
    return out if dtype is None else out.astype(dtype)


def _load_codes(w_ref, r, cols, r_ok, col_ok, transposed: bool = False,
                stored_nk: bool = False):
    """The int32 weight tile of packed rows r [R] and columns cols [BN]: [R, BN] ([BN, R] when
    `transposed`), from w_ref stored [K/8 or K, N] or, `stored_nk`, [N, K/8 or K] (the
    transposed layout of ops.matmul.TransposedWeight: the same words)."""
    if stored_nk:
        return _load(w_ref, cols, r, col_ok, r_ok, jnp.int32, not transposed)
    return _load(w_ref, r, cols, r_ok, col_ok, jnp.int32, transposed)


def _program_tiles(m: int, n: int, rows: int, block_m: int, block_n: int, step: int,
                   num_splits: int):
    """This program's output columns cols [BN] and activation rows x_rows [BM] with their
    in-bounds masks (None when every one is in bounds), and its K tiles [first, last) of
    `step` packed rows (program axes: row block, column block, K split)."""
    mb, nb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
    x_rows = mb * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [BM]
    num_tiles = pl.cdiv(rows, step)
    per_split = pl.cdiv(num_tiles, num_splits)
    first = jnp.minimum(split * per_split, num_tiles)
    last = jnp.minimum(first + per_split, num_tiles)
    return (cols, cols < n if n % block_n else None, x_rows,
            x_rows < m if m % block_m else None, first, last)


def _tile_rows_and_scales(t, step: int, rows: int, group_rows: int, num_groups: int,
                          s_ref, o_ref, cols, col_ok):
    """K tile t's packed rows r [R] (with their mask, None when all in bounds) and its float32
    scales s (and offsets o, o_ref None: None): [1, BN] where the tile lies in one group (one
    row, broadcast over R), else [R, BN] (each packed row's group)."""
    r = t * step + jnp.arange(step, dtype=jnp.int32)  # [R] packed rows of this tile
    r_ok = r < rows if rows % step else None
    if group_rows % step == 0 or num_groups == 1:  # the tile sits in one group
        g = jnp.full((1,), jnp.minimum(t * step // group_rows, num_groups - 1), jnp.int32)
    else:
        g = jnp.minimum(r // group_rows, num_groups - 1)  # [R] group of each packed row
    s = _load(s_ref, g, cols, None, col_ok, jnp.float32)
    o = _load(o_ref, g, cols, None, col_ok, jnp.float32) if o_ref is not None else None
    return r, r_ok, s, o


def split_output(m: int, n: int, num_splits: int, dtype):
    """(out_shape, out_spec) of a kernel on grid (row block, column block, K split): [M, N] in
    dtype with one split, else float32 partials [splits, M, N] that `sum_splits` adds up."""
    if num_splits > 1:
        return (jax.ShapeDtypeStruct((num_splits, m, n), jnp.float32),
                pl.BlockSpec((None, m, n), lambda i, j, s: (s, 0, 0)))
    return jax.ShapeDtypeStruct((m, n), dtype), pl.BlockSpec((m, n), lambda i, j, s: (0, 0))


def sum_splits(out, num_splits: int, dtype):
    """The kernel's output of `split_output`: partials summed in float32, then cast to dtype."""
    return out.sum(axis=0).astype(dtype) if num_splits > 1 else out
