"""The grouped expert matmul of a mixture-of-experts layer, float and INT8 / INT4 codes.

Rows are tokens sorted by expert: rows [0, g0) go to expert 0, the next g1 rows to expert 1 and
so on (group_sizes [E], summing to at most M; rows past the sum belong to no expert and come out
zero). Nothing is padded to a capacity and no row is dropped.

    grouped_matmul        x [M, K] @ w [E, K, N] per group -> [M, N] in x's dtype
    grouped_coded_matmul  the same over the experts' codes (quant/qtensor.py's layouts with a
                          leading expert axis: INT4 int32 [E, K/8, N], INT8 uint8 [E, K, N],
                          scales and offsets [E, G, N])

Two XLA forms, by rows (`gathers`):
    gathered  up to GATHER_MAX_ROWS rows (default: as many as there are experts, decode steps):
              each row's expert weight is gathered and multiplied with that row alone, so a
              step reads the experts its rows chose, not all E. Codes are gathered as codes
              and enter the product as they are, their scales applied after it per group of K.
    ragged    more rows: `jax.lax.ragged_dot` over the groups (codes dequantized once first).
              XLA's GPU compiler expands it to a dense product over every expert unless its
              grouped-GEMM backend is on (--xla_gpu_experimental_use_ragged_dot_fusion).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

INT4_PER_WORD = 8
CODE_ZEROS = {8: 128, 4: 8}  # bits -> the zero point of symmetric codes
# Rows up to which products gather each row's expert (None: the number of experts). Reads
# per step: the gathered form M experts' weights, the ragged one (expanded by XLA) all E.
GATHER_MAX_ROWS: int | None = None


def gathers(rows: int, num_experts: int) -> bool:
    """Whether a product of `rows` sorted rows over `num_experts` experts takes the gathered
    form (see the module docstring)."""
    return rows <= (num_experts if GATHER_MAX_ROWS is None else GATHER_MAX_ROWS)


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
    if gathers(x.shape[0], w.shape[0]):
        return gathered_matmul(x, w, group_sizes)
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
    if not gathers(m, e):
        dense = dequantize_experts(packed, scales, offsets, bits, size, x.dtype)
        y = jax.lax.ragged_dot(x, dense, group_sizes, preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    expert, real = _row_experts_clamped(group_sizes, m, e)
    codes = unpack_codes(packed[expert], bits).astype(x.dtype)  # [M, K, N], exact: < 256
    pad = g * size - k  # the last group may be shorter
    xg = jnp.pad(x, ((0, 0), (0, pad))).reshape(m, g, size)  # [M, G, size]
    cg = jnp.pad(codes, ((0, 0), (0, pad), (0, 0))).reshape(m, g, size, n)  # [M, G, size, N]
    yg = jnp.einsum("mgs,mgsn->mgn", xg, cg, preferred_element_type=jnp.float32)  # [M, G, N]
    s = scales.astype(jnp.float32)[expert]  # [M, G, N]
    z = (-CODE_ZEROS[bits] * s if offsets is None
         else offsets.astype(jnp.float32)[expert])  # [M, G, N]
    x_sums = jnp.sum(xg.astype(jnp.float32), axis=-1)  # [M, G]
    # elementwise float32: the zero point's term cancels most of the codes' product
    y = jnp.sum(yg * s + x_sums[:, :, None] * z, axis=1)  # [M, N]
    return jnp.where(real[:, None], y, 0.0).astype(x.dtype)


def _row_experts_clamped(group_sizes: jax.Array, rows: int, num_experts: int):
    """(each row's expert clamped to a valid index int32 [rows], whether the row is in a group
    [rows])."""
    expert = row_experts(group_sizes, rows)
    return jnp.minimum(expert, num_experts - 1), expert < num_experts


def gathered_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul's gathered form: each row times its own expert's weight, gathered
    ([M, K, N]); reads the M rows' experts only."""
    expert, real = _row_experts_clamped(group_sizes, x.shape[0], w.shape[0])
    y = jnp.einsum("mk,mkn->mn", x, w[expert].astype(x.dtype),
                   preferred_element_type=jnp.float32)
    return jnp.where(real[:, None], y, 0.0).astype(x.dtype)
