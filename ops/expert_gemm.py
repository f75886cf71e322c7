"""A mixture's grouped expert product over rows sorted by expert as one Pallas Triton kernel:
each program owns one chunk of up to 64 rows of one expert's run and one block of output
columns, reads that expert's tiles and multiplies the chunk's rows by them on the tensor cores;
bf16 experts, or INT8 / INT4 codes.

    expert_group_matmul       the kernel: x [M, K] bf16 (or IndexedRows, GatedRows) sorted by
                              expert, group_sizes int32 [E], w [E, K, N] bf16 or codes with
                              scales [E, G, N] -> [M, N], or float32 partials [1, M, N]
    grouped_rows_matmul       the dispatches: the kernel where KernelBackends.moe says so and
    grouped_rows_coded_matmul `kernel_refusal` finds nothing, ops.moe_matmul's grouped forms
                              otherwise

A batched decode step has a few (token, expert) pairs per expert: batch 64 of qwen3-30b-a3b
is 512 pairs over 128 experts. The one-row kernel (ops/expert_gemv.py) reads an expert once
per row, and XLA's tiles form writes each tile's dequantized expert to memory before its
product. Here the grid's slots number the chunks of `block_m` rows of every expert's run in
turn (at most ceil(M / block_m) + E of them), so a long run, such as a prompt crowded onto a
few experts, spreads over as many programs as it has chunks. The program of (chunk, column
block) walks the K tiles of its expert w[e]: one [block_k, block_n] tile loaded, its codes
turned into exact bf16 values (c - zero, integers), a bf16 dot of the chunk's rows
[block_m, block_k] by it in float32, scaled per group after the dot (scale (x . (c - zero)),
or scale (x . c) + offset sum(x) when asymmetric) as ops.moe_matmul.rows_coded_matmul does.
Chunks of the rows past the groups' sum (pairs of experts another shard holds) write zeros;
slots past the last chunk do nothing.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention_tiles as tiles
from ops.expert_gemv import code_refs, group_rows
from ops.kernel_choice import KernelBackends, choose_impl, or_reference
from ops.matmul import code_bits
from ops.moe_matmul import (ACTIVATIONS, CODE_ZEROS, INT4_PER_WORD, GatedRows, IndexedRows,
                            as_partials, grouped_coded_matmul, grouped_matmul, input_rows)
from ops.quant_tiles import _dequant_tile

BLOCK_NS = (128, 64, 32, 16)  # output columns per program, the largest that divides N
# K rows per tile by bits per weight, the largest that divides K (and the groups of codes);
# a dot's K is block_k / (codes per stored element), at least 16
BLOCK_KS = {16: (64, 32, 16), 8: (64, 32, 16), 4: (128,)}
BLOCK_MS = (16, 32, 64)  # rows per chunk: the smallest that holds the average run
# sorted rows the kernel takes: steps of up to 8192 tokens at k = 8, prefill included (XLA's
# tiles form gathers a copy of an expert per tile of 64 rows, and reads it back)
MAX_ROWS = 65536
MAX_ELEMENTS = 2 ** 31  # stored expert elements: the kernel's element offsets are int32


@dataclasses.dataclass(frozen=True)
class ExpertGemmConfig:
    """Tiles: block_m rows per chunk, block_n output columns per program, block_k K rows per
    loop step."""
    block_m: int = 16
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def expert_gemm_config(m: int, num_experts: int, k: int, n: int, bits: int = 16,
                       group_size: int | None = None) -> ExpertGemmConfig | None:
    """The default tiles for m sorted rows over num_experts K x N experts of `bits` per weight
    (16, 8, 4); None when no block of BLOCK_NS divides N or of BLOCK_KS[bits] divides K and
    group_size (codes in groups; None: per channel)."""
    block_n = next((b for b in BLOCK_NS if n % b == 0), None)
    block_k = next((b for b in BLOCK_KS[bits] if k % b == 0
                    and (group_size is None or group_size >= k or group_size % b == 0)), None)
    if block_n is None or block_k is None:
        return None
    average = -(-m // max(num_experts, 1))
    block_m = next((b for b in BLOCK_MS if b >= average), BLOCK_MS[-1])
    return ExpertGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k)


def _bits(x, w, group_sizes, scales, offsets, group_size) -> int:
    """ValueError naming the operand whose shape does not fit; the bits per weight (16: float
    values, 8: uint8 codes, 4: int32 words of eight codes)."""
    if isinstance(x, GatedRows) and (x.partials.ndim != 3 or x.partials.shape[2] % 2
                                     or x.partials.dtype != jnp.float32
                                     or x.act not in ACTIVATIONS):
        raise ValueError(f"expert_group_matmul: gated rows need float32 partials [S, M, 2 K] "
                         f"and an activation of {list(ACTIVATIONS)}, not {x.partials.shape} "
                         f"{x.partials.dtype} and {x.act!r}")
    bits = (code_bits(w) or 16) if scales is not None else 16
    if scales is not None and bits == 16:
        raise ValueError(f"expert_group_matmul: with scales, the experts hold uint8 (INT8) or "
                         f"int32 (INT4) codes, not {w.dtype}")
    rows_k = w.shape[1] * (INT4_PER_WORD if bits == 4 else 1) if w.ndim == 3 else None
    if len(x.shape) != 2 or x.shape[1] != rows_k:
        raise ValueError(f"expert_group_matmul: x {x.shape} must be [M, K] against experts "
                         f"{w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"expert_group_matmul: group sizes {group_sizes.shape} "
                         f"{group_sizes.dtype} must be integers [E] = [{w.shape[0]}]")
    if scales is not None:
        k, g = x.shape[1], scales.shape[1]
        if (scales.ndim != 3 or scales.shape[::2] != (w.shape[0], w.shape[2])
                or (offsets is not None and offsets.shape != scales.shape)
                or (g > 1 and (not group_size or -(-k // group_size) != g))):
            raise ValueError(f"expert_group_matmul: scales {scales.shape} and offsets "
                             f"{None if offsets is None else offsets.shape} do not fit codes "
                             f"{w.shape} in groups of {group_size} K rows")
    return bits


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the kernel would run for some operands: bits per weight, K rows per group of
    scales, the tiles, and why it cannot (None: it can)."""
    bits: int
    group: int
    config: ExpertGemmConfig | None
    refusal: str | None


def _plan(x, w, group_sizes, config, scales, offsets, group_size) -> _Plan:
    bits = _bits(x, w, group_sizes, scales, offsets, group_size)
    m, k = x.shape
    e, _, n = w.shape
    group = group_rows(k, scales, group_size)
    cfg = config or expert_gemm_config(m, e, k, n, bits, group)
    refusal = None
    if x.dtype != jnp.bfloat16 or (bits == 16 and w.dtype != jnp.bfloat16):
        refusal = (f"expert_group_matmul: the kernel takes bf16 x and experts, not {x.dtype} "
                   f"and {w.dtype}")
    elif cfg is None or k % cfg.block_k or n % cfg.block_n:
        refusal = f"expert_group_matmul: experts {w.shape} are not whole tiles of K x N"
    elif bits != 16 and group < k and group % cfg.block_k:
        refusal = (f"expert_group_matmul: groups of {group} K rows are not whole tiles of "
                   f"{cfg.block_k}")
    elif m > MAX_ROWS:
        refusal = f"expert_group_matmul: {m} rows are more than the kernel's {MAX_ROWS}"
    elif w.size >= MAX_ELEMENTS:
        refusal = f"expert_group_matmul: experts {w.shape} hold more than 2^31 elements"
    return _Plan(bits, group, cfg, refusal)


def kernel_refusal(x, w, group_sizes, config: ExpertGemmConfig | None = None, scales=None,
                   offsets=None, group_size: int | None = None) -> str | None:
    """Why the kernel cannot take operands that pass the shape check (None: it can): bf16 x;
    bf16 experts, or codes whose groups are whole K tiles; K and N whole tiles; at most
    MAX_ROWS rows; fewer than MAX_ELEMENTS stored expert elements. Raises ValueError for shapes
    that do not fit."""
    return _plan(x, w, group_sizes, config, scales, offsets, group_size).refusal


def kernel_runs(x, w, group_sizes, kernels: KernelBackends | None, scales=None, offsets=None,
                group_size: int | None = None) -> bool:
    """Whether grouped_rows_matmul / grouped_rows_coded_matmul run the kernel for these
    operands: `kernels` choose it and `kernel_refusal` finds nothing."""
    return (or_reference(kernels).moe != "reference"
            and kernel_refusal(x, w, group_sizes, None, scales, offsets, group_size) is None)


def _chunk_of_slot(sizes_ref, slot, num_experts: int, rows: int, block_m: int):
    """(group, first sorted row, rows) of grid slot `slot`: slots number the chunks of up to
    block_m rows of expert 0's run, then of expert 1's, ..., then of the rows past the groups'
    sum (group E); a slot past the last chunk gets 0 rows. sizes_ref [E] int32 is read and
    summed in the program (a few hundred bytes), so nothing runs before the kernel."""
    ids = jnp.arange(max(16, tiles.next_pow2(num_experts + 1)), dtype=jnp.int32)  # [W]
    ok = ids < num_experts
    sizes = plgpu.load(sizes_ref.at[jnp.where(ok, ids, 0)], mask=ok, other=0)  # [W]
    sizes = jnp.where(ids == num_experts, rows - jnp.sum(sizes), sizes)  # group E: the tail
    chunks = (sizes + block_m - 1) // block_m  # [W]
    group = jnp.sum((jnp.cumsum(chunks) <= slot).astype(jnp.int32))  # > E past the last
    before = ids < group
    chunk = slot - jnp.sum(jnp.where(before, chunks, 0))  # the chunk's place in its run
    size = jnp.sum(jnp.where(ids == group, sizes, 0))
    first = jnp.sum(jnp.where(before, sizes, 0)) + chunk * block_m
    return group, first, jnp.clip(size - chunk * block_m, 0, block_m)


def _kernel(sizes_ref, index_ref, x_ref, w_ref, *refs, num_experts: int, num_groups: int,
            k_tiles: int, block_m: int, block_n: int, block_k: int, bits: int,
            group_size: int, asymmetric: bool, act: str | None, x_dtype):
    # sizes_ref [E] int32: each expert's run of sorted rows (then the rows past their sum);
    # index_ref [M] int32: the row of x each sorted row reads; x_ref
    # [T, K], or with `act` a gate-up product's float32 partials [S, M, 2 K] (GatedRows);
    # w_ref [E, K/P, N] (P = 8 K rows per INT4 word, else 1); refs: (s_ref [E, G, N],
    # (o_ref [E, G, N])) for codes, then out_ref [M, N]
    codes = bits != 16
    s_ref, o_ref, out_ref = code_refs(refs, bits, asymmetric)
    per_word = INT4_PER_WORD if bits == 4 else 1
    block_r = block_k // per_word  # stored rows of w per tile
    slot, nb = pl.program_id(0), pl.program_id(1)
    group, first, size = _chunk_of_slot(sizes_ref, slot, num_experts, out_ref.shape[0],
                                        block_m)
    expert = jnp.minimum(group, num_experts - 1)
    cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
    chunk_rows = jnp.arange(block_m, dtype=jnp.int32)  # [BM]
    ok = chunk_rows < size  # [BM]
    rows = jnp.where(ok, first + chunk_rows, 0)  # [BM] sorted rows of the chunk
    x_rows = plgpu.load(index_ref.at[rows])  # [BM] rows of x
    x_ok = jnp.broadcast_to(ok[:, None], (block_m, block_r))

    def load_x(ks):  # [BM, BR] the chunk's x at K indices ks (rows past the run: 0)
        if act is None:
            return plgpu.load(x_ref.at[x_rows[:, None], ks[None, :]], mask=x_ok, other=0)
        half = x_ref.shape[2] // 2
        gate = up = 0.0
        for s in range(x_ref.shape[0]):  # GatedRows.rows' numerics: float32 sums
            gate += plgpu.load(x_ref.at[s, rows[:, None], ks[None, :]], mask=x_ok, other=0)
            up += plgpu.load(x_ref.at[s, rows[:, None], half + ks[None, :]], mask=x_ok,
                             other=0)
        return (ACTIVATIONS[act](gate) * up).astype(x_dtype)

    def k_tile(t, acc):  # acc [BM, BN] float32
        rs = t * block_r + jnp.arange(block_r, dtype=jnp.int32)  # [BR] stored rows
        w = plgpu.load(w_ref.at[expert, rs[:, None], cols[None, :]])  # [BR, BN]
        xs = [load_x(per_word * rs + j) for j in range(per_word)]  # [BM, BR] each
        if not codes:
            return acc + jnp.dot(xs[0], w.astype(x_dtype),
                                 preferred_element_type=jnp.float32)
        zero = 0 if asymmetric else CODE_ZEROS[bits]  # c - zero: exact small integers
        word = w.astype(jnp.int32)
        y = sum(jnp.dot(xj, _dequant_tile(word, j, zero, bits).astype(x_dtype),
                        preferred_element_type=jnp.float32)
                for j, xj in enumerate(xs))  # [BM, BN]
        scale_group = jnp.minimum(t * block_k // group_size, num_groups - 1)
        scale = plgpu.load(s_ref.at[expert, scale_group, cols]).astype(jnp.float32)
        y = y * scale[None, :]
        if asymmetric:
            x_sum = sum(jnp.sum(xj.astype(jnp.float32), axis=1) for xj in xs)  # [BM]
            offset = plgpu.load(o_ref.at[expert, scale_group, cols]).astype(jnp.float32)
            y = y + x_sum[:, None] * offset[None, :]
        return acc + y

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    # a chunk of an expert's run walks w[e]'s K tiles; the tail's chunks (rows past the
    # groups' sum) and empty slots only write zeros
    acc = jax.lax.cond((group < num_experts) & (size > 0),
                       lambda: jax.lax.fori_loop(0, k_tiles, k_tile, zeros), lambda: zeros)
    out_rows = jnp.where(ok, rows, out_ref.shape[0])  # rows past the chunk: written past the
    # end (dropped), never onto a real row
    plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
                mask=jnp.broadcast_to(ok[:, None], (block_m, block_n)))


# jitted: the unrolled layers share one trace and one lowering per shape (ARCHITECTURE.md
# "Kernel calls")
@functools.partial(jax.jit, static_argnames=("group_size", "config", "partials", "interpret"))
def expert_group_matmul(x, w, group_sizes, *, scales=None, offsets=None,
                        group_size: int | None = None, config: ExpertGemmConfig | None = None,
                        partials: bool = False, interpret: bool = False):
    """The kernel: rows x [M, K] sorted by expert (bf16, IndexedRows read in place, or
    GatedRows summed and activated as they load), group_sizes int32 [E] (each expert's run;
    rows past their sum come out 0) @ w[e] -> [M, N] in x's dtype, float32 sums; or float32
    [1, M, N] with `partials`. w bf16 [E, K, N], or codes with scales [E, G, N] (and offsets):
    INT8 uint8 [E, K, N] or INT4 int32 words [E, K/8, N] in groups of group_size K rows.
    Raises ValueError for shapes that do not fit or operands the kernel does not take."""
    plan = _plan(x, w, group_sizes, config, scales, offsets, group_size)
    if plan.refusal:
        raise ValueError(plan.refusal)
    bits, group, cfg = plan.bits, plan.group, plan.config
    m, k = x.shape
    e, _, n = w.shape
    gated, indexed = isinstance(x, GatedRows), isinstance(x, IndexedRows)
    index = x.index.astype(jnp.int32) if indexed else jnp.arange(m, dtype=jnp.int32)
    source = x.partials if gated else x.x if indexed else x
    kernel = functools.partial(
        _kernel, num_experts=e, num_groups=1 if scales is None else scales.shape[1],
        k_tiles=k // cfg.block_k, block_m=cfg.block_m, block_n=cfg.block_n,
        block_k=cfg.block_k, bits=bits, group_size=group, asymmetric=offsets is not None,
        act=x.act if gated else None, x_dtype=x.dtype)
    args = [group_sizes.astype(jnp.int32), index, source, w] + [
        a for a in (scales, offsets) if a is not None]
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel, grid=(-(-m // cfg.block_m) + e, n // cfg.block_n),  # (chunk slots, columns)
        in_specs=[full(a.shape) for a in args],
        out_specs=full((m, n)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32 if partials else x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret,
        name={16: "expert_gemm", 8: "expert_gemm8", 4: "expert_gemm4"}[bits],
    )(*args)
    return out[None] if partials else out


def grouped_rows_matmul(x, w, group_sizes, *, kernels: KernelBackends | None = None,
                        impl: str | None = None, partials: bool = False):
    """ops.moe_matmul.grouped_matmul's function (rows x [M, K], IndexedRows or GatedRows,
    sorted by expert, @ w [E, K, N] per group_sizes [E] -> [M, N], or float32 partials
    [1, M, N]), dispatched. impl None: kernels.moe where `kernel_refusal` finds nothing, the
    grouped XLA forms otherwise (kernels None: those); or 'pallas', 'pallas_interpret' (CPU
    tests), 'reference'."""
    if impl is None:
        fits = kernel_refusal(x, w, group_sizes) is None
        impl = or_reference(kernels).moe if fits else "reference"
    impl = choose_impl("grouped_rows_matmul", impl, "reference")
    if impl == "reference":
        return as_partials(grouped_matmul(input_rows(x), w, group_sizes), partials)
    return expert_group_matmul(x, w, group_sizes, partials=partials,
                               interpret=tiles.interpret_or_gpu(impl))


def grouped_rows_coded_matmul(x, packed, scales, offsets, group_sizes, *, bits: int,
                              group_size: int, kernels: KernelBackends | None = None,
                              impl: str | None = None, partials: bool = False):
    """ops.moe_matmul.grouped_coded_matmul's function (packed INT8 uint8 [E, K, N] or INT4
    int32 [E, K/8, N], scales (offsets) [E, G, N]), dispatched as grouped_rows_matmul is."""
    if code_bits(packed) != bits:
        raise ValueError(f"grouped_rows_coded_matmul: codes {packed.dtype} are not {bits}-bit "
                         "(INT8 uint8, INT4 int32 words)")
    kw = dict(scales=scales, offsets=offsets, group_size=group_size)
    if impl is None:
        fits = kernel_refusal(x, packed, group_sizes, **kw) is None
        impl = or_reference(kernels).moe if fits else "reference"
    impl = choose_impl("grouped_rows_coded_matmul", impl, "reference")
    if impl == "reference":
        y = grouped_coded_matmul(input_rows(x), packed, scales, offsets, group_sizes,
                                 bits=bits, group_size=group_size)
        return as_partials(y, partials)
    return expert_group_matmul(x, packed, group_sizes, partials=partials,
                               interpret=tiles.interpret_or_gpu(impl), **kw)
