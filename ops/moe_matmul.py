"""The grouped expert matmul of a mixture-of-experts layer, float and INT8 / INT4 codes.

Rows are tokens sorted by expert: rows [0, g0) go to expert 0, the next g1 rows to expert 1 and
so on (group_sizes [E], summing to at most M; rows past the sum belong to no expert and come out
zero). Nothing is padded to a capacity and no row is dropped: `jax.lax.ragged_dot` multiplies
each group by its own expert's weight.

    grouped_matmul        x [M, K] @ w [E, K, N] per group -> [M, N] in x's dtype
    grouped_coded_matmul  the same over the experts' codes (quant/qtensor.py's layouts with a
                          leading expert axis: INT4 int32 [E, K/8, N], INT8 uint8 [E, K, N],
                          scales and offsets [E, G, N])
    grouped_matmul_reference  the same per row with a gathered weight, in plain jnp

On XLA the codes' product runs in two forms: up to CODED_PRODUCT_MAX_ROWS rows the codes enter
the product as they are and each row's scales are applied after it, per group of K (no
dequantized weight is written); above, the experts are dequantized once and multiplied.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

INT4_PER_WORD = 8
CODE_ZEROS = {8: 128, 4: 8}  # bits -> the zero point of symmetric codes
CODED_PRODUCT_MAX_ROWS = 64  # more rows: dequantize the experts once, then one grouped product


def _check(x: jax.Array, shape: tuple[int, ...], group_sizes: jax.Array, what: str) -> None:
    if x.ndim != 2 or len(shape) != 3 or x.shape[1] != shape[1]:
        raise ValueError(f"{what}: x {x.shape} must be [M, K] against experts [E, K, N] "
                         f"{tuple(shape)}")
    if group_sizes.shape != (shape[0],):
        raise ValueError(f"{what}: group_sizes {group_sizes.shape} must be [{shape[0]}] (one "
                         "count per expert)")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] (rows sorted by expert) @ w [E, K, N] per group -> [M, N] in x's dtype,
    accumulated in float32; rows past sum(group_sizes) are zero."""
    _check(x, w.shape, group_sizes, "grouped_matmul")
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def row_experts(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The expert of each of `rows` sorted rows (int32 [rows]); rows past the groups get E."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # [E]
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(
        jnp.int32)


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
    """Expert codes as int32 [E, K, N]: INT8 bytes as they are, INT4 words [E, K/8, N] with
    row 8i + j of column n in bits 4j..4j+3 of word [i, n] (low nibble first)."""
    if bits == 8:
        return packed.astype(jnp.int32)
    if bits != 4:
        raise ValueError(f"unpack_codes: bits must be 4 or 8, got {bits}")
    e, rows, n = packed.shape
    words = jax.lax.bitcast_convert_type(packed, jnp.uint32)[:, :, None, :]  # [E, K/8, 1, N]
    shifts = (4 * jnp.arange(INT4_PER_WORD, dtype=jnp.uint32))[None, None, :, None]
    return ((words >> shifts) & 0xF).astype(jnp.int32).reshape(e, rows * INT4_PER_WORD, n)


def dequantize_experts(packed: jax.Array, scales: jax.Array, offsets: jax.Array | None,
                       bits: int, group_size: int, dtype=jnp.float32) -> jax.Array:
    """The float experts [E, K, N] that the codes stand for (quant/qtensor.py's formula:
    scale * (c - zero) when symmetric, scale * c + offset otherwise, per group of K rows)."""
    codes = unpack_codes(packed, bits).astype(jnp.float32)
    k = codes.shape[1]

    def per_row(a):  # [E, G, N] -> [E, K, N]
        a = a.astype(jnp.float32)
        return jnp.repeat(a, group_size, axis=1)[:, :k] if a.shape[1] > 1 else a
    if offsets is None:
        values = per_row(scales) * (codes - CODE_ZEROS[bits])
    else:
        values = per_row(scales) * codes + per_row(offsets)
    return values.astype(dtype)


def grouped_coded_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array,
                         offsets: jax.Array | None, group_sizes: jax.Array, *, bits: int,
                         group_size: int) -> jax.Array:
    """x [M, K] (rows sorted by expert) @ the experts' codes per group -> [M, N] in x's dtype.

    packed: INT4 int32 [E, K/8, N] or INT8 uint8 [E, K, N]; scales (offsets) [E, G, N], G =
    ceil(K / group_size) (G = 1: per output channel); group_sizes int32 [E].
    """
    e, g, n = scales.shape
    k = x.shape[1]
    rows_k = packed.shape[1] * (INT4_PER_WORD if bits == 4 else 1)
    _check(x, (e, rows_k, n), group_sizes, "grouped_coded_matmul")
    if packed.shape[0] != e or (offsets is not None and offsets.shape != scales.shape):
        raise ValueError(f"grouped_coded_matmul: codes {packed.shape}, scales {scales.shape} "
                         f"and offsets {None if offsets is None else offsets.shape} disagree")
    size = k if g == 1 else group_size
    if -(-k // size) != g:
        raise ValueError(f"grouped_coded_matmul: {g} groups of {size} do not cover K={k}")
    group_sizes = group_sizes.astype(jnp.int32)
    m = x.shape[0]
    if m > CODED_PRODUCT_MAX_ROWS:
        dense = dequantize_experts(packed, scales, offsets, bits, size, x.dtype)
        return grouped_matmul(x, dense, group_sizes)
    pad = g * size - k  # the last group may be shorter
    codes = unpack_codes(packed, bits).astype(x.dtype)  # exact: codes < 256
    xg = jnp.pad(x, ((0, 0), (0, pad))).reshape(m, g, size).transpose(1, 0, 2)  # [G, M, size]
    cg = jnp.pad(codes, ((0, 0), (0, pad), (0, 0))).reshape(e, g, size, n)  # [E, G, size, N]
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([2], [2]), ([0], [1])), lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[0])
    yg = jax.lax.ragged_dot_general(xg, cg, group_sizes, dims,
                                    preferred_element_type=jnp.float32)  # [G, M, N]
    expert = row_experts(group_sizes, m)
    real = expert < e  # rows past the groups stay zero
    expert = jnp.minimum(expert, e - 1)
    s = scales.astype(jnp.float32)[expert]  # [M, G, N]
    z = (-CODE_ZEROS[bits] * s if offsets is None
         else offsets.astype(jnp.float32)[expert])  # [M, G, N]
    x_sums = jnp.sum(xg.astype(jnp.float32), axis=-1).T  # [M, G]
    y = jnp.sum(yg.transpose(1, 0, 2) * s + x_sums[:, :, None] * z, axis=1)  # [M, N]
    return jnp.where(real[:, None], y, 0.0).astype(x.dtype)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul by gathering each row's expert weight (plain jnp; M x K x N memory)."""
    _check(x, w.shape, group_sizes, "grouped_matmul_reference")
    expert = row_experts(group_sizes, x.shape[0])
    real = expert < w.shape[0]
    wr = w[jnp.minimum(expert, w.shape[0] - 1)].astype(jnp.float32)  # [M, K, N]
    y = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), wr)
    return jnp.where(real[:, None], y, 0.0).astype(x.dtype)
