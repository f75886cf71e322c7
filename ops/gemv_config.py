"""The tiles of ops/gemv.py's one-row kernel: `GemvConfig` and the dispatch's choice per
product kind (`gemv_config`), from device-time sweeps on the H200.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tiles: block_n output columns (rows of w_t; of each half when gated) per program,
    block_k K positions per loop step."""
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # each loop step loads the next K tile before its own math


def gemv_config(gated: bool, norm: bool, bits: int = 16, k: int = 0) -> GemvConfig:
    """Tiles for one row on an H200, from device-time sweeps on the four Llama-3.1-8B layer
    products. bf16: gated (gate/up) [4 columns of each half, 256 K] without prefetch; normed
    (q/k/v) [8, 512]; plain products (o, down) [4, 1024] with prefetch; 4 warps each. (num_stages changed nothing: Triton does not pipeline this loop,
    hence the explicit prefetch.) INT8 and INT4 codes (`bits`) take wider column blocks,
    [block_n, block_k (K positions), warps]: see CODE_TILES; a plain product of at most
    SHORT_K positions (`k`: o) takes the "short" tile."""
    if bits != 16:
        kind = "gated" if gated else "norm" if norm else "short" if k <= SHORT_K else "plain"
        block_n, block_k, warps = CODE_TILES[bits][kind]
        return GemvConfig(block_n, block_k, warps, num_stages=1,
                          prefetch=kind in ("plain", "short"))
    if gated:
        return GemvConfig(block_n=4, block_k=256, num_warps=4, num_stages=3)
    if norm:
        return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)
    return GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=1, prefetch=True)


# (block_n, block_k, num_warps) per bits and product kind: the fastest of 27 tiles each on the
# H200 (plain = o and down with prefetch, the down product's choice for INT4), and of 36 for the
# plain products (short = o, K <= SHORT_K; INT4's best is the same for both)
SHORT_K = 4096
CODE_TILES = {8: {"gated": (8, 512, 4), "norm": (16, 1024, 8), "plain": (8, 1024, 2),
                  "short": (16, 1024, 8)},
              4: {"gated": (8, 1024, 2), "norm": (16, 2048, 4), "plain": (16, 1024, 4),
                  "short": (16, 1024, 4)}}
