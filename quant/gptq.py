"""GPTQ: quantize a linear kernel column by column, compensating each rounding error.

For a kernel W [K, N] (x @ W) whose inputs X [T, K] come from calibration text, GPTQ minimizes
the layer output error ||X W - X Q||^2. The error of row k of W (input channel k) is pushed onto
the rows not yet quantized, weighted by the inverse Hessian of that least-squares problem:

    H = 2 X^T X / T                      [K, K]   (from the calibration inputs)
    H += damp * mean(diag(H)) * I        (dampening keeps H well conditioned)
    U = upper Cholesky factor of H^-1    (H^-1 = U^T U)
    for k in order:   q_k = quantize(w_k)                 on the grid of w_k's group
                      e_k = (w_k - q_k) / U[k, k]
                      w_j -= U[k, j] * e_k   for j > k    (error compensation)

Updates are applied lazily: inside a block of `block_size` rows they are rank-1 updates of the
block; the rest of W receives the whole block's errors at once as one matrix product. A group's
scale and offset are chosen (min/max RTN, quant/rtn.py) when its first row is reached, from the
group's already compensated values. With `act_order`, rows are visited in order of decreasing
diag(H) (the most active input channels first); groups then follow that order, and the weight is
stored with its rows permuted plus the permutation (see quant/qtensor.py), so the packed layout
and the matmul stay the same. The solve runs on the host in numpy (float64 for H^-1 and its
Cholesky factor, float32 for the updates).
"""
from __future__ import annotations

import numpy as np

from quant.qtensor import QuantizedWeight, make_quantized_weight, num_groups
from quant.rtn import minmax_params, resolve_group_size


def hessian(x: np.ndarray) -> np.ndarray:
    """H = 2 X^T X / T of inputs x [..., K], float64 [K, K]."""
    x = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1])
    return (2.0 / x.shape[0]) * (x.T.astype(np.float64) @ x.astype(np.float64))


def _round_row(w: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, bits: int):
    """(codes, dequantized values) of one row w [N] on a group's grid."""
    qmax = 2 ** bits - 1
    if offset is None:
        codes = np.clip(np.rint(w / scale) + 2 ** (bits - 1), 0, qmax)
        return codes, scale * (codes - 2 ** (bits - 1))
    codes = np.clip(np.rint((w - offset) / scale), 0, qmax)
    return codes, scale * codes + offset


def gptq_quantize(w, h: np.ndarray, bits: int, group_size: int | None, symmetric: bool,
                  act_order: bool = False, damp: float = 0.01, block_size: int = 128,
                  dtype=None) -> QuantizedWeight:
    """GPTQ-quantized QuantizedWeight of the float kernel w [K, N] given its Hessian h [K, K].

    dtype: storage dtype of the scales and offsets (default: w's dtype).
    """
    dtype = dtype or np.asarray(w).dtype
    weight = np.array(w, np.float32)  # [K, N], updated in place
    k, n = weight.shape
    if h.shape != (k, k):
        raise ValueError(f"gptq_quantize: Hessian {h.shape} does not fit kernel {weight.shape}")
    group_size = resolve_group_size(group_size, k)
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0  # input channels that never fire: their rows cannot matter
    h[dead, dead] = 1.0
    weight[dead] = 0.0
    perm = None
    if act_order:
        perm = np.argsort(-np.diag(h), kind="stable")
        weight, h = weight[perm], h[perm][:, perm]
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T.astype(np.float32)  # upper, H^-1 = U^T U

    g = num_groups(k, group_size)
    codes = np.zeros((k, n), np.int32)
    scales = np.zeros((g, n), np.float32)
    offsets = None if symmetric else np.zeros((g, n), np.float32)
    scales_stored, offsets_stored = [], []
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        block = weight[b0:b1]  # [Bk, N], a view: updates land in `weight`
        errors = np.zeros_like(block)
        for j in range(b1 - b0):
            row = b0 + j
            if row % group_size == 0:  # new group: its grid from its current values
                gi = row // group_size
                rows = np.concatenate([block[j:], weight[b1:row + group_size]])[:group_size]
                s, o = minmax_params(rows, bits, rows.shape[0], symmetric, dtype=dtype)
                scales_stored.append(s)
                scales[gi] = np.asarray(s, np.float32)[0]
                if o is not None:
                    offsets_stored.append(o)
                    offsets[gi] = np.asarray(o, np.float32)[0]
            gi = row // group_size
            c, q = _round_row(block[j], scales[gi], None if symmetric else offsets[gi], bits)
            codes[row] = c
            err = (block[j] - q) / u[row, row]  # [N]
            block[j + 1:] -= np.outer(u[row, row + 1:b1], err)
            errors[j] = err
        weight[b1:] -= u[b0:b1, b1:].T @ errors  # the block's errors onto the later rows
    return make_quantized_weight(
        codes, np.concatenate(scales_stored), None if symmetric else np.concatenate(offsets_stored),
        bits, group_size, perm)
