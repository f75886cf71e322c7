"""The decode product of a mixture of experts as one Pallas Triton kernel: y[m] = x[m] @
w[expert[m]] for rows in any order, each with its expert, reading each row's expert weight once
from memory and never a gathered copy of it.

    expert_gemv          the kernel: x [M, K] bf16, expert int32 [M], w [E, K, N] bf16 -> [M, N]
    expert_rows_matmul   the dispatch (the kernel where KernelBackends.moe says so and
                         `kernel_refusal` finds nothing; ops.moe_matmul.rows_matmul otherwise)

XLA's form of the same product (ops/moe_matmul.py `rows_matmul`, an einsum over w[expert])
writes the gathered weights [M, K, N] to memory before it multiplies, so a decode step moves
about three times the bytes of the experts it touches. Here each program owns one row m, a
block of block_n output columns and one of `splits` slices of K: it loads expert[m] itself,
walks its K slice one [block_k, block_n] tile of w[expert[m]] at a time (the tile's rows are
contiguous block_n-column runs of the [K, N] layout), multiplies by the row's x in float32 and
adds into a [block_k, block_n] accumulator that is summed over K once, at the end. At a decode
step's few rows (batch 1: M = k = 8 rows, qwen3-30b-a3b's N = 768) rows x column blocks are far
fewer programs than a GPU has SMs, so K is split until there are about TARGET_PROGRAMS of them;
each split writes a float32 partial [S, M, N] and jnp sums the splits (one small fusion). One
split writes x's dtype directly.

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

from ops.kernel_choice import KernelBackends, choose_impl, or_reference
from ops.moe_matmul import rows_matmul

TARGET_PROGRAMS = 528  # four programs per SM of an H100 / H200 (132 SMs), resident at once
BLOCK_NS = (128, 64, 32, 16)  # output columns per program, the largest that divides N
BLOCK_KS = (32, 16)  # K rows per tile, the largest that divides K
MAX_ELEMENTS = 2 ** 31  # E * K * N: the kernel's element offsets are int32


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


def expert_gemv_config(k: int, n: int) -> ExpertGemvConfig | None:
    """The default tiles for K x N experts: the largest block_n of BLOCK_NS dividing N and
    block_k of BLOCK_KS dividing K (None when none does)."""
    block_n = next((b for b in BLOCK_NS if n % b == 0), None)
    block_k = next((b for b in BLOCK_KS if k % b == 0), None)
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


def _check(x, w, expert) -> None:
    """ValueError naming the operand whose shape does not fit."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expert_gemv: x {x.shape} must be [M, K] against experts [E, K, N] "
                         f"{w.shape}")
    if expert.shape != (x.shape[0],) or not jnp.issubdtype(expert.dtype, jnp.integer):
        raise ValueError(f"expert_gemv: expert ids {expert.shape} {expert.dtype} must be "
                         f"integers [M] = [{x.shape[0]}] (one expert per row of x)")


def kernel_refusal(x, w, expert, config: ExpertGemvConfig | None = None) -> str | None:
    """Why the kernel cannot take operands that passed the shape check (None: it can): it takes
    bf16 x and experts, K and N multiples of the config's blocks (default tiles: N a multiple of
    16, K of 16), and fewer than MAX_ELEMENTS expert elements."""
    _check(x, w, expert)
    e, k, n = w.shape
    cfg = config or expert_gemv_config(k, n)
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        return f"expert_gemv: the kernel takes bf16 x and experts, not {x.dtype} and {w.dtype}"
    if cfg is None or k % cfg.block_k or n % cfg.block_n:
        blocks = "" if cfg is None else f" ({cfg.block_k} x {cfg.block_n})"
        return f"expert_gemv: experts {w.shape} are not whole tiles{blocks} of K x N"
    if e * k * n >= MAX_ELEMENTS:
        return f"expert_gemv: experts {w.shape} hold more than 2^31 elements"
    return None


def _kernel(expert_ref, x_ref, w_ref, out_ref, *, num_experts: int, k_tiles: int,
            per_split: int, block_n: int, block_k: int, prefetch: bool):
    # expert_ref [M] int32; x_ref [M, K]; w_ref [E, K, N]; out_ref [S, M, N]
    row, nb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = jnp.clip(plgpu.load(expert_ref.at[row]), 0, num_experts - 1)
    cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
    first = split * per_split
    last = jnp.minimum(first + per_split, k_tiles)

    def load_tile(t):  # (x [BK], w[expert] [BK, BN]) of K tile t; with prefetch, tiles past
        # the split's last read nothing (masked)
        ks = t * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
        view = w_ref.at[expert, ks[:, None], cols[None, :]]
        if not prefetch:
            return plgpu.load(x_ref.at[row, ks]), plgpu.load(view)
        ok = ks < last * block_k
        return (plgpu.load(x_ref.at[row, ks], mask=ok, other=0),
                plgpu.load(view, mask=jnp.broadcast_to(ok[:, None], (block_k, block_n)),
                           other=0))

    def body(t, carry):  # carry: (the prefetched tile or None, acc [BK, BN] float32)
        tile, acc = carry
        if prefetch:  # the next tile's loads issued before this tile's math
            nxt = load_tile(t + 1)
        else:
            tile, nxt = load_tile(t), None
        xs, w = tile
        return nxt, acc + xs.astype(jnp.float32)[:, None] * w.astype(jnp.float32)

    init = (load_tile(first) if prefetch else None,
            jnp.zeros((block_k, block_n), jnp.float32))
    _, acc = jax.lax.fori_loop(first, last, body, init)
    plgpu.store(out_ref.at[split, row, cols], jnp.sum(acc, axis=0).astype(out_ref.dtype))


def expert_gemv(x, w, expert, *, config: ExpertGemvConfig | None = None,
                interpret: bool = False):
    """The kernel: x [M, K] @ w[expert[m]] per row -> [M, N] in x's dtype, float32 sums. x and
    w [E, K, N] bf16; expert int32 [M] (ids outside [0, E) are clamped into it). Raises
    ValueError for shapes that do not fit or operands the kernel does not take
    (`kernel_refusal`)."""
    refusal = kernel_refusal(x, w, expert, config)
    if refusal:
        raise ValueError(refusal)
    m, k = x.shape
    e, _, n = w.shape
    cfg = config or expert_gemv_config(k, n)
    k_tiles, column_blocks = k // cfg.block_k, n // cfg.block_n
    splits = min(cfg.splits or default_splits(m, column_blocks, k_tiles, cfg.target_programs),
                 k_tiles)
    per_split = -(-k_tiles // splits)
    splits = -(-k_tiles // per_split)  # no empty split
    out_dtype = x.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(_kernel, num_experts=e, k_tiles=k_tiles, per_split=per_split,
                               block_n=cfg.block_n, block_k=cfg.block_k,
                               prefetch=cfg.prefetch)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel, grid=(m, column_blocks, splits),
        in_specs=[full((m,)), full((m, k)), full((e, k, n))],
        out_specs=full((splits, m, n)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret, name="expert_gemv",
    )(expert.astype(jnp.int32), x, w)
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)


def expert_rows_matmul(x, w, expert, *, kernels: KernelBackends | None = None,
                       impl: str | None = None, config: ExpertGemvConfig | None = None):
    """ops.moe_matmul.rows_matmul's function (x [M, K] @ w[expert[m]] per row -> [M, N]),
    dispatched. impl None: kernels.moe where `kernel_refusal` finds nothing, the reference
    (rows_matmul) otherwise (kernels None: the reference); or 'pallas', 'pallas_interpret'
    (CPU tests), 'reference'."""
    if impl is None:
        fits = kernel_refusal(x, w, expert, config) is None
        impl = or_reference(kernels).moe if fits else "reference"
    impl = choose_impl("expert_rows_matmul", impl, "reference")
    if impl == "reference":
        return rows_matmul(x, w, expert)
    return expert_gemv(x, w, expert, config=config, interpret=impl == "pallas_interpret")
