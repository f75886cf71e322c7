"""Pieces shared by the paged attention kernels (ops/ragged_attention.py) and the other kernels of
the attention block (ops/rope_kv.py, ops/rms_norm.py).

- `resolve_options` / `check_pages`: dispatch and the input checks the public functions make.
- In-kernel helpers (called while tracing a Pallas kernel body): `kv_slots` maps token positions
  to cache slots through a block table, `load_rows` / `store_rows` move [rows, head_dim] tiles
  by row index (masked rows are neither read nor written), `attend_tile` is one step of the
  online softmax (flash attention) over a tile of keys, with int8 / fp8 pages dequantized in
  registers, and `finish` normalizes it.
- `merge_splits`: combines the partial results of programs that each saw one slice of the keys
  (flash-decoding), outside the kernel, in plain jnp.

Logits are kept in log2 units (scaled by log2(e)) so the kernel uses exp2. A masked logit is a
large finite negative number, never -inf, so a row that sees no key stays finite (NaN-free).
Rows are indexed with explicit index arrays on every axis (`ref.at[rows[:, None], cols[None]]`):
the Triton lowering turns them into one pointer tensor, and Pallas's interpreter (interpret=True,
used by the CPU tests) supports exactly this form of gather and masked scatter.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from ops.kernel_choice import choose_impl
from ops.kv_quant import is_quantized_kv_dtype
from ops.ptx import exp2_fma

LOG2E = math.log2(math.e)
MASK_VALUE = -1e30  # masked logit (log2 units): exp2(MASK_VALUE - m) == 0 for any real m
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


NUM_SMS = 132  # H100 / H200: only shapes the key-split heuristic


def resolve_options(name: str, impl: str | None, default: str, q_shape: tuple,
                    scale: float | None, soft_cap: float | None,
                    sliding_window: int | None) -> tuple[str, float]:
    """Validates the shared attention options; returns (implementation, softmax scale).

    impl None takes `default` (the KernelBackends choice) and falls back to the reference when
    the kernel cannot take the head_dim (`kernel_takes_head_dim`); an explicitly requested kernel
    raises instead.
    """
    head_dim = q_shape[-1]
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{name}: sliding_window {sliding_window} must be >= 1")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"{name}: soft_cap {soft_cap} must be > 0")
    sm_scale = float(head_dim ** -0.5 if scale is None else scale)
    kernel_ok = kernel_takes_head_dim(head_dim)
    resolved = choose_impl(name, impl, default)
    if resolved != "reference" and not kernel_ok:
        if impl is not None:
            raise ValueError(f"{name}: the Pallas kernel needs an even head_dim of 16 to 256, "
                             f"got q {q_shape}")
        resolved = "reference"
    return resolved, sm_scale


def check_ragged_inputs(name: str, q, k_pages, v_pages, k_scales, v_scales, block_tables,
                        query_start_loc, kv_lens, max_q_len) -> None:
    """Raises ValueError unless a ragged step's arguments fit: q [N, H, D], the pages (and
    scales), block_tables [S, W>=1], query_start_loc [S + 1] and kv_lens [S] int32, and a static
    max_q_len >= 1."""
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [tokens, heads, head_dim], got {q.shape}")
    check_pages(name, q.dtype, q.shape[1], q.shape[2], k_pages, v_pages, k_scales, v_scales)
    if block_tables.ndim != 2 or block_tables.shape[1] < 1:
        raise ValueError(f"{name}: block_tables {block_tables.shape} must be [num_seqs, W>=1]")
    num_seqs = block_tables.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or kv_lens.shape != (num_seqs,):
        raise ValueError(f"{name}: query_start_loc {query_start_loc.shape} must be "
                         f"({num_seqs + 1},) and kv_lens {kv_lens.shape} ({num_seqs},) for "
                         f"block_tables {block_tables.shape}")
    for arr, what in ((block_tables, "block_tables"), (query_start_loc, "query_start_loc"),
                      (kv_lens, "kv_lens")):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}: {what} must be int32, got {arr.dtype}")
    if not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"{name}: max_q_len must be a static int >= 1, got {max_q_len!r}")


def check_pages(name: str, q_dtype, num_heads: int, head_dim: int, k_pages, v_pages,
                k_scales, v_scales) -> None:
    """Raises ValueError unless the pages (and scales, for int8 / fp8 pages) fit the queries."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{name}: k_pages {k_pages.shape} {k_pages.dtype} and v_pages "
                         f"{v_pages.shape} {v_pages.dtype} must be one [KVH, P, S, D] shape "
                         "and dtype")
    num_kv_heads, _, page_size, page_head_dim = k_pages.shape
    if page_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{name}: q heads {num_heads} x head_dim {head_dim} do not fit pages "
                         f"{k_pages.shape} (head_dim must match, heads a multiple of kv heads)")
    if jnp.dtype(q_dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{name}: q dtype {jnp.dtype(q_dtype)} must be bfloat16, float16 or "
                         "float32")
    quantized = is_quantized_kv_dtype(k_pages.dtype)
    if not quantized and k_pages.dtype != jnp.dtype(q_dtype):
        raise ValueError(f"{name}: pages of dtype {k_pages.dtype} must have q's dtype "
                         f"{jnp.dtype(q_dtype)}, or be int8 / float8_e4m3fn with scales")
    if quantized != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError(f"{name}: k_scales and v_scales are required exactly for int8 / "
                         f"float8_e4m3fn pages (pages {k_pages.dtype}, k_scales "
                         f"{None if k_scales is None else k_scales.shape}, v_scales "
                         f"{None if v_scales is None else v_scales.shape})")
    if quantized and (k_scales.shape != k_pages.shape[:3] or v_scales.shape != k_pages.shape[:3]):
        raise ValueError(f"{name}: k_scales {k_scales.shape} and v_scales {v_scales.shape} must "
                         f"be {k_pages.shape[:3]} for pages {k_pages.shape}")
    if not 1 <= page_size <= 1024:
        raise ValueError(f"{name}: page_size {page_size} out of range for pages {k_pages.shape}")


def kernel_takes_head_dim(head_dim: int) -> bool:
    """Whether the GPU attention and RoPE + KV-write kernels take this head_dim: even, 16 to
    256. A row of another width than a power of two (Phi-3's 96) moves as the next power of
    two, the columns past head_dim masked (`row_columns`); other head_dims run the reference."""
    return 16 <= head_dim <= 256 and head_dim % 2 == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# In-kernel helpers.


def kv_slots(table_ref, table_base, tok, *, page_size: int, table_width: int, num_pages: int):
    """Cache slot of each token position tok [BK] of one sequence, through its block table.

    table_ref holds block tables (the sequence's row starts at flat index table_base); entries
    past the table or past the cache are clamped, so a masked token never points off the pages.
    """
    # tok >= 0: truncating division (lax.div / lax.rem) is floor division, in fewer instructions.
    entry = jnp.minimum(jax.lax.div(tok, page_size), table_width - 1)  # [BK]
    page = table_ref[table_base + entry]  # [BK]
    page = jnp.minimum(jnp.maximum(page, 0), num_pages - 1)
    return page * page_size + jax.lax.rem(tok, page_size)  # [BK]


def row_columns(width: int) -> tuple[jax.Array, jax.Array | None]:
    """(column ids [next_pow2(width)], which of them are < width, or None when all are):
    Triton loads and stores power-of-two shapes, so a row of 96 moves as 128 columns, the last
    32 masked."""
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)
    return cols, None if cols.shape[0] == width else cols < width


def row_mask(valid, col_ok, shape):
    """The [M, Dp] mask of rows where valid [M] (None: all) and columns where col_ok [Dp]
    (None: all); None when nothing is masked."""
    if valid is None:
        return None if col_ok is None else jnp.broadcast_to(col_ok[None, :], shape)
    rows_ok = valid[:, None]
    return jnp.broadcast_to(rows_ok if col_ok is None else rows_ok & col_ok[None, :], shape)


def load_rows(ref, rows, valid=None):
    """ref [R, D] -> rows [M] of it as [M, Dp], Dp = next_pow2(D) (the columns past D read as
    0); rows where valid [M] is False read as 0."""
    cols, col_ok = row_columns(ref.shape[-1])
    view = ref.at[rows[:, None], cols[None, :]]
    mask = row_mask(valid, col_ok, (rows.shape[0], cols.shape[0]))
    if mask is None:
        return plgpu.load(view)
    zero = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
    return plgpu.load(view, mask=mask, other=zero)


def load_scales(ref, rows, valid=None):
    """ref [R] -> ref[rows] [M] (float32); masked rows read as 0."""
    if valid is None:
        return plgpu.load(ref.at[rows])
    return plgpu.load(ref.at[rows], mask=valid, other=0.0)


def store_rows(ref, rows, value, valid):
    """ref [R, D][rows] = value [M, Dp] (Dp = next_pow2(D): its first D columns) for rows where
    valid [M]; other rows are left alone.

    Masked rows are sent past the end of ref (the interpreter drops such writes; the GPU never
    issues them), so they can never collide with a written row.
    """
    cols, col_ok = row_columns(ref.shape[-1])
    rows = jnp.where(valid, rows, ref.shape[0])
    mask = row_mask(valid, col_ok, value.shape)
    plgpu.store(ref.at[rows[:, None], cols[None, :]], value.astype(ref.dtype), mask=mask)


def store_vector(ref, rows, value, valid):
    """ref [R][rows] = value [M] where valid [M]."""
    rows = jnp.where(valid, rows, ref.shape[0])
    plgpu.store(ref.at[rows], value.astype(ref.dtype), mask=valid)


def init_carry(num_rows: int, head_dim: int):
    """(acc [M, D], running max m [M], running sum l [M]), float32."""
    return (jnp.zeros((num_rows, head_dim), jnp.float32),
            jnp.full((num_rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((num_rows,), jnp.float32))


def attend_tile(q, k, v, k_scale, v_scale, mask, carry, *, sm_scale: float,
                soft_cap: float | None, ptx: bool = False):
    """One online-softmax step: q [M, D] against keys k and values v [BK, D].

    k, v are in q's dtype (int8 / fp8 tiles already converted); k_scale, v_scale [BK] are the
    per-token dequantization scales or None; mask [M, BK] (True = visible) or None.
    The K scale multiplies logit columns and the V scale the probability columns, which equals
    attending to the dequantized pages. Returns the new carry.

    ptx: the softmax scale is applied inside the exponent, one PTX fma and ex2.approx.ftz per
    logit (ops.ptx.exp2_fma) where jnp's exp2 costs several instructions (False in interpret
    mode; on an H200 it took a 4k-token prefill from about 270 to 379 TFLOP/s).
    """
    acc, m, l = carry
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = plgpu.dot(q, k, trans_b=True, precision=precision)  # [M, BK] float32
    if k_scale is not None:
        s = s * k_scale[None, :]
    if soft_cap is None:
        scale = sm_scale * LOG2E  # s * scale: logits in log2 units, scaled inside the exp2
    else:
        s = (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
        scale = 1.0
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE / scale)
    tile_max = jnp.max(s, axis=1) * scale  # [M] (scale > 0)

    m_new = jnp.maximum(m, tile_max)
    alpha = jnp.exp2(m - m_new)  # [M]
    acc, m, l = acc * alpha[:, None], m_new, l * alpha
    p = exp2_fma(s, jnp.full_like(s, scale), jnp.broadcast_to(-m[:, None], s.shape),
                 interpret=not ptx)  # [M, BK]
    if mask is not None:  # exactly 0, also in a row whose running max is still MASK_VALUE
        p = jnp.where(mask, p, 0.0)
    l = l + jnp.sum(p, axis=1)
    if v_scale is not None:
        p = p * v_scale[None, :]
    acc = acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)  # [M, D]
    return acc, m, l


def finish(carry):
    """carry -> (normalized output [M, D] f32, log2-sum-exp [M]; MASK_VALUE if no key seen)."""
    acc, m, l = carry
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    out = acc / safe[:, None]
    lse = jnp.where(seen, m + jnp.log(safe) * (1.0 / math.log(2.0)), MASK_VALUE)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Outside the kernel.


def merge_splits(out: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Flash-decoding merge: out [K, ..., D] partial outputs, lse [K, ...] (log2) -> [..., D].

    Each split's output is already normalized over its keys; weighting by exp2(lse - max)
    renormalizes over all keys. A row no split saw (all lse == MASK_VALUE) comes out as the
    mean of zeros, i.e. 0. The loops over K are unrolled on purpose: written elementwise
    (no reduce op), XLA fuses the whole merge into one kernel instead of two (one launch
    fewer, about 2.5 us per call on an H200).
    """
    top = lse[0]
    for i in range(1, out.shape[0]):
        top = jnp.maximum(top, lse[i])
    num = jnp.zeros(out.shape[1:], jnp.float32)
    den = jnp.zeros(lse.shape[1:], jnp.float32)
    for i in range(out.shape[0]):
        w = jnp.exp2(lse[i] - top)  # [...]
        num = num + w[..., None] * out[i]
        den = den + w
    return (num / den[..., None]).astype(dtype)


def interpret_or_gpu(impl: str) -> bool:
    """interpret flag for pl.pallas_call."""
    return impl == "pallas_interpret"
