"""Rotary embedding of a step's queries and keys, fused with the KV-cache write.

In a decode step the attention block between the q/k/v projection and the attention kernel is
a handful of tiny ops: RoPE on the queries, RoPE on the keys, and the scatter of keys and values
into their cache slots. XLA runs them as separate kernels (for llama3.1-8b at batch 1 on the
H200: five per layer, because a one-row scatter becomes a select plus a dynamic-update-slice per
cache), each reading almost nothing but paying a kernel's start and drain. `rope_and_write_kv`
does all of it in one Pallas kernel on GPU, and in plain jnp elsewhere. Models with per-head
q/k RMSNorm (Qwen3, Gemma 3) normalize each query and key head in the same kernel, before the
rotation: two or three kernels fewer per layer.

Kernel: one program per (token, kv head). It computes the token's angles (position x inverse
frequency, float32), rotates the kv head's key and writes it and the value to the token's slot
in the pages (which are aliased to the outputs: written in place), and rotates the kv head's G
query heads into the output (each head RMS-normed first where the model has q/k norms, with
ops.rms_norm's rounding). Rotate-half (HF) layout: element i pairs with i +- D/2. A slot < 0
(padding) writes nothing. Quantized caches (int8 / fp8 QuantizedPages: the kernel stores no
scales), a sharded step (its KernelBackends hold a mesh) and head dims that are not a power of
two take the jnp path, which quantizes each new row in ops.paged_attention.write_kv.

Cache layout as in ops/paged_attention.py: k_pages, v_pages [KVH, P, S, D] or QuantizedPages.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention_tiles as tiles
from ops.kernel_choice import KernelBackends, choose_impl, or_reference
from ops.kv_quant import QuantizedPages
from ops.paged_attention import write_kv
from ops.rms_norm import normed_row, rms_norm_reference


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [N, heads, D]; positions: int32 [N]."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)  # [N, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [N, 1, D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """q [N, H, D], k and v [N, KVH, D] of the fused projection [N, (H + 2 KVH) * D] or of
    (q [N, H * D], k [N, KVH * D], v [N, KVH * D])."""
    if isinstance(qkv, (tuple, list)):
        q, k, v = qkv
    else:
        q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv[:, :q_cols], qkv[:, q_cols:q_cols + kv_cols], qkv[:, q_cols + kv_cols:]
    n = q.shape[0]
    return (q.reshape(n, num_heads, head_dim), k.reshape(n, num_kv_heads, head_dim),
            v.reshape(n, num_kv_heads, head_dim))


def rope_and_write_kv_reference(qkv, positions, inv_freq, k_pages, v_pages, slot_mapping, *,
                                num_heads: int, qk_norm: tuple | None = None,
                                kernels: KernelBackends | None = None):
    """The unfused ops: each query and key head RMS-normed (qk_norm), RoPE on q and k
    (apply_rope), then write_kv (per shard under a mesh in `kernels`)."""
    num_kv_heads, _, _, head_dim = k_pages.shape
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slot_mapping, kernels=kernels)
    return q, k_pages, v_pages


def _rope_kv_kernel(pos_ref, slot_ref, freq_ref, q_ref, k_ref, v_ref, *refs, group: int,
                    rows: int, head_dim: int, q_col: int, k_col: int, v_col: int,
                    norm_eps: float | None):
    # pos_ref, slot_ref: [N] int32 (all tokens); freq_ref: [D] float32 (inverse frequencies,
    #   repeated for both halves)
    # q_ref, k_ref, v_ref: [C] this token's projection row(s); its q heads start at column
    #   q_col, its k heads at k_col, its v heads at v_col
    # refs: (qw_ref [D], kw_ref [D]: the q/k norms' weights, when norm_eps is not None), then
    #   kp_in_ref, vp_in_ref, q_out_ref [H * D] (this token's rotated queries), kp_ref, vp_ref
    #   [P * S, D] (this kv head's pages, aliased to kp_in_ref, vp_in_ref)
    qw_ref, kw_ref = refs[:2] if norm_eps is not None else (None, None)
    q_out_ref, kp_ref, vp_ref = refs[-3:]
    t, h = pl.program_id(0), pl.program_id(1)
    half = head_dim // 2
    # [Dp] columns, Dp = next_pow2(D); col_ok [Dp] (None: D is a power of two) masks the rest
    i, col_ok = tiles.row_columns(head_dim)
    partner = jnp.where(i < half, i + half, i - half)  # the element i rotates with
    partner = partner if col_ok is None else jnp.where(col_ok, partner, 0)
    sign = jnp.where(i < half, -1.0, 1.0).astype(jnp.float32)

    def load(view, mask=None):  # view [.., Dp]; masked elements and columns past D read as 0
        if col_ok is not None:
            mask = col_ok if mask is None else mask & col_ok
        return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0)

    angles = pos_ref[t].astype(jnp.float32) * load(freq_ref.at[i])  # [Dp]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    dtype = q_out_ref.dtype

    def rotate(ref, cols, partner_cols, w_ref, mask=None):  # ref[cols] (normed,) rotated,
        # float32; cols [.., Dp]: each row one head
        x = load(ref.at[cols], mask).astype(jnp.float32)
        xp = load(ref.at[partner_cols], mask).astype(jnp.float32)
        if w_ref is not None:  # each head RMS-normed, with ops.rms_norm's roundings
            scale = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / head_dim + norm_eps)
            x = normed_row(x, scale, load(w_ref.at[i]), dtype)
            xp = normed_row(xp, scale, load(w_ref.at[partner]), dtype)
        return x * cos + sign * xp * sin

    slot = slot_ref[t]
    ok = jnp.full((1,), slot >= 0)  # [1]
    row = jnp.full((1,), jnp.maximum(slot, 0))  # [1]
    base = k_col + h * head_dim
    k = rotate(k_ref, base + i, base + partner, kw_ref)  # [Dp]
    tiles.store_rows(kp_ref, row, k[None, :], ok)
    v = load(v_ref.at[v_col + h * head_dim + i])  # [Dp]
    tiles.store_rows(vp_ref, row, v[None, :], ok)

    g = jnp.arange(rows, dtype=jnp.int32)  # [G'] this kv head's query heads (padded)
    head_ok = g < group
    # Padding rows read head 0 and are written past the end of the output (masked on the GPU,
    # dropped by the interpreter), so they never touch a real head's row.
    cols = jnp.where(head_ok, h * group + g, 0)[:, None] * head_dim  # [G', 1]
    mask = jnp.broadcast_to(head_ok[:, None], (rows, i.shape[0]))
    q = rotate(q_ref, q_col + cols + i[None, :], q_col + cols + partner[None, :], qw_ref, mask)
    out_cols = jnp.where(head_ok, h * group + g, q_out_ref.shape[0] // head_dim)[:, None]
    plgpu.store(q_out_ref.at[out_cols * head_dim + i[None, :]], q.astype(q_out_ref.dtype),
                mask=mask if col_ok is None else mask & col_ok)


@functools.partial(jax.jit, static_argnames=("num_heads", "columns", "norm_eps", "interpret"))
def _rope_kv_pallas(positions, slot_mapping, freq, sources, norm_weights, k_pages, v_pages, *,
                    num_heads, columns, norm_eps, interpret):
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    num_tokens = positions.shape[0]
    num_slots = num_pages * page_size
    group = num_heads // num_kv_heads
    q_src, k_src, v_src = sources
    k_rows = k_pages.reshape(num_kv_heads, num_slots, head_dim)  # free
    v_rows = v_pages.reshape(num_kv_heads, num_slots, head_dim)

    def row_spec(src):  # this token's row of a projection output
        return pl.BlockSpec((None, src.shape[1]), lambda t, h: (t, 0))

    whole = pl.BlockSpec((head_dim,), lambda t, h: (0,))
    page_spec = pl.BlockSpec((None, num_slots, head_dim), lambda t, h: (h, 0, 0))
    kernel = functools.partial(
        _rope_kv_kernel, group=group, rows=tiles.next_pow2(group), head_dim=head_dim,
        q_col=columns[0], k_col=columns[1], v_col=columns[2], norm_eps=norm_eps)
    first = 6 + len(norm_weights)  # the pages' operand index
    q, k_rows, v_rows = pl.pallas_call(
        kernel, grid=(num_tokens, num_kv_heads),
        in_specs=[pl.BlockSpec((num_tokens,), lambda t, h: (0,)),
                  pl.BlockSpec((num_tokens,), lambda t, h: (0,)), whole,
                  row_spec(q_src), row_spec(k_src), row_spec(v_src),
                  *[whole] * len(norm_weights), page_spec, page_spec],
        out_specs=[pl.BlockSpec((None, num_heads * head_dim), lambda t, h: (t, 0)),
                   page_spec, page_spec],
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_heads * head_dim), q_src.dtype),
                   jax.ShapeDtypeStruct(k_rows.shape, k_rows.dtype),
                   jax.ShapeDtypeStruct(v_rows.shape, v_rows.dtype)],
        input_output_aliases={first: 1, first + 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="rope_and_write_kv",
    )(positions, slot_mapping, freq, q_src, k_src, v_src, *norm_weights, k_rows, v_rows)
    return (q.reshape(num_tokens, num_heads, head_dim), k_rows.reshape(k_pages.shape),
            v_rows.reshape(v_pages.shape))


def rope_and_write_kv(qkv, positions: jax.Array, inv_freq: np.ndarray, k_pages: jax.Array,
                      v_pages: jax.Array, slot_mapping: jax.Array, *, num_heads: int,
                      qk_norm: tuple | None = None, impl: str | None = None,
                      kernels: KernelBackends | None = None):
    """RoPE on this step's queries and keys, and the keys and values written to their slots.

    qkv: the fused projection [N, (H + 2 KVH) * D] (columns q, k, v), or the three projections
      (q [N, H * D], k [N, KVH * D], v [N, KVH * D]), in the pages' dtype.
    positions, slot_mapping: int32 [N] (slot < 0: padding, not written); inv_freq: float32
      [D / 2] (models.llama.rope_inv_freq). k_pages, v_pages: [KVH, P, S, D], or QuantizedPages
      (int8 / fp8; the jnp path quantizes the new rows: ops.paged_attention.write_kv).
    qk_norm: (q_weight [D], k_weight [D], eps) to RMS-norm each query and key head before the
      rotation (Qwen3, Gemma 3), or None.
    impl: None (kernels.kv_write where the kernel takes the inputs, else jnp; kernels None:
      jnp), 'pallas', 'pallas_interpret' (interpreted, for CPU tests) or 'reference'.
    Returns (q [N, H, D] rotated, k_pages, v_pages); the pages are updated in place when donated.
    """
    name = "rope_and_write_kv"
    num_kv_heads, _, _, head_dim = k_pages.shape
    fused = not isinstance(qkv, (tuple, list))
    sources = (qkv, qkv, qkv) if fused else tuple(qkv)
    widths = (((num_heads + 2 * num_kv_heads) * head_dim,) * 3 if fused
              else (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim))
    if len(sources) != 3 or any(s.ndim != 2 or s.shape != (positions.shape[0], w)
                                for s, w in zip(sources, widths)):
        raise ValueError(f"{name}: qkv {[s.shape for s in sources]} must be [N, (H + 2 KVH) * D]"
                         f" or three [N, H * D], [N, KVH * D], [N, KVH * D] arrays for "
                         f"{positions.shape[0]} positions, H={num_heads}, pages {k_pages.shape}")
    if slot_mapping.shape != positions.shape or num_heads % num_kv_heads:
        raise ValueError(f"{name}: slot_mapping {slot_mapping.shape} must match positions "
                         f"{positions.shape}, and H={num_heads} be a multiple of KVH="
                         f"{num_kv_heads}")
    kernels = or_reference(kernels)
    resolved = choose_impl(name, impl, kernels.kv_write)
    quantized = isinstance(k_pages, QuantizedPages)
    norm_weights = () if qk_norm is None else tuple(qk_norm[:2])
    if any(w.shape != (head_dim,) for w in norm_weights):
        raise ValueError(f"{name}: q/k norm weights {[w.shape for w in norm_weights]} must be "
                         f"[head_dim] = [{head_dim}]")
    kernel_ok = (tiles.kernel_takes_head_dim(head_dim) and not quantized
                 and not kernels.mesh and k_pages.dtype == sources[0].dtype
                 and all(w.dtype == sources[0].dtype for w in norm_weights)
                 and positions.shape[0] > 0)
    if resolved == "reference" or not kernel_ok:
        if resolved != "reference" and impl is not None:
            raise ValueError(f"{name}: the kernel needs an even head_dim of 16 to 256, pages "
                             f"and norm weights in the projections' dtype (not quantized "
                             f"pages) and no mesh")
        return rope_and_write_kv_reference(qkv, positions, inv_freq, k_pages, v_pages,
                                           slot_mapping, num_heads=num_heads, qk_norm=qk_norm,
                                           kernels=kernels)
    columns = ((0, num_heads * head_dim, (num_heads + num_kv_heads) * head_dim) if fused
               else (0, 0, 0))
    freq = jnp.asarray(np.concatenate([inv_freq, inv_freq]).astype(np.float32))  # [D]
    return _rope_kv_pallas(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), freq,
                           sources, norm_weights, k_pages, v_pages, num_heads=num_heads,
                           columns=columns,
                           norm_eps=None if qk_norm is None else float(qk_norm[2]),
                           interpret=tiles.interpret_or_gpu(resolved))
