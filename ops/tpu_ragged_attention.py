"""Ragged paged attention for TPU: a Pallas Mosaic TPU kernel with double-buffered page DMAs.

Same contract as ops/ragged_attention.py (one flat batch of query tokens from many sequences:
prefill chunks, decodes and verification tokens; causal over each sequence's cached pages; GQA,
sliding window, soft cap; float, int8 or fp8 pages with per-token scales). The cache layout is
the engine's, [KVH, P, S, D] per layer: one (kv head, page) is a contiguous [S, D] tile, so each
page of a key block is one DMA whose rows land in the block's VMEM buffer (as jax's TPU paged
attention reads it), and the cache splits over kv heads on a mesh unchanged. head_dim should be
a multiple of 128 (the lane width) on hardware; the test models' smaller head_dims run in
interpret mode.

Kernel: a program handles one kv head and one q block (`block_q` tokens of one sequence, never
two: row r of its [block_q * G, D] tile is token r // G, query head r % G of the kv head's
group, so the group shares every key load). The q blocks are enumerated in jnp before the call
in increasing token order (at most cdiv(N, block_q) + S of them, a static bound) and passed as
scalar prefetch (SMEM). The program DMAs its query rows and its sequence's block-table row (into
SMEM: the whole table of a long-context batch would not fit there), then walks the
sequence's keys `pages_per_block` pages at a time: while it computes block b (online softmax in
float32) the DMAs of block b + 1 run into the other half of the double buffer. The output tile
is DMAed to the rows of its tokens; a tile's rows past its tokens belong to the next q block,
which is written later (the q-block axis runs in order), and rows of no sequence are zeroed
after the call. Block sizes come from ops/tpu_attention_tiles.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ops import attention_tiles as tiles
from ops.tpu_attention_tiles import TpuAttentionBlocks, tpu_attention_blocks

MASKED = -1e30  # logit of a masked key: finite, so a row with no visible key yet stays NaN-free
META = 5  # per q block: sequence, first flat token, tokens, first position, keys needed


def _kernel(meta_ref, tables_hbm, q_hbm, k_hbm, v_hbm, *refs, group: int, block_q: int,
            pages_per_block: int, page_size: int, num_pages: int, table_width: int,
            sm_scale: float, soft_cap: float | None, sliding_window: int | None,
            quantized: bool):
    # meta_ref:   [NB * 5] int32 (SMEM), per q block (sequence, first token, tokens, position
    #             of the first token, keys needed = position of its last token + 1)
    # tables_hbm: [S, W] int32 (HBM), the block tables; this program's row goes to SMEM
    # q_hbm:      [KVH, (N + block_q) * G, D], row t * G + g = token t, head g of the group
    # k_hbm, v_hbm: [KVH, P, S, D] pages (HBM)
    # refs: (ks_hbm, vs_hbm [KVH, P, 1, S] f32 when quantized), then
    #   o_hbm [KVH, (N + block_q) * G, D] (output, HBM),
    #   table [W] int32 SMEM (the sequence's block table), q_buf, o_buf [M, D] VMEM
    #   (M = block_q * G); k_buf, v_buf [2, BK, D] VMEM (BK = pages_per_block * S);
    #   (ks_buf, vs_buf [2, 1, BK] f32 VMEM when quantized);
    #   sems: DMA semaphores [5, 2] (q / out / table, k, v, k scales, v scales) x buffer slot
    if quantized:
        ks_hbm, vs_hbm, o_hbm, table, q_buf, o_buf, k_buf, v_buf, ks_buf, vs_buf, sems = refs
    else:
        o_hbm, table, q_buf, o_buf, k_buf, v_buf, sems = refs
        ks_hbm = vs_hbm = ks_buf = vs_buf = None
    h, i = pl.program_id(0), pl.program_id(1)
    seq, q_start, q_count, q_pos0, kv_end = (meta_ref[i * META + f] for f in range(META))
    rows = block_q * group
    block_k = pages_per_block * page_size

    @pl.when(q_count > 0)
    def _():
        q_copy = pltpu.make_async_copy(q_hbm.at[h, pl.ds(q_start * group, rows)], q_buf,
                                       sems.at[0, 0])
        q_copy.start()
        table_copy = pltpu.make_async_copy(tables_hbm.at[seq], table, sems.at[0, 1])
        table_copy.start()
        lo = 0
        if sliding_window is not None:  # the first token sees keys > q_pos0 - window
            lo = jnp.maximum(q_pos0 - sliding_window + 1, 0)
        first_page = lo // page_size
        last_page = (kv_end - 1) // page_size  # the sequence's last page this block needs
        num_blocks = pl.cdiv(last_page - first_page + 1, pages_per_block)

        def page_copies(b, slot):  # the DMAs of key block b into buffer slot
            copies = []
            for j in range(pages_per_block):
                logical = jnp.minimum(first_page + b * pages_per_block + j, last_page)
                page = jnp.clip(table[logical], 0, num_pages - 1)
                dst = pl.ds(j * page_size, page_size)
                copies.append(pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, dst],
                                                    sems.at[1, slot]))
                copies.append(pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, dst],
                                                    sems.at[2, slot]))
                if quantized:
                    copies.append(pltpu.make_async_copy(
                        ks_hbm.at[h, page], ks_buf.at[slot, :, dst], sems.at[3, slot]))
                    copies.append(pltpu.make_async_copy(
                        vs_hbm.at[h, page], vs_buf.at[slot, :, dst], sems.at[4, slot]))
            return copies

        table_copy.wait()
        for copy in page_copies(0, 0):
            copy.start()
        q_copy.wait()
        q = q_buf[...]  # [M, D]
        token = jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) // group
        q_pos = q_pos0 + token  # [M, BK] each row's query position
        key_offset = jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)  # [M, BK]

        def body(b, carry):
            m_prev, l_prev, acc = carry  # [M, 1], [M, 1], [M, D] float32
            slot = b % 2

            @pl.when(b + 1 < num_blocks)
            def _():
                for copy in page_copies(b + 1, 1 - slot):
                    copy.start()

            for copy in page_copies(b, slot):
                copy.wait()
            k = k_buf[slot].astype(q.dtype)  # [BK, D]
            v = v_buf[slot].astype(q.dtype)  # [BK, D]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * sm_scale  # [M, BK]
            if quantized:
                s = s * ks_buf[slot]  # [1, BK] key scales along the keys
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            k_pos = (first_page + b * pages_per_block) * page_size + key_offset  # [M, BK]
            visible = k_pos <= q_pos  # causal; also k_pos < kv_end, for q_pos < kv_end
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            s = jnp.where(visible, s, MASKED)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [M, 1]
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)  # [M, BK]
            alpha = jnp.exp(m_prev - m_new)  # [M, 1]
            l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            if quantized:
                p = p * vs_buf[slot]  # [1, BK] value scales along the keys
            pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [M, D]
            return m_new, l_new, alpha * acc + pv

        head_dim = q.shape[-1]
        init = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                jnp.zeros((rows, head_dim), jnp.float32))
        _, l_sum, acc = jax.lax.fori_loop(0, num_blocks, body, init)
        o_buf[...] = (acc / jnp.where(l_sum > 0, l_sum, 1.0)).astype(o_buf.dtype)
        out_copy = pltpu.make_async_copy(o_buf, o_hbm.at[h, pl.ds(q_start * group, rows)],
                                         sems.at[0, 1])
        out_copy.start()
        out_copy.wait()  # the next q block may overwrite this tile's trailing rows


def interpret_params(interpret) -> pltpu.InterpretParams | bool:
    """pallas_call's `interpret` for a kernel's interpret argument: True -> TPU interpret mode
    with default parameters, False -> compiled, or the given pltpu.InterpretParams (e.g. the
    race detector)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False


def q_blocks(query_start_loc: jax.Array, kv_lens: jax.Array, block_q: int,
             num_blocks: int) -> jax.Array:
    """[num_blocks * 5] int32: the q blocks of every sequence in increasing token order (see
    _kernel); blocks past the real ones have no tokens."""
    num_seqs = kv_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    per_seq = pl.cdiv(q_lens, block_q)  # [S]
    ends = jnp.cumsum(per_seq)  # [S] inclusive
    i = jnp.arange(num_blocks, dtype=jnp.int32)  # [NB]
    seq = jnp.sum(ends[None, :] <= i[:, None], axis=1).astype(jnp.int32)  # [NB] in [0, S]
    real = seq < num_seqs
    s = jnp.minimum(seq, num_seqs - 1)
    tok0 = (i - (ends[s] - per_seq[s])) * block_q  # first token within the sequence
    q_start = jnp.where(real, query_start_loc[s] + tok0, 0)
    q_count = jnp.where(real, jnp.minimum(q_lens[s] - tok0, block_q), 0)
    q_pos0 = jnp.where(real, kv_lens[s] - q_lens[s] + tok0, 0)
    kv_end = jnp.where(real, q_pos0 + q_count, 0)
    return jnp.stack([s, q_start, q_count, q_pos0, kv_end], axis=1).astype(jnp.int32).reshape(-1)


@functools.partial(jax.jit, static_argnames=("blocks", "sm_scale", "soft_cap", "sliding_window",
                                             "interpret"))
def _tpu_ragged_attention(q, k_pages, v_pages, block_tables, query_start_loc, kv_lens,
                          k_scales, v_scales, *, blocks: TpuAttentionBlocks, sm_scale: float,
                          soft_cap, sliding_window, interpret: bool):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, table_width = block_tables.shape
    group = num_heads // num_kv_heads
    block_q, pages_per_block = blocks.block_q, blocks.pages_per_block
    rows, block_k = block_q * group, pages_per_block * page_size
    num_q_blocks = pl.cdiv(num_tokens, block_q) + num_seqs
    quantized = k_scales is not None

    meta = q_blocks(query_start_loc, kv_lens, block_q, num_q_blocks)
    # [N, H, D] -> [KVH, (N + block_q) * G, D]: a q block's rows are contiguous per kv head,
    # with room for the last block's full tile.
    qt = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qt = jnp.pad(qt, ((0, 0), (0, block_q), (0, 0), (0, 0)))
    qt = qt.reshape(num_kv_heads, (num_tokens + block_q) * group, head_dim)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    args = [block_tables, qt, k_pages, v_pages]
    scratch = [pltpu.SMEM((table_width,), jnp.int32), pltpu.VMEM((rows, head_dim), q.dtype),
               pltpu.VMEM((rows, head_dim), q.dtype),
               pltpu.VMEM((2, block_k, head_dim), k_pages.dtype),
               pltpu.VMEM((2, block_k, head_dim), v_pages.dtype)]
    if quantized:  # [KVH, P, S] -> [KVH, P, 1, S]: a page's scales are one row of lanes
        args += [k_scales.reshape(num_kv_heads, num_pages, 1, page_size),
                 v_scales.reshape(num_kv_heads, num_pages, 1, page_size)]
        scratch += [pltpu.VMEM((2, 1, block_k), jnp.float32)] * 2
    scratch.append(pltpu.SemaphoreType.DMA((5, 2)))
    kernel = functools.partial(
        _kernel, group=group, block_q=block_q, pages_per_block=pages_per_block,
        page_size=page_size, num_pages=num_pages, table_width=table_width, sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(num_kv_heads, num_q_blocks),
            in_specs=[any_spec] * len(args), out_specs=any_spec, scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret_params(interpret),
        name="tpu_ragged_paged_attention",
    )(meta, *args)
    out = out[:, :num_tokens * group].reshape(num_kv_heads, num_tokens, group, head_dim)
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)
    in_a_sequence = jnp.arange(num_tokens) < query_start_loc[-1]  # [N]
    return jnp.where(in_a_sequence[:, None, None], out, 0).astype(q.dtype)


def tpu_ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               block_tables: jax.Array, query_start_loc: jax.Array,
                               kv_lens: jax.Array, *, max_q_len: int,
                               k_scales: jax.Array | None = None,
                               v_scales: jax.Array | None = None, scale: float | None = None,
                               soft_cap: float | None = None,
                               sliding_window: int | None = None, generation: str = "default",
                               blocks: TpuAttentionBlocks | None = None,
                               interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Causal attention of a flat, ragged batch of query tokens over their sequences' pages, as
    a Pallas TPU kernel (interpret=True: TPU interpret mode, on any backend).

    Arguments and result as ops.ragged_attention.ragged_paged_attention (q [N, H, D]; pages
    [KVH, P, S, D], with k_scales / v_scales [KVH, P, S] float32 for int8 / fp8 pages;
    block_tables int32 [S, W]; query_start_loc int32 [S + 1]; kv_lens int32 [S]; rows of no
    sequence are 0). generation: a key of ops.tpu_attention_tiles.KEYS_PER_BLOCK ("v5e",
    "v6e", "default"); blocks overrides its table. interpret: True, or pltpu.InterpretParams
    for the interpreter's options (race detection, several cores).
    """
    name = "tpu_ragged_paged_attention"
    tiles.check_ragged_inputs(name, q, k_pages, v_pages, k_scales, v_scales, block_tables,
                              query_start_loc, kv_lens, max_q_len)
    num_tokens, num_heads, head_dim = q.shape
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{name}: sliding_window must be None or >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"{name}: soft_cap must be None or > 0, got {soft_cap}")
    if blocks is None:
        blocks = tpu_attention_blocks(generation, min(max_q_len, num_tokens),
                                      num_heads // k_pages.shape[0], k_pages.shape[2],
                                      block_tables.shape[1])
    sm_scale = head_dim ** -0.5 if scale is None else float(scale)
    return _tpu_ragged_attention(
        q, k_pages, v_pages, block_tables, query_start_loc, kv_lens, k_scales, v_scales,
        blocks=blocks, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        interpret=interpret)

