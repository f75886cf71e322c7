"""The tiles of ops/quant_matmul.py's Triton kernels: `MatmulConfig` and the dispatch's choice
(`matmul_config`: the fma kernels for one or two rows, the tensor-core paths up to 128 rows, XLA's
dequantize + dot past that). Pure Python over shapes, from H200 sweeps.
"""
from __future__ import annotations

import dataclasses

from ops import quant_gemv8

NUM_SMS = 132  # H100 / H200; only shapes the split heuristic
PATHS = ("auto", "mma")


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Static tiling of the quantized matmul kernel (all sizes powers of two)."""

    block_m: int  # activation rows per program: < 16 fma path, >= 16 tl.dot path
    block_n: int  # output columns per program
    block_k: int  # K rows per loop step (int4: a multiple of 8; dot paths: >= 16 words)
    num_splits: int = 1  # programs along K
    num_warps: int = 4
    num_stages: int = 3
    path: str = "auto"  # "auto": fma below block_m 16, else dot; "mma": tensor cores for decode


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def matmul_config(bits: int, m: int, k: int, n: int, group_size: int,
                  stored_nk: bool = False) -> MatmulConfig | None:
    """The tuning heuristic: a kernel config, or None where XLA's dequantize + dot is faster.
    Weights stored [N, K] (`stored_nk`) take the tensor-core paths from one row up (the fma
    kernels read [K, N] only; one row of such weights runs ops/gemv.py instead).

    Tiles from sweeps on an H200 (scripts/bench/matmul.py --modes=sweep over the Llama-3.1-8B
    shapes at M = 1, 16, 64); above two rows, splits give about two programs per SM (one or two
    rows: `_gemv_config`).
    """
    if m > 128:
        return None  # compute-bound: XLA's dequantize + bf16 dot
    if m <= 2 and not stored_nk:
        return _gemv_config(bits, m, k, n, group_size)
    if m <= 16:  # the "mma" path: fastest of the sweep at M = 16 on 3 of the 4 Llama shapes
        cfg = (MatmulConfig(block_m=16, block_n=256, block_k=256, path="mma") if bits == 4
               else MatmulConfig(block_m=16, block_n=128, block_k=64, path="mma"))
    else:
        bm = max(16, _next_pow2(m))
        cfg = MatmulConfig(block_m=bm, block_n=128 if bm <= 64 else 64,
                           block_k=256 if bits == 4 else 64)
    return _with_splits(cfg, bits, m, k, n, per_sm=2, min_tiles=2, max_splits=16)


def _with_splits(cfg: MatmulConfig, bits: int, m: int, k: int, n: int, *, per_sm: int,
                 min_tiles: int, max_splits: int) -> MatmulConfig:
    """cfg with the K splits that give about `per_sm` programs per SM, each split at least
    `min_tiles` K tiles, at most `max_splits`."""
    rows = k // 8 if bits == 4 else k
    step = cfg.block_k // 8 if bits == 4 else cfg.block_k
    tiles = -(-rows // step)
    programs = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    splits = max(1, min(round(per_sm * NUM_SMS / programs), tiles // min_tiles, max_splits))
    return dataclasses.replace(cfg, num_splits=splits)


def _gemv_config(bits: int, m: int, k: int, n: int, group_size: int) -> MatmulConfig:
    """The fma path's tiles for one or two activation rows (decode at batch 1 or 2).

    The kernel is bound by its instructions and their latency (Nsight Compute on an H200,
    4096x28672 int4: issue slots 49-66% busy, DRAM 32-50%), so it wants many resident warps,
    and each thread wants many columns of few packed rows: a thread reads the activations of
    every packed row it holds (8 per row), whatever its number of columns. int4 at one row runs
    one-warp programs of [4 words, 256 columns] (8 columns a thread) split over K until there
    are about 16 programs per SM (at most 128 splits); two rows run [16 words, 128 columns]
    tiles with 4 warps at about 16 per SM (at most 64 splits), or 8-warp [32, 128] tiles without
    splits where the columns alone give two programs per SM (the lm head). Per-channel int8
    (ops/quant_gemv8.py) runs, at about 16 programs per SM (at most 64 splits): one row,
    [32 rows, 256 columns] 4-warp tiles on products of at least 32M weights, else [16, 512];
    two rows [16, 256] with 2 warps, or [16, 512] with 4 where the columns alone give two
    programs per SM. Group-wise int8 runs 8-warp [32, 256 / M] tiles at about 8 programs per
    SM (at most 16 splits). From H200 sweeps.
    """
    block_m, block_n = _next_pow2(m), 256 // m
    if quant_gemv8.supports(bits, n, -(-k // group_size)):  # per-channel INT8: word kernel
        if m == 1 and k * n >= 32 * 2 ** 20:
            cfg = MatmulConfig(block_m=1, block_n=256, block_k=32, num_warps=4)
        elif m == 1 or -(-n // 256) >= 2 * NUM_SMS:
            cfg = MatmulConfig(block_m=block_m, block_n=512, block_k=16, num_warps=4)
        else:
            cfg = MatmulConfig(block_m=block_m, block_n=256, block_k=16, num_warps=2)
        return _with_splits(cfg, bits, m, k, n, per_sm=16, min_tiles=1, max_splits=64)
    if bits == 8:
        cfg = MatmulConfig(block_m=block_m, block_n=block_n, block_k=32, num_warps=8)
        return _with_splits(cfg, bits, m, k, n, per_sm=8, min_tiles=2, max_splits=16)
    if m == 1:
        cfg = MatmulConfig(block_m=1, block_n=256, block_k=32, num_warps=1)
        return _with_splits(cfg, bits, m, k, n, per_sm=16, min_tiles=1, max_splits=128)
    if -(-n // block_n) >= 2 * NUM_SMS:
        cfg = MatmulConfig(block_m=block_m, block_n=block_n, block_k=256, num_warps=8)
        return _with_splits(cfg, bits, m, k, n, per_sm=2, min_tiles=2, max_splits=16)
    cfg = MatmulConfig(block_m=block_m, block_n=block_n, block_k=128, num_warps=4)
    return _with_splits(cfg, bits, m, k, n, per_sm=16, min_tiles=1, max_splits=64)
