"""The grouped expert matmul of a mixture-of-experts layer, float and INT8 / INT4 codes.

Rows are tokens sorted by expert: rows [0, g0) go to expert 0, the next g1 rows to expert 1 and
so on (group_sizes [E], summing to at most M; rows past the sum belong to no expert and come out
zero). Nothing is padded to a capacity and no row is dropped.

    grouped_matmul        x [M, K] @ w [E, K, N] per group -> [M, N] in x's dtype
    grouped_coded_matmul  the same over the experts' codes (quant/qtensor.py's layouts with a
                          leading expert axis: INT4 int32 [E, K/8, N], INT8 uint8 [E, K, N],
                          scales and offsets [E, G, N])
    rows_matmul, rows_coded_matmul  the gathered form for rows in any order, each with its
                          expert given (decode steps need no sort)
    IndexedRows, GatedRows  rows the expert kernels (ops/expert_gemv.py, ops/expert_gemm.py)
                          make as they load them:
                          a token's row read in place for each of its pairs; act(gate) * up of a
                          gate-up product's float32 split sums

XLA forms, by rows (`product_form`):
    gathered  up to as many rows as experts (decode steps): each row's expert weight is
              gathered and multiplied with that row alone, so a step reads only the experts
              its rows chose. Codes are gathered as codes and enter the product as they are,
              their scales applied after it per group of K.
    tiles     more rows (LARGE_FORM "tiles"): each expert's rows padded to whole tiles of
              TILE_ROWS, each tile multiplied by its expert's gathered weight in batched
              products of at most TILE_CHUNK_BYTES of weights; at most ceil(M / TILE_ROWS) + E
              tiles, so the work grows with M, not with M x E, and the memory does not.
    ragged    (LARGE_FORM "ragged") `jax.lax.ragged_dot`: a grouped GEMM where XLA has one (on
              a GPU behind --xla_gpu_experimental_use_ragged_dot_fusion); XLA's default GPU
              and CPU lowering expands it into a dense product over every expert.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

INT4_PER_WORD = 8
CODE_ZEROS = {8: 128, 4: 8}  # bits -> the zero point of symmetric codes
TILE_ROWS = 64  # rows per tile of the "tiles" form
# bytes of gathered weights (at float32 width, as codes dequantize) per batched product of the
# "tiles" form, at least one tile's: without a bound they are one expert per tile (qwen3-30b-a3b's
# gate-up at a 2048-token step: 384 tiles, 2.4 GB in bf16)
TILE_CHUNK_BYTES = 256 << 20
LARGE_FORM = "tiles"  # the form of products of more rows than experts: "tiles" or "ragged"
FORMS = ("gathered", "tiles", "ragged")
# jnp.searchsorted's method: its default ("scan") is a while loop, which a GPU runs with a
# host round trip per step; the unrolled binary search is the same few gathers with no loop
SEARCH = "scan_unrolled"


# the gated MLPs' activations by ModelConfig.hidden_act (dense MLPs and experts alike)
ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexedRows:
    """Rows x[index] [M, K] of x [T, K] (index int32 [M]: each pair's token), which the expert
    kernels read in place, with no gathered copy written first."""
    x: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return self.index.shape[0], self.x.shape[1]

    @property
    def dtype(self):
        return self.x.dtype

    def rows(self) -> jax.Array:
        """The rows [M, K] (jnp)."""
        return self.x[self.index]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedRows:
    """Rows act(gate) * up [M, K] in `dtype`, given as a gate-up product's float32 split
    partials [S, M, 2 K] (gate columns, then up; the rows' sums over S), so that the down
    product's kernel sums, activates and multiplies them as it loads its input and no kernel
    runs in between. act: a key of ACTIVATIONS."""
    partials: jax.Array
    act: str = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return self.partials.shape[1], self.partials.shape[2] // 2

    def rows(self) -> jax.Array:
        """The rows [M, K] in dtype (jnp)."""
        gate, up = jnp.split(jnp.sum(self.partials.astype(jnp.float32), axis=0), 2, axis=-1)
        return (ACTIVATIONS[self.act](gate) * up).astype(self.dtype)


def as_partials(y: jax.Array, partials: bool) -> jax.Array:
    """A product [M, N] as a consumer of split partials takes it: float32 [1, M, N] when
    `partials`, else as it is."""
    return y.astype(jnp.float32)[None] if partials else y


def input_rows(x) -> jax.Array:
    """The rows [M, K] of an array, IndexedRows or GatedRows (jnp)."""
    return x.rows() if isinstance(x, (GatedRows, IndexedRows)) else x


def product_form(rows: int, num_experts: int) -> str:
    """The XLA form of a product of `rows` sorted rows over `num_experts` experts (see the
    module docstring)."""
    if LARGE_FORM not in FORMS[1:]:
        raise ValueError(f"moe_matmul.LARGE_FORM {LARGE_FORM!r} must be one of {FORMS[1:]}")
    return "gathered" if rows <= num_experts else LARGE_FORM


def _form(form: str | None, rows: int, num_experts: int) -> str:
    if form is None:
        return product_form(rows, num_experts)
    if form not in FORMS:
        raise ValueError(f"moe_matmul: form {form!r} must be one of {FORMS}")
    return form


def _check(x: jax.Array, shape: tuple[int, ...], group_sizes: jax.Array, what: str) -> None:
    if x.ndim != 2 or len(shape) != 3 or x.shape[1] != shape[1]:
        raise ValueError(f"{what}: x {x.shape} must be [M, K] against experts [E, K, N] "
                         f"{tuple(shape)}")
    if group_sizes.shape != (shape[0],):
        raise ValueError(f"{what}: group_sizes {group_sizes.shape} must be [{shape[0]}] (one "
                         "count per expert)")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   form: str | None = None) -> jax.Array:
    """x [M, K] (rows sorted by expert) @ w [E, K, N] per group -> [M, N] in x's dtype,
    accumulated in float32; rows past sum(group_sizes) are zero. form: one of FORMS, None:
    `product_form`'s choice."""
    _check(x, w.shape, group_sizes, "grouped_matmul")
    group_sizes = group_sizes.astype(jnp.int32)
    form = _form(form, x.shape[0], w.shape[0])
    if form == "gathered":
        expert, real = _row_experts_clamped(group_sizes, x.shape[0], w.shape[0])
        return jnp.where(real[:, None], rows_matmul(x, w, expert), 0).astype(x.dtype)
    if form == "ragged":
        y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes,
                               preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    return _tiled(x, group_sizes, w.shape[2], lambda tile_expert: w[tile_expert])


def rows_matmul(x: jax.Array, w: jax.Array, expert: jax.Array) -> jax.Array:
    """x [M, K] @ w[expert[m]] per row -> [M, N] in x's dtype (expert int32 [M], valid
    indices): each row's expert gathered, so only the rows' experts are read."""
    if expert.shape != (x.shape[0],) or x.shape[1] != w.shape[1]:
        raise ValueError(f"rows_matmul: x {x.shape}, experts {w.shape}, expert ids "
                         f"{expert.shape} do not fit")
    y = jnp.einsum("mk,mkn->mn", x, w[expert].astype(x.dtype),
                   preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def row_experts(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The expert of each of `rows` sorted rows (int32 [rows]); rows past the groups get E."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # [E]
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right",
                            method=SEARCH).astype(jnp.int32)


def _row_experts_clamped(group_sizes: jax.Array, rows: int, num_experts: int):
    """(each row's expert clamped to a valid index int32 [rows], whether the row is in a group
    [rows])."""
    expert = row_experts(group_sizes, rows)
    return jnp.minimum(expert, num_experts - 1), expert < num_experts


def tile_layout(group_sizes: jax.Array, rows: int, tile: int):
    """Where the "tiles" form puts each sorted row: (padded position int32 [rows], num_tiles *
    tile for rows in no group; expert of each tile int32 [num_tiles]), with each expert's rows
    starting a new tile. num_tiles = ceil(rows / tile) + min(E, rows) bounds the tiles any
    group sizes need (each non-empty group adds less than one tile of padding)."""
    e = group_sizes.shape[0]
    num_tiles = -(-rows // tile) + min(e, rows)
    tiles = (group_sizes + tile - 1) // tile  # [E]
    tile_end = jnp.cumsum(tiles)
    row_start = jnp.cumsum(group_sizes) - group_sizes
    expert, real = _row_experts_clamped(group_sizes, rows, e)
    offset = jnp.arange(rows, dtype=jnp.int32) - row_start[expert]
    position = jnp.where(real, (tile_end - tiles)[expert] * tile + offset, num_tiles * tile)
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(num_tiles, dtype=jnp.int32),
                                   side="right", method=SEARCH)
    return position.astype(jnp.int32), jnp.minimum(tile_expert, e - 1).astype(jnp.int32)


def tile_chunk(k: int, n: int, num_tiles: int) -> int:
    """Tiles per batched product of the "tiles" form for K x N experts: as many as
    TILE_CHUNK_BYTES of float32 weights hold, at least 1, at most num_tiles."""
    return max(1, min(num_tiles, TILE_CHUNK_BYTES // (4 * k * n)))


def _tiled(x: jax.Array, group_sizes: jax.Array, n: int, tile_weights) -> jax.Array:
    """The "tiles" form of K x n experts: tile_weights(tile_expert int32 [T]) -> the tiles'
    weights [T, K, n], called on `tile_chunk` tiles at a time (padding tiles take expert 0 and
    rows of zeros)."""
    m, k = x.shape
    position, tile_expert = tile_layout(group_sizes, m, TILE_ROWS)
    num_tiles = tile_expert.shape[0]
    chunk = tile_chunk(k, n, num_tiles)
    chunks = -(-num_tiles // chunk)
    tile_expert = jnp.pad(tile_expert, (0, chunks * chunk - num_tiles))
    padded_rows = chunks * chunk * TILE_ROWS
    # rows in no group (tile_layout puts them just past its tiles): past the padding tiles too
    position = jnp.where(position < num_tiles * TILE_ROWS, position, padded_rows)
    xp = jnp.zeros((padded_rows, k), x.dtype).at[position].set(x, mode="drop")

    def product(tiles):  # ([C, TILE_ROWS, K], [C]) -> float32 [C, TILE_ROWS, N]
        xs, experts = tiles
        return jnp.einsum("tik,tkn->tin", xs, tile_weights(experts).astype(x.dtype),
                          preferred_element_type=jnp.float32)
    tiles = xp.reshape(chunks, chunk, TILE_ROWS, k), tile_expert.reshape(chunks, chunk)
    y = (product(jax.tree.map(lambda a: a[0], tiles)) if chunks == 1
         else jax.lax.map(product, tiles))
    y = y.reshape(padded_rows, -1)
    return jnp.take(y, position, axis=0, mode="fill", fill_value=0).astype(x.dtype)


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
                         group_size: int, form: str | None = None) -> jax.Array:
    """x [M, K] (rows sorted by expert) @ the experts' codes per group -> [M, N] in x's dtype.

    packed: INT4 int32 [E, K/8, N] or INT8 uint8 [E, K, N]; scales (offsets) [E, G, N], G =
    ceil(K / group_size) (G = 1: per output channel); group_sizes int32 [E]; form: as in
    grouped_matmul.
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
    form = _form(form, m, e)

    def dequantized(idx):  # the experts idx [T] dequantized: [T, K, N]
        return dequantize_experts(packed[idx], scales[idx],
                                  None if offsets is None else offsets[idx], bits, size, x.dtype)
    if form == "tiles":
        return _tiled(x, group_sizes, n, dequantized)
    if form == "ragged":
        y = jax.lax.ragged_dot(x, dequantized(jnp.arange(e)), group_sizes,
                               preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    expert, real = _row_experts_clamped(group_sizes, m, e)
    y = rows_coded_matmul(x, packed, scales, offsets, expert, bits=bits, group_size=size)
    return jnp.where(real[:, None], y, 0).astype(x.dtype)


def rows_coded_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array,
                      offsets: jax.Array | None, expert: jax.Array, *, bits: int,
                      group_size: int) -> jax.Array:
    """x [M, K] @ the codes of expert[m] per row -> [M, N] in x's dtype: the codes gathered as
    codes enter the product as they are, each row's scales (and offsets) applied after it per
    group of K (group_size: K when per channel)."""
    m, k = x.shape
    e, g, n = scales.shape
    size = k if g == 1 else group_size
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
    return y.astype(x.dtype)
