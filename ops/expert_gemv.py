"""The decode product of a mixture of experts as one Pallas Triton kernel: y[m] = x[m] @
w[expert[m]] for rows in any order, each with its expert, reading each row's expert weight once
from memory and never a gathered copy of it; bf16 experts, or INT8 / INT4 codes.

    expert_gemv               the kernel: x [M, K] bf16, expert int32 [M], w [E, K, N] bf16 or
                              codes with scales [E, G, N] -> [M, N]
    expert_rows_matmul        the dispatches: the kernel where KernelBackends.moe says so and
    expert_rows_coded_matmul  `kernel_refusal` finds nothing (`kernel_runs`), ops.moe_matmul's
                              rows_matmul / rows_coded_matmul otherwise

XLA's form of the same product (ops/moe_matmul.py `rows_matmul`, an einsum over w[expert])
may write the gathered weights [M, K, N] to memory before it multiplies, so that a decode step
moves about three times the bytes of the experts it touches. Here each program owns one row m, a
block of block_n output columns and one of `splits` slices of K: it loads expert[m] itself,
walks its K slice one [block_k, block_n] tile of w[expert[m]] at a time (the tile's rows are
contiguous block_n-column runs of the [K, N] layout), multiplies by the row's x in float32 and
adds into an accumulator that is summed over K once, at the end. At a decode step's few rows
(batch 1: M = k = 8 rows, qwen3-30b-a3b's N = 768) rows x column blocks are far fewer programs
than a GPU has SMs, so K is split until there are about TARGET_PROGRAMS of them; each split
writes a float32 partial [S, M, N] and jnp sums the splits (one small fusion), or the caller
takes the partials unsummed (`partials`): the MoE layer hands the gate-up product's partials to
the down product as GatedRows, whose kernel sums them and applies act(gate) * up as it loads
each x tile, and sums the down product's partials in its weighted combine, so that no kernel
runs between the two products or between the down product and the combine. One split writes
x's dtype directly.

Codes (quant/qtensor.py's layouts with a leading expert axis, as ops/moe_matmul.py reads them):
INT8 uint8 [E, K, N]; INT4 int32 [E, K/8, N], K row 8w + j in bits 4j..4j+3 of word w (a tile
is block_k / 8 rows of words, each word's eight codes multiplying x at 8w + j); scales (and
offsets) [E, G, N] in groups of group_size K rows, each group whole K tiles. Each code becomes
the exact float32 c - zero (ops.quant_tiles._dequant_tile: a mask, an OR and a subtraction),
then scale (c - zero), or scale c + offset when asymmetric, with the tile's group's scales.

Rows are computed apart: two rows with the same expert each read it (as the gathered form
does), which stays within the rows' experts' bytes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention_tiles as tiles
from ops.kernel_choice import KernelBackends, choose_impl, or_reference
from ops.matmul import code_bits
from ops.moe_matmul import (ACTIVATIONS, CODE_ZEROS, INT4_PER_WORD, GatedRows, IndexedRows,
                            as_partials, input_rows, rows_coded_matmul, rows_matmul)
from ops.quant_tiles import _dequant_tile

TARGET_PROGRAMS = 528  # four programs per SM of an H100 / H200 (132 SMs), resident at once
BLOCK_NS = (128, 64, 32, 16)  # output columns per program, the largest that divides N
# K rows per tile by bits per weight, the largest that divides K (and the groups of codes):
# about 8 KiB of weights per [block_k, 128] tile
BLOCK_KS = {16: (32, 16), 8: (64, 32, 16), 4: (128, 64, 32, 16)}
MAX_ELEMENTS = 2 ** 31  # stored expert elements: the kernel's element offsets are int32
# A step with more (token, expert) pairs than experts sorts them by expert and takes the
# grouped kernel (ops/expert_gemm.py); where that one refuses the operands (INT4 groups under
# 128 K rows, say), this kernel takes the sorted rows while there are at most this many per
# expert on average: rows of one expert sit side by side in the grid, so their programs read
# the same tile at once and DRAM serves it once. Beyond that, ops/moe_matmul.py's tiles form.
MAX_ROWS_PER_EXPERT = 4


@dataclasses.dataclass(frozen=True)
class ExpertGemvConfig:
    """Tiles: block_n output columns per program, block_k K rows per loop step, `splits` slices
    of K (None: enough for about target_programs programs, `default_splits`); prefetch: each
    loop step issues the next tile's loads before its own math."""
    block_n: int = 128
    block_k: int = 32
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = True
    target_programs: int = TARGET_PROGRAMS


def expert_gemv_config(k: int, n: int, bits: int = 16,
                       group_size: int | None = None) -> ExpertGemvConfig | None:
    """The default tiles for K x N experts of `bits` per weight (16, 8, 4): the largest block_n
    of BLOCK_NS dividing N and block_k of BLOCK_KS[bits] dividing K and group_size (codes in
    groups; None: per channel), None when none does."""
    block_n = next((b for b in BLOCK_NS if n % b == 0), None)
    block_k = next((b for b in BLOCK_KS[bits] if k % b == 0
                    and (group_size is None or group_size >= k or group_size % b == 0)), None)
    if block_n is None or block_k is None:
        return None
    return ExpertGemvConfig(block_n=block_n, block_k=block_k)


def default_splits(m: int, column_blocks: int, k_tiles: int,
                   target_programs: int = TARGET_PROGRAMS) -> int:
    """K splits for m rows of column_blocks blocks: the fewest that divide the k_tiles tiles
    evenly and make at least target_programs programs (all k_tiles if none does)."""
    for splits in range(1, k_tiles + 1):
        if k_tiles % splits == 0 and m * column_blocks * splits >= target_programs:
            return splits
    return k_tiles


def _check(x, w, expert, scales=None, offsets=None, group_size: int | None = None) -> int:
    """ValueError naming the operand whose shape does not fit; returns the bits per weight
    (16: bf16 or other float values, 8: uint8 codes, 4: int32 words of eight codes). x: rows
    [M, K], IndexedRows or GatedRows."""
    if isinstance(x, IndexedRows):
        if x.x.ndim != 2 or x.index.ndim != 1 or not jnp.issubdtype(x.index.dtype, jnp.integer):
            raise ValueError(f"expert_gemv: indexed rows need x [T, K] and integer indices "
                             f"[M], not {x.x.shape} and {x.index.shape} {x.index.dtype}")
        x = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if isinstance(x, GatedRows):
        p = x.partials
        if p.ndim != 3 or p.shape[2] % 2 or p.dtype != jnp.float32 or x.act not in ACTIVATIONS:
            raise ValueError(f"expert_gemv: gated rows need float32 partials [S, M, 2 K], not "
                             f"{p.shape} {p.dtype}, and an activation of {list(ACTIVATIONS)}, "
                             f"not {x.act!r}")
        x = jax.ShapeDtypeStruct(x.shape, x.dtype)
    bits = (code_bits(w) or 16) if scales is not None else 16
    rows_k = w.shape[1] * (INT4_PER_WORD if bits == 4 else 1) if w.ndim == 3 else None
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != rows_k:
        layout = "INT4 words [E, K/8, N]" if bits == 4 else "[E, K, N]"
        raise ValueError(f"expert_gemv: x {x.shape} must be [M, K] against experts {layout} "
                         f"{w.shape}")
    if expert.shape != (x.shape[0],) or not jnp.issubdtype(expert.dtype, jnp.integer):
        raise ValueError(f"expert_gemv: expert ids {expert.shape} {expert.dtype} must be "
                         f"integers [M] = [{x.shape[0]}] (one expert per row of x)")
    if scales is None:
        if offsets is not None:
            raise ValueError("expert_gemv: offsets without scales (offsets are for codes)")
        return bits
    if bits == 16:
        raise ValueError(f"expert_gemv: with scales, the experts hold uint8 (INT8) or int32 "
                         f"(INT4) codes, not {w.dtype}")
    e, n = w.shape[0], w.shape[2]
    if (scales.ndim != 3 or scales.shape[::2] != (e, n)
            or (offsets is not None and offsets.shape != scales.shape)):
        raise ValueError(f"expert_gemv: scales {scales.shape} and offsets "
                         f"{None if offsets is None else offsets.shape} must be [E, G, N] = "
                         f"[{e}, G, {n}] against codes {w.shape}")
    k, g = x.shape[1], scales.shape[1]
    if g > 1 and (not group_size or -(-k // group_size) != g):
        raise ValueError(f"expert_gemv: {g} groups of {group_size} K rows do not cover K={k}")
    return bits


def group_rows(k: int, scales, group_size: int | None) -> int:
    """K rows per group of scales [E, G, N]: K when G = 1 (per channel), else group_size."""
    return k if scales is None or scales.shape[1] == 1 else group_size


def kernel_refusal(x, w, expert, config: ExpertGemvConfig | None = None, scales=None,
                   offsets=None, group_size: int | None = None) -> str | None:
    """Why the kernel cannot take operands that pass the shape check (None: it can); the one
    rule of what it takes: bf16 x; bf16 experts, or codes whose groups are whole K tiles; K and
    N whole tiles of the config (default tiles: N a multiple of 16, K of 16); fewer than
    MAX_ELEMENTS stored expert elements. Raises ValueError for shapes that do not fit."""
    bits = _check(x, w, expert, scales, offsets, group_size)
    n = w.shape[2]
    k = x.shape[1]
    group = group_rows(k, scales, group_size)
    cfg = config or expert_gemv_config(k, n, bits, group)
    if x.dtype != jnp.bfloat16 or (bits == 16 and w.dtype != jnp.bfloat16):
        return f"expert_gemv: the kernel takes bf16 x and experts, not {x.dtype} and {w.dtype}"
    if cfg is None or k % cfg.block_k or n % cfg.block_n or cfg.block_k % INT4_PER_WORD:
        blocks = "" if cfg is None else f" ({cfg.block_k} x {cfg.block_n})"
        return f"expert_gemv: experts {w.shape} are not whole tiles{blocks} of K x N"
    if bits != 16 and group < k and group % cfg.block_k:
        return (f"expert_gemv: groups of {group} K rows are not whole tiles of "
                f"{cfg.block_k}")
    if w.size >= MAX_ELEMENTS:
        return f"expert_gemv: experts {w.shape} hold more than 2^31 elements"
    return None


def kernel_runs(x, w, expert, kernels: KernelBackends | None, scales=None, offsets=None,
                group_size: int | None = None) -> bool:
    """Whether expert_rows_matmul / expert_rows_coded_matmul run the kernel (not the gathered
    reference) for these operands: `kernels` choose it and `kernel_refusal` finds nothing."""
    return (or_reference(kernels).moe != "reference"
            and kernel_refusal(x, w, expert, None, scales, offsets, group_size) is None)


def code_refs(refs, bits: int, asymmetric: bool):
    """(scales ref or None, offsets ref or None, out ref) of an expert kernel's refs after the
    weights: the scales for codes (bits 8 or 4), the offsets when asymmetric, then the output."""
    refs = list(refs)
    s_ref = refs.pop(0) if bits != 16 else None
    o_ref = refs.pop(0) if asymmetric else None
    return s_ref, o_ref, refs[0]


def _load(view, ok):
    """view's values, those where ok is False read as 0 (ok None: all are read)."""
    return plgpu.load(view) if ok is None else plgpu.load(view, mask=ok, other=0)


def _kernel(expert_ref, index_ref, x_ref, w_ref, *refs, num_experts: int, num_groups: int,
            k_tiles: int, per_split: int, block_n: int, block_k: int, prefetch: bool, bits: int,
            group_size: int, asymmetric: bool, act: str | None, x_dtype):
    # expert_ref, index_ref [M] int32 (each row's expert; the row of x it reads); x_ref [T, K],
    # or with `act` a gate-up product's float32 partials [S', M, 2 K] (GatedRows); w_ref
    # [E, K/P, N] (P = 8 K rows per INT4 word, else 1); refs: (s_ref [E, G, N], (o_ref
    # [E, G, N])) for codes, then out_ref [S, M, N]
    codes = bits != 16
    s_ref, o_ref, out_ref = code_refs(refs, bits, asymmetric)
    per_word = INT4_PER_WORD if bits == 4 else 1
    block_r = block_k // per_word  # stored rows of w per tile
    row, nb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = jnp.clip(plgpu.load(expert_ref.at[row]), 0, num_experts - 1)
    x_row = plgpu.load(index_ref.at[row])
    cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
    first = split * per_split
    last = jnp.minimum(first + per_split, k_tiles)

    def summed(ks, ok):  # float32 [BR]: the S partials' sum at K indices ks, one 2-D load
        parts = x_ref.shape[0]
        p_ids = jnp.arange(tiles.next_pow2(parts), dtype=jnp.int32)  # S padded to 2^n
        mask = (p_ids < parts)[:, None] if ok is None else (p_ids < parts)[:, None] & ok[None]
        mask = jnp.broadcast_to(mask, (p_ids.shape[0], ks.shape[0]))
        views = x_ref.at[jnp.minimum(p_ids, parts - 1)[:, None], row, ks[None, :]]
        return jnp.sum(plgpu.load(views, mask=mask, other=0), axis=0)

    def load_x(ks, ok):  # float32 [BR] of the row's x at K indices ks (masked: 0)
        if act is None:
            return _load(x_ref.at[x_row, ks], ok).astype(jnp.float32)
        gate, up = summed(ks, ok), summed(x_ref.shape[2] // 2 + ks, ok)
        # GatedRows.rows' numerics: float32 sums and activation, rounded once
        return (ACTIVATIONS[act](gate) * up).astype(x_dtype).astype(jnp.float32)

    def load_tile(t):  # K tile t: (x [BR] per K row of a stored row, w[expert] [BR, BN],
        # the tile's group's scales and offsets [BN] or None); with prefetch, tiles past the
        # split's last read nothing (masked)
        rs = t * block_r + jnp.arange(block_r, dtype=jnp.int32)  # [BR] stored rows
        ok = rs < last * block_r if prefetch else None
        xs = tuple(load_x(per_word * rs + j, ok) for j in range(per_word))
        tile_ok = None if ok is None else jnp.broadcast_to(ok[:, None], (block_r, block_n))
        w = _load(w_ref.at[expert, rs[:, None], cols[None, :]], tile_ok)
        if not codes:
            return xs, w, None, None
        group = jnp.minimum(t * block_k // group_size, num_groups - 1)
        scale = plgpu.load(s_ref.at[expert, group, cols]).astype(jnp.float32)
        offset = (plgpu.load(o_ref.at[expert, group, cols]).astype(jnp.float32)
                  if asymmetric else None)
        return xs, w, scale, offset

    def body(t, carry):  # carry: (the prefetched tile or None, acc [BR, BN] float32)
        tile, acc = carry
        if prefetch:  # the next tile's loads issued before this tile's math
            nxt = load_tile(t + 1)
        else:
            tile, nxt = load_tile(t), None
        xs, w, scale, offset = tile
        if codes:  # exact float32 c - zero per K row of a word, then scale (c - zero) or
            # scale c + offset
            zero = 0 if asymmetric else CODE_ZEROS[bits]
            word = w.astype(jnp.int32)
            values = [_dequant_tile(word, j, zero, bits) * scale[None, :] for j in
                      range(per_word)]
            if asymmetric:
                values = [v + offset[None, :] for v in values]
        else:
            values = [w.astype(jnp.float32)]
        for xj, v in zip(xs, values):
            acc = acc + xj[:, None] * v
        return nxt, acc

    init = (load_tile(first) if prefetch else None,
            jnp.zeros((block_r, block_n), jnp.float32))
    _, acc = jax.lax.fori_loop(first, last, body, init)
    plgpu.store(out_ref.at[split, row, cols], jnp.sum(acc, axis=0).astype(out_ref.dtype))


# jitted: the unrolled layers share one trace and one lowering per shape (ARCHITECTURE.md
# "Kernel calls")
@functools.partial(jax.jit, static_argnames=("group_size", "config", "partials", "interpret"))
def expert_gemv(x, w, expert, *, scales=None, offsets=None, group_size: int | None = None,
                config: ExpertGemvConfig | None = None, partials: bool = False,
                interpret: bool = False):
    """The kernel: x [M, K] @ w[expert[m]] per row -> [M, N] in x's dtype, float32 sums. x bf16
    rows, IndexedRows (read in place; its indices must be valid rows), or GatedRows (bf16)
    whose partials the kernel sums and activates as it loads them; w bf16 [E, K, N], or codes
    with their scales [E, G, N] (quant/qtensor.py's values per expert: scale (c - zero), or
    scale c + offset with offsets [E, G, N]): INT8 uint8
    [E, K, N] or INT4 int32 words [E, K/8, N], in groups of group_size K rows (G = 1: per
    channel); expert int32 [M] (ids outside [0, E) are clamped into it). partials: return the
    K splits' float32 sums [S, M, N] unsummed, for a consumer that sums them itself (a
    GatedRows, a weighted combine). Raises ValueError for shapes that do not fit or operands
    the kernel does not take (`kernel_refusal`)."""
    refusal = kernel_refusal(x, w, expert, config, scales, offsets, group_size)
    if refusal:
        raise ValueError(refusal)
    bits = _check(x, w, expert, scales, offsets, group_size)
    m, k = x.shape
    e, _, n = w.shape
    group = group_rows(k, scales, group_size)
    cfg = config or expert_gemv_config(k, n, bits, group)
    k_tiles, column_blocks = k // cfg.block_k, n // cfg.block_n
    splits = min(cfg.splits or default_splits(m, column_blocks, k_tiles, cfg.target_programs),
                 k_tiles)
    per_split = -(-k_tiles // splits)
    splits = -(-k_tiles // per_split)  # no empty split
    out_dtype = x.dtype if splits == 1 and not partials else jnp.float32
    gated = isinstance(x, GatedRows)
    indexed = isinstance(x, IndexedRows)
    index = x.index.astype(jnp.int32) if indexed else jnp.arange(m, dtype=jnp.int32)
    source = x.partials if gated else x.x if indexed else x
    kernel = functools.partial(
        _kernel, num_experts=e, num_groups=1 if scales is None else scales.shape[1],
        k_tiles=k_tiles, per_split=per_split, block_n=cfg.block_n, block_k=cfg.block_k,
        prefetch=cfg.prefetch, bits=bits, group_size=group,
        asymmetric=offsets is not None, act=x.act if gated else None, x_dtype=x.dtype)
    args = [expert.astype(jnp.int32), index, source, w] + [
        a for a in (scales, offsets) if a is not None]
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel, grid=(m, column_blocks, splits), in_specs=[full(a.shape) for a in args],
        out_specs=full((splits, m, n)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret, name={16: "expert_gemv", 8: "expert_gemv8", 4: "expert_gemv4"}[bits],
    )(*args)
    if partials:
        return out
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)


def expert_rows_matmul(x, w, expert, *, kernels: KernelBackends | None = None,
                       impl: str | None = None, config: ExpertGemvConfig | None = None,
                       partials: bool = False):
    """ops.moe_matmul.rows_matmul's function (x [M, K], IndexedRows or GatedRows @ w[expert[m]]
    per row -> [M, N], or with `partials` float32 [S, M, N] to be summed), dispatched. impl None:
    kernels.moe where `kernel_refusal` finds nothing, the reference (rows_matmul) otherwise
    (kernels None: the reference); or 'pallas', 'pallas_interpret' (CPU tests), 'reference'."""
    if impl is None:
        fits = kernel_refusal(x, w, expert, config) is None
        impl = or_reference(kernels).moe if fits else "reference"
    impl = choose_impl("expert_rows_matmul", impl, "reference")
    if impl == "reference":
        return as_partials(rows_matmul(input_rows(x), w, expert), partials)
    return expert_gemv(x, w, expert, config=config, partials=partials,
                       interpret=impl == "pallas_interpret")


def expert_rows_coded_matmul(x, packed, scales, offsets, expert, *, bits: int, group_size: int,
                             kernels: KernelBackends | None = None, impl: str | None = None,
                             config: ExpertGemvConfig | None = None, partials: bool = False):
    """ops.moe_matmul.rows_coded_matmul's function (x [M, K], IndexedRows or GatedRows @ the
    codes of expert[m] per row -> [M, N]; packed INT8 uint8 [E, K, N] or INT4 int32
    [E, K/8, N], scales (offsets) [E, G, N]), dispatched as expert_rows_matmul is."""
    if code_bits(packed) != bits:
        raise ValueError(f"expert_rows_coded_matmul: codes {packed.dtype} are not {bits}-bit "
                         "(INT8 uint8, INT4 int32 words)")
    kw = dict(scales=scales, offsets=offsets, group_size=group_size)
    if impl is None:
        fits = kernel_refusal(x, packed, expert, config, **kw) is None
        impl = or_reference(kernels).moe if fits else "reference"
    impl = choose_impl("expert_rows_coded_matmul", impl, "reference")
    if impl == "reference":
        y = rows_coded_matmul(input_rows(x), packed, scales, offsets, expert, bits=bits,
                              group_size=group_size)
        return as_partials(y, partials)
    return expert_gemv(x, packed, expert, config=config, partials=partials,
                       interpret=impl == "pallas_interpret", **kw)
