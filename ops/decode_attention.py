"""Decode attention over a paged KV cache: one query token per sequence (Pallas, Triton GPU).

Cache layout, per layer (../shared/DESIGN.md): k_pages, v_pages [num_kv_heads, num_pages,
page_size, head_dim]; a sequence's token at position p sits in page block_tables[b, p // S] at
offset p % S. int8 / float8_e4m3fn pages carry per-token, per-head float32 scales
[num_kv_heads, num_pages, page_size] (ops/kv_quant.py) and are dequantized in registers.

Kernel: one program per (sequence, kv head, key split). The program loads the query rows of
the kv head's whole group (grouped-query attention: G query heads share each K/V load; the
rows are padded to 16, the smallest tl.dot tile), then walks its slice of the sequence's keys
`block_k` tokens at a time, gathering each token's row through the block table, with an
online softmax. With more than one split (flash-decoding) each program writes its normalized
partial output and log-sum-exp, and `merge_splits` combines them in jnp, or the last program
of the sequence and kv head to finish combines them (`merge_in_kernel`).

Tuning (`decode_config`, from sweeps on an H200 at 32 q / 8 kv heads, head_dim 128, page 16):
4 warps, 3 pipeline stages. Where the calls are bound by bandwidth and need key splits to fill
the card (more than 8 (sequence, kv head) streams, e.g. B = 4 to 32 at 8 kv heads): 64-token
tiles with splits for about four programs per SM (132 SMs on an H100/H200), e.g. B = 8 at 4k
context -> 8 splits: in device time 3-8% faster than 128-token tiles at two per SM at B = 4,
8 and 16 (B = 8 / 4k: 40.0 against 42.0 us, three rounds each), equal at B = 32 (fifteenth
session). Elsewhere block_k = 128 (a 64 KiB K+V tile in bf16; 64 for head_dim 256) with about
two programs per SM: B >= 64 at 8 kv heads -> 1 split, B = 1 at 32k -> 32 (64-token tiles at
four per SM were 1.6x slower at B = 1, where the splits merge in the kernel). Splits keep at
least 2 tiles each for the longest sequence the block table allows. The split
boundaries follow each sequence's actual length, so short sequences in a wide table still
spread over all splits. Up to 8 (sequence, kv head) streams (B = 1 at 8 kv heads) the splits
are merged inside the kernel (`merge_in_kernel`: the last split to finish combines the others;
faster at B = 1 in 7 of 8 pairs on an H200, e.g. 15.0 against 20.2 us at 512 tokens), above
that by a jnp merge after it (inside was slower at B = 8 / 4k in 6 of 8 pairs, by up to 10 us).
Figures in docs/PERFORMANCE.md.
`DecodeConfig.prefetch_slots` reads
the next tile's block-table entries one loop step ahead, so that no K/V load of a step waits on
that step's own table load; the tuning sweep (scripts/bench_attention.py --modes=sweep) timed
it on an H200 with no gain for decode, so it stays off.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention_tiles as tiles
from ops.kv_quant import dequantize_pages

NUM_SMS = 132  # H100 / H200; only shapes the split heuristic
MERGE_IN_KERNEL_PROGRAMS = 8  # (sequence, kv head) programs up to which splits merge in-kernel


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static tiling of the decode kernel."""

    block_k: int  # key tokens per loop step
    num_splits: int  # programs per (sequence, kv head) along the keys
    num_warps: int = 4
    num_stages: int = 3
    # Read the next tile's block-table entries one loop step ahead, so that no K/V load waits
    # on a table load of its own step (an experiment of the tuning sweep: no gain for decode on
    # the H200, off by default).
    prefetch_slots: bool = False
    # With several splits, merge them inside the kernel: the last split of each (sequence, kv
    # head) to finish (an atomic counter) combines the others' partials, so no merge kernel runs
    # after it (`tiles.merge_split_partials`).
    merge_in_kernel: bool = False
    # One PTX fma + exp2 per logit in the online softmax, as RaggedConfig's (jnp in interpret
    # mode). Off: on decode shapes it measured no faster (docs/PERFORMANCE.md, eleventh session).
    ptx_softmax: bool = False


def decode_config(batch: int, num_kv_heads: int, max_kv_tokens: int,
                  head_dim: int) -> DecodeConfig:
    """The tuning heuristic (see the module docstring; measurements in docs/PERFORMANCE.md)."""
    programs = batch * num_kv_heads
    if head_dim <= 128 and programs > MERGE_IN_KERNEL_PROGRAMS:  # 64-token tiles, 4 per SM
        splits = min(round(4 * NUM_SMS / programs), max_kv_tokens // (2 * 64), 64)
        if splits > 1:
            return DecodeConfig(block_k=64, num_splits=splits)
    block_k = 128 if head_dim <= 128 else 64
    want = max(1, round(2 * NUM_SMS / programs))  # about two programs per SM
    most = max(1, max_kv_tokens // (2 * block_k))  # >= 2 tiles per split at the widest
    # Splits merged in the kernel where the call is latency-bound: a few programs (one llama
    # sequence's kv heads); bandwidth-bound calls keep the merge kernel after it.
    return DecodeConfig(block_k=block_k, num_splits=min(want, most, 64),
                        merge_in_kernel=programs <= MERGE_IN_KERNEL_PROGRAMS)


def _decode_kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, *refs, group: int,
                   rows: int, block_k: int, page_size: int, num_pages: int, table_width: int,
                   num_splits: int, sm_scale: float, soft_cap: float | None,
                   sliding_window: int | None, quantized: bool, split_out: bool,
                   prefetch_slots: bool = False, merge_in_kernel: bool = False,
                   ptx_softmax: bool = False, gpu_sync: bool = True):
    # lengths_ref: [B] int32, tokens in the cache per sequence (all sequences)
    # tables_ref:  [W] int32, this sequence's block table
    # q_ref:       [H, D], this sequence's query heads
    # k_ref, v_ref: [P * S, D], this kv head's pages, one row per cache slot
    # refs: (ks_ref [P * S] f32, vs_ref [P * S] f32 when quantized), then
    #   o_ref [H, D] (q dtype, one split) or [H, D] f32 (this split's partial),
    #   lse_ref [H] f32 (this split's log2-sum-exp) when split_out;
    #   with merge_in_kernel instead: the counts' input ref (aliased to counts_ref), then
    #   o_ref [H, D] (q dtype, the merged output),
    #   part_o_ref [K, H, D] f32 and part_lse_ref [K, H] f32 (every split's partial of this
    #   sequence), counts_ref [B, KVH] int32 (splits finished; zero before the call and after)
    if quantized:
        ks_ref, vs_ref, *out_refs = refs
    else:
        ks_ref = vs_ref = None
        out_refs = refs
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]

    g = jnp.arange(rows, dtype=jnp.int32)  # [M] query rows of this kv head's group
    row_ok = g < group
    q_rows = jnp.where(row_ok, h * group + g, 0)  # [M]
    q = tiles.load_rows(q_ref, q_rows, row_ok)  # [M, D]

    lo = 0
    if sliding_window is not None:  # keys at positions >= length - window are visible
        lo = jnp.maximum(length - sliding_window, 0) // block_k * block_k
    num_blocks = pl.cdiv(jnp.maximum(length - lo, 0), block_k)
    per_split = pl.cdiv(num_blocks, num_splits)
    first = jnp.minimum(split * per_split, num_blocks)
    last = jnp.minimum(first + per_split, num_blocks)

    def positions(i):  # [BK] key positions of loop step i
        return lo + i * block_k + jnp.arange(block_k, dtype=jnp.int32)

    def slots_of(tok):  # [BK] their cache slots
        return tiles.kv_slots(tables_ref, 0, tok, page_size=page_size,
                              table_width=table_width, num_pages=num_pages)

    def body(i, carry):
        carry, tok, slots, next_slots = tiles.step_keys(i, carry, positions, slots_of,
                                                        prefetch_slots)
        ok = tok < length
        if sliding_window is not None:
            ok &= tok >= length - sliding_window
        k = tiles.load_rows(k_ref, slots, ok).astype(q.dtype)  # [BK, D]
        v = tiles.load_rows(v_ref, slots, ok).astype(q.dtype)  # [BK, D]
        ks = vs = None
        if quantized:
            ks = tiles.load_scales(ks_ref, slots, ok)  # [BK]
            vs = tiles.load_scales(vs_ref, slots, ok)  # [BK]
        carry = tiles.attend_tile(q, k, v, ks, vs, ok[None, :], carry, sm_scale=sm_scale,
                                  soft_cap=soft_cap, ptx=ptx_softmax and gpu_sync)
        return (carry, next_slots) if prefetch_slots else carry

    carry = tiles.init_carry(rows, q.shape[-1])
    if prefetch_slots:
        carry, _ = jax.lax.fori_loop(first, last, body, (carry, slots_of(positions(first))))
    else:
        carry = jax.lax.fori_loop(first, last, body, carry)
    out, lse = tiles.finish(carry)  # [M, D], [M]
    if merge_in_kernel:
        _, o_ref, part_o_ref, part_lse_ref, counts_ref = out_refs  # counts in = counts out
        tiles.merge_split_partials(out, lse, h * group + g, row_ok, o_ref, part_o_ref,
                                   part_lse_ref, counts_ref, (b, h), split, num_splits,
                                   gpu_sync=gpu_sync)
        return
    tiles.store_rows(out_refs[0], h * group + g, out, row_ok)
    if split_out:
        tiles.store_vector(out_refs[1], h * group + g, lse, row_ok)


@functools.partial(jax.jit, static_argnames=("config", "sm_scale", "soft_cap",
                                             "sliding_window", "interpret"))
def _paged_attention_pallas(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, *,
                            config: DecodeConfig, sm_scale: float, soft_cap, sliding_window,
                            interpret: bool):
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    table_width = block_tables.shape[1]
    num_slots = num_pages * page_size
    quantized = k_scales is not None
    splits = config.num_splits
    split_out = splits > 1
    merge_in_kernel = split_out and config.merge_in_kernel

    k_rows = k_pages.reshape(num_kv_heads, num_slots, head_dim)  # [KVH, P*S, D], free
    v_rows = v_pages.reshape(num_kv_heads, num_slots, head_dim)
    grid = (batch, num_kv_heads, splits)  # (sequence, kv head, key split)
    in_specs = [
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),  # lengths
        pl.BlockSpec((None, table_width), lambda b, h, s: (b, 0)),  # block table row
        pl.BlockSpec((None, num_heads, head_dim), lambda b, h, s: (b, 0, 0)),  # q
        pl.BlockSpec((None, num_slots, head_dim), lambda b, h, s: (h, 0, 0)),  # k pages
        pl.BlockSpec((None, num_slots, head_dim), lambda b, h, s: (h, 0, 0)),  # v pages
    ]
    args = [lengths, block_tables, q, k_rows, v_rows]
    if quantized:
        in_specs += [pl.BlockSpec((None, num_slots), lambda b, h, s: (h, 0))] * 2
        args += [k_scales.reshape(num_kv_heads, num_slots),
                 v_scales.reshape(num_kv_heads, num_slots)]
    aliases = {}
    if merge_in_kernel:
        # The merged output, every split's partial of the sequence (read by its last split)
        # and the counters of finished splits, zeros in and out (aliased, updated in place).
        args.append(jnp.zeros((batch, num_kv_heads), jnp.int32))
        in_specs.append(pl.BlockSpec((batch, num_kv_heads), lambda b, h, s: (0, 0)))
        aliases = {len(args) - 1: 3}
        out_shape = [jax.ShapeDtypeStruct((batch, num_heads, head_dim), q.dtype),
                     jax.ShapeDtypeStruct((splits, batch, num_heads, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, batch, num_heads), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_kv_heads), jnp.int32)]
        out_specs = [pl.BlockSpec((None, num_heads, head_dim), lambda b, h, s: (b, 0, 0)),
                     pl.BlockSpec((splits, None, num_heads, head_dim),
                                  lambda b, h, s: (0, b, 0, 0)),
                     pl.BlockSpec((splits, None, num_heads), lambda b, h, s: (0, b, 0)),
                     pl.BlockSpec((batch, num_kv_heads), lambda b, h, s: (0, 0))]
    elif split_out:
        out_shape = [jax.ShapeDtypeStruct((splits, batch, num_heads, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, batch, num_heads), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, num_heads, head_dim),
                                  lambda b, h, s: (s, b, 0, 0)),
                     pl.BlockSpec((None, None, num_heads), lambda b, h, s: (s, b, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((batch, num_heads, head_dim), q.dtype)]
        out_specs = [pl.BlockSpec((None, num_heads, head_dim), lambda b, h, s: (b, 0, 0))]
    kernel = functools.partial(
        _decode_kernel, group=group, rows=max(16, tiles.next_pow2(group)),
        block_k=config.block_k, page_size=page_size, num_pages=num_pages,
        table_width=table_width, num_splits=splits, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, quantized=quantized, split_out=split_out,
        prefetch_slots=config.prefetch_slots, merge_in_kernel=merge_in_kernel,
        ptx_softmax=config.ptx_softmax, gpu_sync=not interpret)
    outs = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret, name="paged_decode_attention",
    )(*args)
    if not split_out or merge_in_kernel:
        return outs[0]
    return tiles.merge_splits(outs[0], outs[1], q.dtype)  # [B, H, D]


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, lengths: jax.Array, *,
                    k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                    scale: float | None = None, soft_cap: float | None = None,
                    sliding_window: int | None = None, impl: str | None = None,
                    config: DecodeConfig | None = None) -> jax.Array:
    """Decode attention: one query token per sequence over that sequence's cached pages.

    q: [B, H, D] the query of each sequence's newest token (bf16, fp16 or f32).
    k_pages, v_pages: [KVH, P, S, D] in q's dtype, or int8 / float8_e4m3fn with
      k_scales, v_scales: [KVH, P, S] float32 (value = page value * scale).
    block_tables: int32 [B, W], physical page of each of a sequence's logical pages.
    lengths: int32 [B], tokens in the cache per sequence (this step's token included, already
      written); 0 marks a padding row, whose output is 0.
    The query sits at position lengths[b] - 1 and sees keys at positions < lengths[b] (and,
    with sliding_window, > position - sliding_window). scale defaults to D ** -0.5; soft_cap
    applies soft_cap * tanh(logits / soft_cap). impl: None (Pallas on GPU, the jnp reference
    elsewhere), 'pallas', 'pallas_interpret' (the Pallas kernel interpreted, for CPU tests) or
    'reference'. config overrides the tuning heuristic `decode_config`.
    Returns [B, H, D] in q's dtype.
    """
    name = "paged_attention"
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [batch, heads, head_dim], got {q.shape}")
    batch, num_heads, head_dim = q.shape
    tiles.check_pages(name, q.dtype, num_heads, head_dim, k_pages, v_pages, k_scales, v_scales)
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(f"{name}: block_tables {block_tables.shape} must be [{batch}, W>=1] "
                         f"for q {q.shape}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name}: lengths {lengths.shape} must be ({batch},) for q {q.shape}")
    if block_tables.dtype != jnp.int32 or lengths.dtype != jnp.int32:
        raise ValueError(f"{name}: block_tables ({block_tables.dtype}) and lengths "
                         f"({lengths.dtype}) must be int32")
    resolved, sm_scale = tiles.resolve_options(name, impl, q.shape, scale, soft_cap,
                                               sliding_window)
    if resolved == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, lengths,
                                         k_scales=k_scales, v_scales=v_scales, scale=sm_scale,
                                         soft_cap=soft_cap, sliding_window=sliding_window)
    if config is None:
        config = decode_config(batch, k_pages.shape[0], block_tables.shape[1] * k_pages.shape[2],
                               head_dim)
    return _paged_attention_pallas(q, k_pages, v_pages, block_tables, lengths, k_scales,
                                   v_scales, config=config, sm_scale=sm_scale,
                                   soft_cap=soft_cap, sliding_window=sliding_window,
                                   interpret=tiles.interpret_or_gpu(resolved))


def paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, k_scales=None,
                              v_scales=None, scale=None, soft_cap=None, sliding_window=None):
    """Plain-jnp decode attention: dequantize, gather the pages, mask, softmax (float32)."""
    if k_scales is not None:
        k_pages = dequantize_pages(k_pages, k_scales)
        v_pages = dequantize_pages(v_pages, v_scales)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    hi = jax.lax.Precision.HIGHEST
    k = k_pages[:, block_tables].reshape(num_kv_heads, batch, width * page_size, head_dim)
    v = v_pages[:, block_tables].reshape(num_kv_heads, batch, width * page_size, head_dim)
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    logits = jnp.einsum("bngd,nbkd->bngk", qg, k.astype(jnp.float32), precision=hi) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    key_pos = jnp.arange(width * page_size)  # [K]
    visible = key_pos[None, :] < lengths[:, None]  # [B, K]
    if sliding_window is not None:
        visible &= key_pos[None, :] >= lengths[:, None] - sliding_window
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    logits = jnp.where((lengths > 0)[:, None, None, None], logits, 0.0)  # padding rows
    probs = jax.nn.softmax(logits, axis=-1)  # [B, KVH, G, K]
    out = jnp.einsum("bngk,nbkd->bngd", probs, v.astype(jnp.float32), precision=hi)
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
