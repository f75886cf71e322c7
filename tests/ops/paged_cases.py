"""Random paged-cache cases and an independent float64 numpy attention, shared by the tests of
ops/ragged_attention.py and ops/kv_quant.py.

Each sequence's K/V are drawn contiguously first, then scattered into randomly chosen (shuffled)
physical pages; every other cache entry holds large garbage that must never be seen, and block
table entries past a sequence's pages point at garbage pages too.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

GARBAGE = 40.0
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
             "int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


@dataclasses.dataclass
class PagedCase:
    k_pages: np.ndarray  # [KVH, P, S, D] storage dtype
    v_pages: np.ndarray
    k_scales: np.ndarray | None  # [KVH, P, S] float32 (quantized pages only)
    v_scales: np.ndarray | None
    block_tables: np.ndarray  # int32 [num_seqs, W]
    kv_lens: np.ndarray  # int32 [num_seqs]
    keys: list  # per sequence: float64 [kv_len, KVH, D], what the (dequantized) pages hold
    values: list


def quantize_np(x: np.ndarray, kv_dtype: str):
    """Numpy twin of ops.kv_quant.quantize_kv: x [..., D] -> (values, scales [...])."""
    qmax = QMAX[kv_dtype]
    x = x.astype(np.float32)
    scale = (np.abs(x).max(-1) / np.float32(qmax)).astype(np.float32)
    y = np.clip(x / np.where(scale > 0, scale, 1)[..., None], -qmax, qmax)
    if kv_dtype == "int8":
        y = np.round(y)
    return y.astype(NP_DTYPES[kv_dtype]), scale


def make_paged_case(rng, kv_lens, *, page_size, num_kv_heads, head_dim, kv_dtype="float32",
                    extra_width=1, spare_pages=3) -> PagedCase:
    """Pages holding sequences of the given lengths (0 = a padding sequence)."""
    pages_of = [-(-n // page_size) for n in kv_lens]
    width = max(max(pages_of), 1) + extra_width
    num_pages = sum(pages_of) + spare_pages
    physical = rng.permutation(num_pages)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = rng.uniform(-GARBAGE, GARBAGE, shape).astype(np.float32)
    v_pages = rng.uniform(-GARBAGE, GARBAGE, shape).astype(np.float32)
    block_tables = rng.integers(0, num_pages, (len(kv_lens), width)).astype(np.int32)
    keys, values, used, slots_of = [], [], 0, []
    for s, (n, npg) in enumerate(zip(kv_lens, pages_of)):
        pages = physical[used:used + npg]
        used += npg
        block_tables[s, :npg] = pages
        pos = np.arange(n)
        slots_of.append((pages[pos // page_size], pos % page_size))
        keys.append(rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32))
        values.append(rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32))
    k_scales = v_scales = None
    if kv_dtype in QMAX:
        k_pages, k_scales = quantize_np(k_pages, kv_dtype)
        v_pages, v_scales = quantize_np(v_pages, kv_dtype)
    else:
        k_pages = k_pages.astype(NP_DTYPES[kv_dtype])
        v_pages = v_pages.astype(NP_DTYPES[kv_dtype])
    for s, (page, off) in enumerate(slots_of):
        for src, pages, scales, out in ((keys, k_pages, k_scales, keys),
                                        (values, v_pages, v_scales, values)):
            x = src[s].swapaxes(0, 1)  # [KVH, n, D]
            if scales is None:
                pages[:, page, off] = x.astype(pages.dtype)
                stored = pages[:, page, off].astype(np.float64)
            else:
                qx, sx = quantize_np(x, kv_dtype)
                pages[:, page, off] = qx
                scales[:, page, off] = sx
                stored = qx.astype(np.float64) * sx[..., None].astype(np.float64)
            out[s] = stored.swapaxes(0, 1)  # what the cache really holds
    return PagedCase(k_pages, v_pages, k_scales, v_scales, block_tables,
                     np.asarray(kv_lens, np.int32), keys, values)


def attention_np(q, keys, values, positions, *, scale=None, soft_cap=None, sliding_window=None):
    """Dense float64 attention of one sequence: q [T, H, D] at positions [T] over keys/values
    [L, KVH, D]; query t sees keys at positions <= positions[t] (and > pos - window)."""
    q = np.asarray(q, np.float64)
    t_len, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    k = np.repeat(keys, group, axis=1)  # [L, H, D]
    v = np.repeat(values, group, axis=1)
    scale = head_dim ** -0.5 if scale is None else scale
    logits = np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)) * scale  # [H, T, L]
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    key = np.arange(keys.shape[0])
    visible = key[None, :] <= np.asarray(positions)[:, None]  # [T, L]
    if sliding_window is not None:
        visible &= key[None, :] > np.asarray(positions)[:, None] - sliding_window
    logits = np.where(visible[None], logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    return np.matmul(p, v.transpose(1, 0, 2)).transpose(1, 0, 2)  # [T, H, D]


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| (float64)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


# Tolerances on rel_err by q dtype, against the jnp reference (same inputs, float32 math there)
# and against float64 numpy over the values the cache holds. Measured on the CPU cases: float32
# 2e-7, bfloat16 3.7e-3 (probabilities and output rounded to bf16), float16 2.6e-4.
TOL = {"float32": 2e-6, "bfloat16": 1e-2, "float16": 1.5e-3}
QUANT_TOL_FACTOR = 2  # int8 / fp8 pages (measured 3.2e-3 with bf16 q, 9.7e-4 with fp16 q)


def tolerance(dtype: str, quantized: bool) -> float:
    return TOL[dtype] * (QUANT_TOL_FACTOR if quantized else 1)
