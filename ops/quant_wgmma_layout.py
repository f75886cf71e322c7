"""The K order of ops/quant_wgmma.py's inline code conversion: the K position each column of
the dequantized tile multiplies (`wgmma_k_order`), and the stored K orders of the codes
(`K_ORDERS`, `stored_k_positions`; ops.matmul.reorder_k writes them). Pure numpy over shapes:
it runs on any backend.
"""
from __future__ import annotations

import numpy as np

from ops.kernel_choice import K_ORDERS  # how stored [N, K] codes lie along K


def wgmma_k_order(bits: int, k: int):
    """The K position whose activation multiplies column c of the dequantized tile, for c in
    0..K-1 (numpy int32 [K]). Per thread, a loaded word holds codes of consecutive K positions,
    while wgmma's A fragment holds pairs (2t + 8j, 2t + 8j + 1) (t = lane mod 4).
    ops.quant_wgmma_convert.codes_to_bf16 makes register j of the word from the pair it
    converts, without moving data: INT4 nibbles (j, j + 4) of the word of K positions 8t..8t+7
    in each 32-column block; INT8 bytes (2j, 2j+1) of the word of positions
    8 (t mod 2) + 4 (t div 2) + 0..3 in each 16-column block."""
    if bits == 4:  # c = 8j + 2t + h <- q = 8t + 4h + j
        j, t, h = np.meshgrid(np.arange(4), np.arange(4), np.arange(2), indexing="ij")
        q = (8 * t + 4 * h + j).reshape(-1)  # [32] in c order
        span = 32
    else:  # c = 8j + 2t + h <- q = 8 (t mod 2) + 4 (t div 2) + 2j + h
        j, t, h = np.meshgrid(np.arange(2), np.arange(4), np.arange(2), indexing="ij")
        q = (8 * (t % 2) + 4 * (t // 2) + 2 * j + h).reshape(-1)  # [16]
        span = 16
    return (np.arange(0, k, span)[:, None] + q[None, :]).reshape(-1).astype(np.int32)


K_ORDER_SPAN = {4: 32, 8: 16}  # bits -> the K block within which `wgmma_k_order` permutes


def stored_k_positions(bits: int, k: int, k_order: str) -> np.ndarray | None:
    """The K position of x that stored column q of codes in `k_order` multiplies, for q in
    0..K-1 (numpy int32 [K]); None for "natural" (q itself). "wgmma": the codes reordered
    (ops.matmul.reorder_k) so that column c of this kernel's dequantized tile is K position c:
    stored column wgmma_k_order[c] holds position c, x enters the kernel as it is, and any other
    product of those codes takes x[:, positions] first. The permutation stays within blocks of
    K_ORDER_SPAN positions, so groups (of whole blocks) keep their scales."""
    if k_order not in K_ORDERS:
        raise ValueError(f"k_order {k_order!r} must be one of {K_ORDERS}")
    if k_order == "natural":
        return None
    if k % K_ORDER_SPAN[bits]:
        raise ValueError(f"k_order 'wgmma': K = {k} is not a multiple of {K_ORDER_SPAN[bits]}")
    return np.argsort(wgmma_k_order(bits, k)).astype(np.int32)
