"""Ragged paged attention: several query tokens per sequence, given as one flat token array
(the step batch of a continuous-batching engine), causal over each sequence's cached pages.
Serves chunked prefill, prefix-cache hits, speculative verification (k + 1 tokens) and decode.

Inputs: q [N, H, D] holds the query tokens of all sequences back to back (padding at the end);
sequence s owns q[query_start_loc[s]:query_start_loc[s + 1]], and kv_lens[s] counts its tokens
in the cache including this step's (already written), so its i-th query sits at position
kv_lens[s] - q_len_s + i and sees keys at positions <= its own. Cache layout and quantized
pages as in ops/paged_attention.py (int8 / float8 pages with per-token scales: ops/kv_quant.py).

Kernel: the queries are cut into q blocks of `block_q` tokens that never straddle two sequences;
a program handles one (q block, kv head, key split). Its tile stacks the q block's tokens times
the kv head's G query heads into block_m = block_q * G rows (grouped-query heads share every
K/V load, and the tile is sized for the matrix units), and walks the keys `block_k` tokens at a
time through the block table with an online softmax: first the key blocks every row sees whole
(no mask), then the causal edge (masked). The q blocks of all sequences are enumerated in jnp
before the call (at most cdiv(N, block_q) + S of them, a static bound); programs are launched
longest-first (last q blocks of a sequence see the most keys). Programs left over zero the
padding rows at the end of q, so every output row is finite. Key splits (flash-decoding) are
used for small query counts (decode, speculative verification) over long contexts.

Tuning (`ragged_config`): block_m = next power of two of max_q_len * G, clamped to [16, 128]
(64 for head_dim 256). Prefill-sized tiles (block_m >= 64): block_k 64, 4 warps, 3 pipeline
stages, with the softmax's exponent in PTX (`RaggedConfig.ptx_softmax`: one fma and one
ex2.approx per logit; on the H200 a 4k-token prefill ran at 379 TFLOP/s against about 270 with
jnp's exp2). Decode-sized tiles keep the jnp softmax (PTX measured no faster there). head_dim 256
keeps block_k 32 and 5 stages. Below block_m 64 the program is bandwidth-bound like decode:
block_k 128 and, when block_m <= 32, key splits for about two programs per SM.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention_tiles as tiles
from ops.kernel_choice import KernelBackends, or_reference
from ops.kv_quant import dequantize_pages


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Static tiling of the ragged kernel."""

    block_m: int  # rows per program: block_q tokens x G query heads (power of two, >= 16)
    block_k: int  # key tokens per loop step
    num_splits: int = 1  # programs per (q block, kv head) along the keys
    num_warps: int = 4
    num_stages: int = 3
    # One PTX fma + exp2 per logit in the online softmax (attention_tiles.attend_tile; jnp
    # in interpret mode). ragged_config turns it on for prefill tiles, where it measured faster.
    ptx_softmax: bool = False


def ragged_config(num_seqs: int, num_kv_heads: int, group: int, max_q_len: int,
                  max_kv_tokens: int, head_dim: int) -> RaggedConfig:
    """The tuning heuristic (see the module docstring). Key splits are merged by a jnp fusion
    after the kernel (attention_tiles.merge_splits)."""
    cap = 128 if head_dim <= 128 else 64
    block_m = min(max(tiles.next_pow2(max_q_len * group), 16), cap)
    block_m = max(block_m, tiles.next_pow2(group))
    if block_m >= 64:
        if head_dim <= 128:
            return RaggedConfig(block_m=block_m, block_k=64, num_warps=4, num_stages=3,
                                ptx_softmax=True)
        return RaggedConfig(block_m=block_m, block_k=32, num_warps=4, num_stages=5)
    block_k = 128 if head_dim <= 128 else 64
    splits = 1
    if block_m <= 32:  # about two programs per SM
        want = max(1, round(2 * tiles.NUM_SMS / (num_seqs * num_kv_heads)))
        most = max(1, max_kv_tokens // (2 * block_k))
        splits = min(want, most, 64)
    return RaggedConfig(block_m=block_m, block_k=block_k, num_splits=splits)


def _ragged_kernel(meta_ref, tables_ref, q_ref, k_ref, v_ref, *refs, group: int,
                   num_heads: int, block_m: int, block_k: int, page_size: int, num_pages: int,
                   table_width: int, num_splits: int, sm_scale: float,
                   soft_cap: float | None, sliding_window: int | None, quantized: bool,
                   split_out: bool, ptx_softmax: bool = False, gpu_sync: bool = True):
    # meta_ref:   [5] int32, this q block: (sequence, first flat token, tokens, position of
    #             the first token, keys needed = position of the last token + 1)
    # tables_ref: [S * W] int32, all block tables, flattened
    # q_ref:      [N * H, D], one row per (token, head)
    # k_ref, v_ref: [P * S, D], this kv head's pages, one row per cache slot
    # refs: (ks_ref [P * S] f32, vs_ref [P * S] f32 when quantized), then
    #   o_ref [N * H, D] (q dtype, one split) or [N * H, D] f32 (this split's partial),
    #   lse_ref [N * H] f32 (this split's log2-sum-exp) when split_out
    if quantized:
        ks_ref, vs_ref, *out_refs = refs
    else:
        ks_ref = vs_ref = None
        out_refs = refs
    h, split = pl.program_id(0), pl.program_id(1)
    seq, q_start, q_count, q_pos0, kv_end = (meta_ref[i] for i in range(5))

    r = jnp.arange(block_m, dtype=jnp.int32)  # [M] rows: token r // G, head r % G
    t = jax.lax.div(r, group)  # r >= 0: truncation is floor division
    row_ok = t < q_count
    q_rows = (q_start + t) * num_heads + h * group + jax.lax.rem(r, group)  # [M] (token, head)
    q = tiles.load_rows(q_ref, jnp.where(row_ok, q_rows, 0), row_ok)  # [M, Dp] (next_pow2(D))
    pos = q_pos0 + t  # [M] query positions

    lo = 0
    if sliding_window is not None:  # the first row sees keys > q_pos0 - window
        lo = jnp.maximum(q_pos0 - sliding_window + 1, 0) // block_k * block_k
    num_blocks = pl.cdiv(jnp.maximum(kv_end - lo, 0), block_k)
    per_split = pl.cdiv(num_blocks, num_splits)
    first = jnp.minimum(split * per_split, num_blocks)
    last = jnp.minimum(first + per_split, num_blocks)
    if sliding_window is None:  # key blocks wholly at or before q_pos0 need no mask
        mid = jnp.clip((q_pos0 + 1) // block_k, first, last)
    else:
        mid = first
    table_base = seq * table_width

    def positions(i):  # [BK] key positions of loop step i
        return lo + i * block_k + jnp.arange(block_k, dtype=jnp.int32)

    def slots_of(tok):  # [BK] their cache slots
        return tiles.kv_slots(tables_ref, table_base, tok, page_size=page_size,
                              table_width=table_width, num_pages=num_pages)

    def body(i, carry, masked: bool):
        tok = positions(i)
        slots = slots_of(tok)
        ok = (tok < kv_end) if masked else None
        k = tiles.load_rows(k_ref, slots, ok).astype(q.dtype)  # [BK, Dp]
        v = tiles.load_rows(v_ref, slots, ok).astype(q.dtype)  # [BK, Dp]
        ks = vs = None
        if quantized:
            ks = tiles.load_scales(ks_ref, slots, ok)  # [BK]
            vs = tiles.load_scales(vs_ref, slots, ok)  # [BK]
        mask = None
        if masked:
            mask = tok[None, :] <= pos[:, None]  # [M, BK] causal (implies tok < kv_end)
            if sliding_window is not None:
                mask &= tok[None, :] > pos[:, None] - sliding_window
        carry = tiles.attend_tile(q, k, v, ks, vs, mask, carry, sm_scale=sm_scale,
                                  soft_cap=soft_cap, ptx=ptx_softmax and gpu_sync)
        return carry

    carry = tiles.init_carry(block_m, q.shape[-1])
    carry = jax.lax.fori_loop(first, mid, functools.partial(body, masked=False), carry)
    carry = jax.lax.fori_loop(mid, last, functools.partial(body, masked=True), carry)
    out, lse = tiles.finish(carry)  # [M, Dp], [M]
    tiles.store_rows(out_refs[0], q_rows, out, row_ok)
    if split_out:
        tiles.store_vector(out_refs[1], q_rows, lse, row_ok)


def _q_blocks(query_start_loc, kv_lens, num_tokens: int, block_q: int, num_blocks: int):
    """[num_blocks, 5] int32 metadata of the q blocks, longest-first (see _ragged_kernel).

    Blocks past the real ones cover the padding rows after the last sequence (block_q rows
    each), with no keys, so that their output rows are written as zeros.
    """
    num_seqs = kv_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    blocks_per_seq = pl.cdiv(q_lens, block_q)  # [S]
    ends = jnp.cumsum(blocks_per_seq)  # [S] inclusive
    i = jnp.arange(num_blocks, dtype=jnp.int32)  # [NB]
    seq = jnp.sum(ends[None, :] <= i[:, None], axis=1).astype(jnp.int32)  # [NB] in [0, S]
    real = seq < num_seqs
    s = jnp.minimum(seq, num_seqs - 1)
    tok0 = (i - (ends[s] - blocks_per_seq[s])) * block_q  # first token within the sequence
    pad_start = query_start_loc[-1] + (i - ends[-1]) * block_q
    q_start = jnp.where(real, query_start_loc[s] + tok0, pad_start)
    q_count = jnp.where(real, jnp.minimum(q_lens[s] - tok0, block_q),
                        jnp.clip(num_tokens - pad_start, 0, block_q))
    q_pos0 = jnp.where(real, kv_lens[s] - q_lens[s] + tok0, 0)
    kv_end = jnp.where(real, q_pos0 + q_count, 0)
    meta = jnp.stack([s, q_start, q_count, q_pos0, kv_end], axis=1).astype(jnp.int32)
    return meta[::-1]  # the last (largest) q blocks first


@functools.partial(jax.jit, static_argnames=("max_q_len", "config", "sm_scale", "soft_cap",
                                             "sliding_window", "interpret"))
def _ragged_attention_pallas(q, k_pages, v_pages, block_tables, query_start_loc, kv_lens,
                             k_scales, v_scales, *, max_q_len: int, config: RaggedConfig,
                             sm_scale: float, soft_cap, sliding_window, interpret: bool):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, table_width = block_tables.shape
    group = num_heads // num_kv_heads
    num_slots = num_pages * page_size
    block_q = config.block_m // group
    # sum_s cdiv(q_len_s, block_q) + cdiv(padding rows, block_q) <= cdiv(N, block_q) + S
    num_q_blocks = pl.cdiv(num_tokens, block_q) + num_seqs
    quantized = k_scales is not None
    splits = config.num_splits
    split_out = splits > 1

    meta = _q_blocks(query_start_loc, kv_lens, num_tokens, block_q, num_q_blocks)
    rows = num_tokens * num_heads
    # (kv head, key split, q block): the first axis varies fastest in launch order, so the
    # largest q blocks (first in `meta`) of every head start first.
    grid = (num_kv_heads, splits, num_q_blocks)
    in_specs = [
        pl.BlockSpec((None, 5), lambda h, s, i: (i, 0)),  # this q block's metadata
        pl.BlockSpec((num_seqs * table_width,), lambda h, s, i: (0,)),  # block tables
        pl.BlockSpec((rows, head_dim), lambda h, s, i: (0, 0)),  # q rows
        pl.BlockSpec((None, num_slots, head_dim), lambda h, s, i: (h, 0, 0)),  # k pages
        pl.BlockSpec((None, num_slots, head_dim), lambda h, s, i: (h, 0, 0)),  # v pages
    ]
    args = [meta, block_tables.reshape(-1), q.reshape(rows, head_dim),
            k_pages.reshape(num_kv_heads, num_slots, head_dim),
            v_pages.reshape(num_kv_heads, num_slots, head_dim)]
    if quantized:
        in_specs += [pl.BlockSpec((None, num_slots), lambda h, s, i: (h, 0))] * 2
        args += [k_scales.reshape(num_kv_heads, num_slots),
                 v_scales.reshape(num_kv_heads, num_slots)]
    if split_out:
        out_shape = [jax.ShapeDtypeStruct((splits, rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, rows, head_dim), lambda h, s, i: (s, 0, 0)),
                     pl.BlockSpec((None, rows), lambda h, s, i: (s, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((rows, head_dim), q.dtype)]
        out_specs = [pl.BlockSpec((rows, head_dim), lambda h, s, i: (0, 0))]
    kernel = functools.partial(
        _ragged_kernel, group=group, num_heads=num_heads, block_m=config.block_m,
        block_k=config.block_k, page_size=page_size, num_pages=num_pages,
        table_width=table_width, num_splits=splits, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, quantized=quantized, split_out=split_out,
        ptx_softmax=config.ptx_softmax,
        gpu_sync=not interpret)
    outs = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret, name="ragged_paged_attention",
    )(*args)
    out = tiles.merge_splits(outs[0], outs[1], q.dtype) if split_out else outs[0]
    return out.reshape(num_tokens, num_heads, head_dim)


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, query_start_loc: jax.Array,
                           kv_lens: jax.Array, *, max_q_len: int,
                           k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None, scale: float | None = None,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           impl: str | None = None, config: RaggedConfig | None = None,
                           kernels: KernelBackends | None = None) -> jax.Array:
    """Causal attention of a flat, ragged batch of query tokens over their sequences' pages.

    q: [N, H, D] the query tokens of all sequences back to back (may be padded at the end).
    k_pages, v_pages: [KVH, P, S, D] in q's dtype, or int8 / float8_e4m3fn with
      k_scales, v_scales: [KVH, P, S] float32.
    block_tables: int32 [num_seqs, W]; query_start_loc: int32 [num_seqs + 1], nondecreasing,
      from 0: sequence s's queries are q[query_start_loc[s]:query_start_loc[s + 1]];
    kv_lens: int32 [num_seqs], the sequence's tokens in the cache, this step's included
      (already written). Query i of sequence s sits at position kv_lens[s] - q_len + i and sees
      keys at positions <= its own (and > position - sliding_window). Padding sequences have
      q_len 0 and kv_len 0.
    max_q_len: static upper bound on any sequence's q_len (sizes the tiles and the reference's
      padded gather). scale: the softmax scale (default head_dim ** -0.5); soft_cap: logits
      become soft_cap * tanh(logits / soft_cap); config overrides `ragged_config`.
    impl: None (kernels.attention: the kernel unless the head_dim does not fit it, then jnp;
      kernels None: the jnp reference), 'pallas', 'pallas_interpret' (CPU tests) or
      'reference'.
    Returns [N, H, D] in q's dtype; rows of no sequence are 0.
    """
    name = "ragged_paged_attention"
    tiles.check_ragged_inputs(name, q, k_pages, v_pages, k_scales, v_scales, block_tables,
                              query_start_loc, kv_lens, max_q_len)
    num_tokens, num_heads, head_dim = q.shape
    resolved, sm_scale = tiles.resolve_options(name, impl, or_reference(kernels).attention,
                                               q.shape, scale, soft_cap,
                                               sliding_window)
    if resolved == "reference":
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, block_tables, query_start_loc, kv_lens, max_q_len=max_q_len,
            k_scales=k_scales, v_scales=v_scales, scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window)
    if config is None:
        num_kv_heads = k_pages.shape[0]
        config = ragged_config(block_tables.shape[0], num_kv_heads, num_heads // num_kv_heads,
                               min(max_q_len, num_tokens),
                               block_tables.shape[1] * k_pages.shape[2], head_dim)
    return _ragged_attention_pallas(
        q, k_pages, v_pages, block_tables, query_start_loc, kv_lens, k_scales, v_scales,
        max_q_len=max_q_len, config=config, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=tiles.interpret_or_gpu(resolved))


def ragged_paged_attention_reference(q, k_pages, v_pages, block_tables, query_start_loc,
                                     kv_lens, *, max_q_len, k_scales=None, v_scales=None,
                                     scale=None, soft_cap=None, sliding_window=None):
    """Plain jnp: gather the queries into [S, max_q_len], attend over gathered pages, scatter."""
    if k_scales is not None:
        k_pages = dequantize_pages(k_pages, k_scales)
        v_pages = dequantize_pages(v_pages, v_scales)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_seqs, width = block_tables.shape
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    hi = jax.lax.Precision.HIGHEST
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    t = jnp.arange(max_q_len)  # [T]
    tok = query_start_loc[:-1, None] + t[None, :]  # [S, T] flat token index
    valid = t[None, :] < q_lens[:, None]  # [S, T]
    qs = q[jnp.clip(tok, 0, num_tokens - 1)].astype(jnp.float32)  # [S, T, H, D]
    qs = qs.reshape(num_seqs, max_q_len, num_kv_heads, group, head_dim)
    pos = kv_lens[:, None] - q_lens[:, None] + t[None, :]  # [S, T]
    k = k_pages[:, block_tables].reshape(num_kv_heads, num_seqs, width * page_size, head_dim)
    v = v_pages[:, block_tables].reshape(num_kv_heads, num_seqs, width * page_size, head_dim)
    logits = jnp.einsum("stngd,nskd->sngtk", qs, k.astype(jnp.float32), precision=hi) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    key = jnp.arange(width * page_size)  # [K]
    visible = (key[None, None, :] <= pos[:, :, None]) & (key[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        visible &= key[None, None, :] > pos[:, :, None] - sliding_window
    visible &= valid[:, :, None]  # [S, T, K]
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)  # [S, KVH, G, T, K]
    logits = jnp.where(visible.any(-1)[:, None, None, :, None], logits, 0.0)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("sngtk,nskd->stngd", probs, v.astype(jnp.float32), precision=hi)
    out = out.reshape(num_seqs, max_q_len, num_heads, head_dim)
    dest = jnp.where(valid, tok, num_tokens)  # [S, T]; invalid -> dropped
    result = jnp.zeros((num_tokens, num_heads, head_dim), jnp.float32)
    result = result.at[dest].set(out, mode="drop")
    return result.astype(q.dtype)
