"""The tiles of ops/quant_wgmma.py's kernels: `WgmmaConfig`, which products they take
(`supports`), the dispatch's tiles (`wgmma_config`: one row tile up to MAX_ROWS rows, then
`large_m_config`), the warp-specialized kernel's (`ws_config`) and the tiles that
scripts/bench/matmul.py --modes=sweep times (`sweep_configs`). Pure Python over shapes: the
sizes and rules come from wgmma (m64 programs of BLOCK_N columns, N up to MAX_BLOCK_M rows), the
register file (MAX_ACC) and H200 sweeps.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

BLOCK_N = 64  # wgmma's M: a program's output columns come in multiples of it
MAX_ROWS = 64  # activation rows the kernel takes (wgmma's N up to 64 here)
MIN_BLOCK_K = 64  # the smallest step: 128-byte rows of x's tile (wgmma's swizzled B operand)
WIDE_STEP_ROWS = 16  # wgmma_config: INT4 steps of 256 K up to this many (padded) rows
MANY_ROWS = 33  # wgmma_config: from this many rows, K splits for about 192 programs (INT4 and
# INT8 alike) and INT8 in 64-column programs (the 64-row sweep)
MIN_GROUP_PART = 64  # steps spanning groups: the narrowest (x's tile is sliced in 128-byte rows)
NUM_SMS = 132  # H100 / H200 (as ops/quant_matmul.py); only shapes the tile choices
# Warp-specialized consumers: at most 3. With four (five warpgroups, 640 threads: 102 registers
# a thread) Pallas's pipeline asks each consumer to grow to 112 registers, more than the file
# holds, and the kernel hangs in setmaxnreg.
MAX_CONSUMERS = 3
# ws_config: units for about three quarters of an H200's SMs (fewer K splits: at many rows
# their float32 partials are as large as the output)
MIN_WS_ROW_TILE_UNITS = 96
WS_SMEM_BYTES = 220 * 1024  # shared memory of a warp-specialized program (an H200 SM: 227 KB)


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """block_k: K positions per pipeline step; num_splits: programs along K; stages: pipeline
    steps in flight (TMA copies ahead of the math)."""
    block_k: int = 256
    block_n: int = 64  # output columns per program (a multiple of BLOCK_N: m64 wgmmas)
    num_splits: int = 1
    stages: int = 4
    consumers: int = 0  # >= 2: the warp-specialized persistent kernel (ops/quant_wgmma_ws.py)
    block_m: int = 0  # activation rows per program; 0: all of them (up to MAX_ROWS) in one tile


MAX_BLOCK_M = 256  # wgmma's largest N
MAX_ACC = 64 * 256  # accumulator elements per warpgroup: 128 float32 registers per thread
LARGE_M_ROWS = 512  # large_m_config: from here on the warp-specialized 256-row tiles


def smem_bytes(bits: int, block_m: int, block_k: int, columns: int, stages: int,
               out_bytes: int = 2) -> int:
    """Shared memory of a program with row tiles: `stages` steps of x's tile [block_m,
    block_k] bf16 and the codes [columns, block_k], and the output tile [block_m, columns]
    (bf16, or float32 partials: out_bytes 4; barriers and scales left out)."""
    return (stages * block_k * (2 * block_m + columns * bits // 8)
            + out_bytes * block_m * columns)


def padded_rows(m: int) -> int:
    """wgmma's N for m activation rows: a multiple of 8."""
    return max(8, -(-m // 8) * 8)


def row_tiling(m: int, cfg: WgmmaConfig) -> tuple[int, int]:
    """(rows per program, padded rows): one tile of `padded_rows` when cfg.block_m is 0, else
    tiles of block_m rows."""
    if not cfg.block_m:
        rows = padded_rows(m)
        return rows, rows
    return cfg.block_m, -(-m // cfg.block_m) * cfg.block_m


def supports(bits: int, m: int, k: int, n: int, group_size: int, x_dtype, scales_dtype,
             config: WgmmaConfig | None = None) -> bool:
    """Whether the kernel takes the product: bf16 activations and scales, 1..MAX_ROWS rows in
    one tile or any number in tiles of block_m (a multiple of 8 up to MAX_BLOCK_M, at most
    MAX_ACC accumulator elements: block_n x block_m), N a multiple of the program's columns
    (`program_columns`; the warp-specialized kernel: 2 to MAX_CONSUMERS consumers), K of whole
    steps (block_k of `config`, default `wgmma_config`'s) for every split, and per-channel
    scales, groups of whole steps or steps of whole groups of at least MIN_GROUP_PART
    positions (`group_parts`)."""
    if bits not in (4, 8) or m < 1 or n % BLOCK_N:
        return False
    cfg = config or wgmma_config(bits, m, k, n, group_size)
    if cfg.block_m:
        if (cfg.block_m % 8 or cfg.block_m > MAX_BLOCK_M
                or cfg.block_m * cfg.block_n > MAX_ACC):
            return False
    elif m > MAX_ROWS:
        return False
    if cfg.block_n % BLOCK_N or n % program_columns(cfg):
        return False
    if cfg.consumers and not 2 <= cfg.consumers <= MAX_CONSUMERS:
        return False
    grouped = -(-k // group_size) > 1
    whole_groups = cfg.block_k % group_size == 0 and group_size >= MIN_GROUP_PART
    return (jnp.dtype(x_dtype) == jnp.bfloat16 and jnp.dtype(scales_dtype) == jnp.bfloat16
            and cfg.block_k >= MIN_BLOCK_K and k % (cfg.block_k * cfg.num_splits) == 0
            and (not grouped or group_size % cfg.block_k == 0 or whole_groups))


def program_columns(cfg: WgmmaConfig) -> int:
    """Output columns per program (per work unit of the warp-specialized kernel): block_n,
    times the consumers (each takes its own block_n rows of the code tile)."""
    return cfg.block_n * max(1, cfg.consumers)


def group_parts(k: int, group_size: int, block_k: int) -> tuple[int, int]:
    """(steps per group, groups per step) of steps of block_k positions over groups of
    group_size (one of the two is 1; per-channel scales: (steps, 1)): a step spanning several
    groups scales each part of its tile by its own group's scales."""
    if group_size >= k:
        return max(1, k // block_k), 1
    return max(1, group_size // block_k), max(1, block_k // group_size)


def wgmma_config(bits: int, m: int, k: int, n: int, group_size: int) -> WgmmaConfig:
    """Tiles from the H200 sweeps at 16 rows: INT4 up to WIDE_STEP_ROWS rows
    in steps of 256 positions (spanning groups of 64 or 128) with 4 stages (2 up to 8 rows
    without a K split), K splits up to about 256 programs; else steps of 128 INT4 positions
    (capped by the group) with 3 stages, or 256 INT8 positions with 2, K splits up to about
    384 (INT4) or 256 (INT8) programs; each split at least two steps, and 128-column
    programs where that still gives about 200 programs without a split (gate/up, the lm
    head), else 64 columns. From MANY_ROWS rows (the 64-row sweep) the splits aim at about
    192 programs, and INT8 takes 64-column programs up to 512 of them (gate/up; the lm head,
    not swept there, keeps 128). Past MAX_ROWS rows, `large_m_config`."""
    if m > MAX_ROWS:
        return large_m_config(bits, m, k, n, group_size)
    many_rows = m >= MANY_ROWS
    narrow_int8 = many_rows and bits == 8 and n // BLOCK_N <= 512
    block_n = 128 if n // 128 >= 200 and n % 128 == 0 and not narrow_int8 else BLOCK_N
    programs = max(1, n // block_n)
    if bits == 4 and padded_rows(m) <= WIDE_STEP_ROWS:  # 256-K steps, where the kernel takes them
        splits = 1 if programs >= 200 else k_splits(programs, k // 256, 256)
        # up to 8 rows without a split (gate/up, the lm head) two stages stream faster than
        # four (the lm head 7% on the H200; equal at 16 rows)
        stages = 2 if splits == 1 and padded_rows(m) == 8 else 4
        wide = WgmmaConfig(block_k=256, block_n=block_n, num_splits=splits, stages=stages)
        if supports(bits, m, k, n, group_size, jnp.bfloat16, jnp.bfloat16, wide):
            return wide
    block_k = step_in_group(128 if bits == 4 else 256, k, group_size)
    steps = max(1, k // block_k)
    want = 192 if many_rows else 384 if bits == 4 else 256
    splits = 1 if programs >= 200 else k_splits(programs, steps, want)
    return WgmmaConfig(block_k=block_k, block_n=block_n, num_splits=splits,
                       stages=3 if bits == 4 else 2)


def step_in_group(block_k: int, k: int, group_size: int) -> int:
    """block_k capped by the group (a step that lies in one group; per-channel scales: no cap),
    and at least MIN_BLOCK_K."""
    return max(MIN_BLOCK_K, block_k if group_size >= k else min(block_k, group_size))


def large_m_config(bits: int, m: int, k: int, n: int, group_size: int) -> WgmmaConfig:
    """Tiles past MAX_ROWS rows, from the H200 sweeps at 128 and 1024 rows: from LARGE_M_ROWS
    rows on the warp-specialized kernel's 256-row tiles (`ws_config`: two consumers of 64
    columns sharing each x tile), or 128-row tiles of three consumers where N takes them and
    their units keep the SMs busier by a tenth (`ws_balance`); else the one-warpgroup row tiles
    of `row_tile_config`."""
    if m < LARGE_M_ROWS:
        return row_tile_config(m, k, n, group_size)
    two = ws_config(bits, m, k, n, group_size)
    if n % (3 * BLOCK_N):
        return two
    three = ws_config(bits, m, k, n, group_size, consumers=3, block_m=128)
    return three if ws_balance(three, m, n) >= ws_balance(two, m, n) + 0.1 else two


def ws_balance(cfg: WgmmaConfig, m: int, n: int) -> float:
    """The share of NUM_SMS SMs' rounds that the warp-specialized units of `cfg` fill (1.0:
    whole rounds)."""
    units = n // (cfg.consumers * cfg.block_n) * -(-m // cfg.block_m) * cfg.num_splits
    return units / (-(-units // NUM_SMS) * NUM_SMS)


def row_tile_config(m: int, k: int, n: int, group_size: int) -> WgmmaConfig:
    """One-warpgroup row tiles, INT4 and INT8 alike: 2 stages, 64-column programs of 256 rows
    in steps of 64 K from LARGE_M_ROWS rows on (about 100 KB of shared memory: two programs per
    SM), else of 128 rows in steps of 128 K (capped by the group) with the K splits that give
    about one program per SM."""
    block_m, block_k = (256, 64) if m >= LARGE_M_ROWS else (128, 128)
    block_k = step_in_group(block_k, k, group_size)
    programs = n // BLOCK_N * -(-m // block_m)
    return WgmmaConfig(block_k=block_k, block_n=BLOCK_N, stages=2, block_m=block_m,
                       num_splits=k_splits(programs, max(1, k // block_k), NUM_SMS))


def k_splits(programs: int, steps: int, want: int) -> int:
    """The fewest power-of-two K splits that give `programs` column tiles at least `want`
    programs (or units), each split of at least two of the `steps`."""
    splits = 1
    while programs * splits < want and steps % (splits * 2) == 0 and steps // (splits * 2) >= 2:
        splits *= 2
    return splits


def ws_config(bits: int, m: int, k: int, n: int, group_size: int,
              consumers: int = 2, block_m: int | None = None) -> WgmmaConfig:
    """Row tiles for the warp-specialized kernel (ops/quant_wgmma_ws.py; the dispatch's from
    LARGE_M_ROWS rows): `row_tile_config`'s height (`block_m` overrides it) in steps of 64 K,
    64 columns per consumer, the most stages (up to 4) whose shared memory fits an SM
    (WS_SMEM_BYTES), and the K splits that give MIN_WS_ROW_TILE_UNITS units."""
    block_m = block_m or row_tile_config(m, k, n, group_size).block_m
    units = n // (consumers * BLOCK_N) * -(-m // block_m)
    return WgmmaConfig(block_k=MIN_BLOCK_K, block_n=BLOCK_N,
                       stages=ws_stages(bits, block_m, consumers * BLOCK_N),
                       block_m=block_m, consumers=consumers,
                       num_splits=k_splits(units, max(1, k // MIN_BLOCK_K),
                                           MIN_WS_ROW_TILE_UNITS))


def ws_stages(bits: int, block_m: int, columns: int, block_k: int = MIN_BLOCK_K,
              out_bytes: int = 2) -> int:
    """The most pipeline stages, 2 to 4, of a warp-specialized unit of block_m rows x
    `columns` whose shared memory (`smem_bytes`, the output tiles included) fits
    WS_SMEM_BYTES; 0 if not even 2 fit."""
    return max([st for st in (2, 3, 4) if smem_bytes(
        bits, block_m, block_k, columns, st, out_bytes) <= WS_SMEM_BYTES], default=0)


def sweep_configs(bits: int, k: int, n: int, m: int = MAX_ROWS) -> list[WgmmaConfig]:
    """The tiles scripts/bench/matmul.py --modes=sweep times (INT4 in groups of 128, INT8 per
    channel): 64 / 128 / 256 columns times K splits giving about 120 to 1100 programs (or none
    where the columns alone give more), steps of 128 K (3 stages) or, for INT8, also 256 (2
    stages). Past MAX_ROWS rows, the row tiles of `_large_m_tiles` and, for the warp-specialized
    kernel, `_ws_row_tiles`."""
    if m > MAX_ROWS:
        return _large_m_tiles(bits, k, n, m) + _ws_row_tiles(bits, k, n, m)
    return _sweep_tiles(bits, k, n)


def _ws_row_tiles(bits: int, k: int, n: int, m: int) -> list[WgmmaConfig]:
    """Row tiles for the warp-specialized kernel: 128 or 256 rows (no more than m needs) shared
    by 2-3 consumers of 64 columns or 2 of 128 (N permitting), steps of 64 K, `ws_stages` and
    one fewer, K splits up to MIN_WS_ROW_TILE_UNITS units."""
    out = []
    for block_m, consumers, block_n in ((128, 2, 64), (256, 2, 64), (128, 3, 64),
                                        (128, 2, 128)):
        if (block_m > 128 and block_m // 2 >= m) or n % (consumers * block_n):
            continue
        stages = ws_stages(bits, block_m, consumers * block_n)
        if not stages:
            continue
        units = n // (consumers * block_n) * -(-m // block_m)
        splits = k_splits(units, k // 64, MIN_WS_ROW_TILE_UNITS)
        out += [WgmmaConfig(block_k=64, block_n=block_n, num_splits=splits, stages=st,
                            block_m=block_m, consumers=consumers)
                for st in sorted({stages, max(2, stages - 1)})]
    return out


def _large_m_tiles(bits: int, k: int, n: int, m: int) -> list[WgmmaConfig]:
    """Row tiles of 64 to 256 rows (no more than m needs) times 64 / 128 columns (within
    MAX_ACC), steps of 64 or 128 K with the most stages (2 to 4) whose shared memory, output
    tile included, leaves room for two programs per SM (about 110 KB), the K splits that give
    an H200 one or two programs per SM (`k_splits`)."""
    out = []
    for block_m, block_n in ((128, 64), (256, 64), (64, 128), (128, 128)):
        if block_m > 64 and block_m // 2 >= m:
            continue
        for block_k in (64, 128):
            stages = max([st for st in (2, 3, 4) if smem_bytes(
                bits, block_m, block_k, block_n, st) <= 110 * 1024], default=0)
            if not stages:
                continue
            programs = n // block_n * -(-m // block_m)
            for splits in sorted({k_splits(programs, k // block_k, want)
                                  for want in (NUM_SMS, 2 * NUM_SMS)}):
                out.append(WgmmaConfig(block_k=block_k, block_n=block_n, num_splits=splits,
                                       stages=stages, block_m=block_m))
    return out


def _sweep_tiles(bits: int, k: int, n: int) -> list[WgmmaConfig]:
    out = []
    for block_k in ((128,) if bits == 4 else (128, 256)):
        steps = k // block_k
        for block_n in (64, 128, 256):
            for splits in (1, 2, 4, 8, 16):
                programs = n // block_n * splits
                if steps % splits or steps // splits < 2 or not (
                        120 <= programs <= 1100 or (splits == 1 and programs > 1100)):
                    continue
                out.append(WgmmaConfig(block_k=block_k, block_n=block_n, num_splits=splits,
                                       stages=3 if block_k == 128 else 2))
    return out
