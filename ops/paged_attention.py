"""Attention over a paged KV cache, and the KV write at a slot mapping.

Cache layout, per layer:
    k_pages, v_pages  [num_kv_heads, num_pages, page_size, head_dim]
or, for an int8 / fp8 cache, `ops.kv_quant.QuantizedPages` (those values plus float32 scales
[num_kv_heads, num_pages, page_size]); every function here takes either.
A sequence's logical page j lives in physical page block_tables[b, j]; its token at position p
is in slot block_tables[b, p // page_size] * page_size + p % page_size.

This file holds the KV write, the plain-jnp attention over a ragged step (in a decode and a
prefill group), and `step_attention`, which dispatches to the Pallas kernel of
ops/ragged_attention.py as its KernelBackends say.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ops.kernel_choice import KernelBackends, or_reference
from ops.kv_quant import QuantizedPages, dequantize_pages, quantize_kv
from ops.ragged_attention import ragged_paged_attention
from ops.sharded_attention import sharded_step_attention, sharded_write_kv
from ops.tpu_ragged_attention import tpu_ragged_paged_attention


def write_kv(k_pages, v_pages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             kernels: KernelBackends | None = None):
    """Scatters new keys and values into the pages at flat slot indices.

    k_pages, v_pages: [KVH, P, S, D] float arrays, or QuantizedPages (int8 / fp8): each new row
    (token, head) is then quantized with its own scale (ops.kv_quant.quantize_kv) and its values
    and scale stored. k, v: [N, KVH, D]; slot_mapping: int32 [N]. Slots outside [0, P * S)
    (padding) are dropped. Returns the updated pages, of the pages' type; when the pages are
    donated to the enclosing jit, XLA performs the scatter in place.
    kernels: with a mesh (a sharded step), each shard writes its own part (shard_map).
    """
    kernels = or_reference(kernels)
    if kernels.mesh:  # a sharded step: write per shard
        shard = functools.partial(write_kv, kernels=kernels.per_shard())
        return sharded_write_kv(kernels.mesh_shape, shard, k_pages, v_pages, k, v,
                                slot_mapping)
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"write_kv: k {k.shape} and v {v.shape} must be [N, {num_kv_heads}, "
                         f"{head_dim}] to match pages {k_pages.shape}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"write_kv: slot_mapping {slot_mapping.shape} must be [{k.shape[0]}]")
    if isinstance(k_pages, QuantizedPages) != isinstance(v_pages, QuantizedPages):
        raise ValueError("write_kv: k_pages and v_pages must both be quantized or both float")
    # Padding slots (< 0) go to page num_pages, past the end, where mode="drop" discards them.
    # The scatter is written in the 4-D page layout (no reshape) so that XLA updates the donated
    # pages in place instead of copying them.
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # [N]
    offset = slot_mapping % page_size  # [N]

    def scatter(pages, rows):  # rows [N, KVH, ...] -> pages[:, page, offset]
        return pages.at[:, page, offset].set(rows.swapaxes(0, 1).astype(pages.dtype),
                                             mode="drop")

    def write(pages, rows):
        if not isinstance(pages, QuantizedPages):
            return scatter(pages, rows)
        values, scales = quantize_kv(rows, pages.dtype)  # [N, KVH, D], [N, KVH]
        return QuantizedPages(scatter(pages.values, values), scatter(pages.scales, scales))

    return write(k_pages, k), write(v_pages, v)


def paged_attention_reference(q, k_pages, v_pages, block_tables, q_positions, kv_lens, *,
                              scale=None, soft_cap=None, sliding_window=None):
    """Causal attention of several query tokens per sequence over that sequence's pages, in
    plain jnp: gathers the pages through the block table, then a softmax.

    q: [B, T, H, D] (H a multiple of KVH); k_pages, v_pages: [KVH, P, S, D] (or QuantizedPages,
    dequantized after the gather); block_tables:
    int32 [B, W]; q_positions: int32 [B, T] (padding tokens may hold any position: their output
    is to be ignored); kv_lens: int32 [B], cached tokens after this step's write. A query at
    position p sees keys at positions <= p and < kv_len (and > p - sliding_window). Returns
    [B, T, H, D] in q's dtype.
    """
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale

    def gather(pages):  # each sequence's pages, float32: [KVH, B, W, S, D] -> [B, W*S, KVH, D]
        if isinstance(pages, QuantizedPages):  # dequantize only the gathered pages
            rows = dequantize_pages(pages.values[:, block_tables], pages.scales[:, block_tables])
        else:
            rows = pages[:, block_tables].astype(jnp.float32)
        return rows.reshape(num_kv_heads, batch, width * page_size, head_dim).transpose(1, 2, 0, 3)

    k, v = gather(k_pages), gather(v_pages)  # [B, K, KVH, D]
    qg = q.astype(jnp.float32).reshape(batch, num_q, num_kv_heads, group, head_dim)
    logits = jnp.einsum("btngd,bsnd->bngts", qg, k) * scale  # [B, KVH, G, T, K]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    key_pos = jnp.arange(width * page_size, dtype=jnp.int32)  # [K]
    qp = q_positions[:, :, None]  # [B, T, 1]
    visible = (key_pos[None, None, :] <= qp) & (key_pos[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > qp - sliding_window
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)  # [B, KVH, G, T, K]
    # A padding query may see no key at all: give it uniform weights instead of NaN.
    logits = jnp.where(visible.any(-1)[:, None, None, :, None], logits, 0.0)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bngts,bsnd->btngd", probs, v)  # [B, T, KVH, G, D]
    return out.reshape(batch, num_q, num_heads, head_dim).astype(q.dtype)


def ragged_attention_by_groups(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               block_tables: jax.Array, query_start_loc: jax.Array,
                               kv_lens: jax.Array, *, max_q_len: int, max_prefill_seqs: int,
                               **kwargs) -> jax.Array:
    """Ragged paged attention through the padded reference, in a decode and a prefill group.

    q: [N, H, D], the flat query tokens of all sequences of a step; sequence s owns
      q[query_start_loc[s]:query_start_loc[s + 1]] (query_start_loc int32 [S + 1]).
    kv_lens: int32 [S], cached tokens of each sequence including this step's (already written);
      query i of sequence s sits at position kv_lens[s] - q_len_s + i. Padding sequences have
      q_len 0 and kv_len 0.
    max_q_len (static): an upper bound of q_len; max_prefill_seqs (static): an upper bound of the
      number of sequences with q_len > 1.
    Sequences with one query token (decodes) run as one [S, 1] padded batch; those with more as
    one [max_prefill_seqs, max_q_len] batch, so a step of many decodes and a long prefill chunk
    costs S + max_prefill_seqs * max_q_len query rows, not S * max_q_len.
    Returns [N, H, D]; rows outside every sequence are zero.
    """
    num_tokens = q.shape[0]
    num_seqs = kv_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"ragged attention: query_start_loc {query_start_loc.shape} must be "
                         f"[{num_seqs + 1}] and block_tables {block_tables.shape} [{num_seqs}, W]")
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    out = jnp.zeros_like(q)
    # Decode group: the last query token of every sequence, kept where q_len == 1.
    last = jnp.clip(query_start_loc[1:] - 1, 0, num_tokens - 1)  # [S]
    is_decode = q_lens == 1
    decoded = paged_attention_reference(
        q[last][:, None], k_pages, v_pages, block_tables, (kv_lens - 1)[:, None],
        jnp.where(is_decode, kv_lens, 0), **kwargs)[:, 0]  # [S, H, D]
    out = out.at[jnp.where(is_decode, last, num_tokens)].set(decoded, mode="drop")
    if max_q_len > 1 and max_prefill_seqs > 0:
        # Prefill group: up to max_prefill_seqs sequences with q_len > 1, padded to max_q_len.
        seqs = jnp.nonzero(q_lens > 1, size=max_prefill_seqs, fill_value=num_seqs)[0]  # [P]
        valid = seqs < num_seqs
        seqs = jnp.minimum(seqs, num_seqs - 1)
        lens = jnp.where(valid, q_lens[seqs], 0)  # [P]
        offsets = jnp.arange(max_q_len, dtype=jnp.int32)  # [Q]
        tokens = query_start_loc[seqs][:, None] + offsets  # [P, Q]
        positions = kv_lens[seqs][:, None] - lens[:, None] + offsets  # [P, Q]
        prefilled = paged_attention_reference(
            q[jnp.clip(tokens, 0, num_tokens - 1)], k_pages, v_pages, block_tables[seqs],
            positions, jnp.where(valid, kv_lens[seqs], 0), **kwargs)  # [P, Q, H, D]
        rows = jnp.where(offsets < lens[:, None], tokens, num_tokens).reshape(-1)
        out = out.at[rows].set(prefilled.reshape((-1,) + q.shape[1:]), mode="drop")
    return out


def bounds_prefill_seqs(kernels: KernelBackends | None) -> bool:
    """Whether `step_attention` under these kernels sizes its work by max_prefill_seqs: only the
    grouped jnp reference does (its prefill group); the kernels read the ragged batch as it
    is, so a runner of theirs need not compile a program per count of prefilling sequences."""
    return or_reference(kernels).attention == "reference"


def step_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                   block_tables: jax.Array, query_start_loc: jax.Array, kv_lens: jax.Array, *,
                   max_q_len: int, max_prefill_seqs: int, scale: float | None = None,
                   soft_cap: float | None = None, sliding_window: int | None = None,
                   kernels: KernelBackends | None = None) -> jax.Array:
    """The engine's attention over a ragged step, as `kernels.attention` says.

    Arguments as in `ragged_attention_by_groups` (pages float or QuantizedPages); scale,
    soft_cap and sliding_window as in `paged_attention_reference` (every path applies them).
    "pallas" runs the ragged Pallas kernel
    (ops/ragged_attention.py; ops/tpu_ragged_attention.py with TPU kernels), which reads only
    each sequence's own pages; "reference" (and
    kernels None) the grouped jnp reference. With a mesh in `kernels` each shard runs this on
    its own heads and sequences (ops/sharded_attention.py).
    """
    kernels = or_reference(kernels)
    if kernels.mesh:
        shard = functools.partial(step_attention, max_q_len=max_q_len,
                                  max_prefill_seqs=max_prefill_seqs, scale=scale,
                                  soft_cap=soft_cap, sliding_window=sliding_window,
                                  kernels=kernels.per_shard())
        return sharded_step_attention(kernels.mesh_shape, shard, q, k_pages, v_pages,
                                      block_tables, query_start_loc, kv_lens)
    if kernels.attention != "reference":
        scales = {}
        if isinstance(k_pages, QuantizedPages):  # the kernel dequantizes in registers
            scales = dict(k_scales=k_pages.scales, v_scales=v_pages.scales)
            k_pages, v_pages = k_pages.values, v_pages.values
        if kernels.tpu:  # the Mosaic TPU kernel (ops/tpu_ragged_attention.py)
            return tpu_ragged_paged_attention(
                q, k_pages, v_pages, block_tables, query_start_loc, kv_lens,
                max_q_len=max_q_len, scale=scale, soft_cap=soft_cap,
                sliding_window=sliding_window, generation=kernels.tpu_generation,
                interpret=kernels.attention == "pallas_interpret", **scales)
        return ragged_paged_attention(q, k_pages, v_pages, block_tables, query_start_loc,
                                      kv_lens, max_q_len=max_q_len, scale=scale,
                                      soft_cap=soft_cap, sliding_window=sliding_window,
                                      kernels=kernels, **scales)
    return ragged_attention_by_groups(q, k_pages, v_pages, block_tables, query_start_loc,
                                      kv_lens, max_q_len=max_q_len,
                                      max_prefill_seqs=max_prefill_seqs, scale=scale,
                                      soft_cap=soft_cap, sliding_window=sliding_window)
