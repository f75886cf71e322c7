"""Quantized KV cache pages: int8 and float8_e4m3fn values with per-token, per-head scales.

Layout, per layer (the float cache's layout plus one scale per stored row):
    k_pages, v_pages    [num_kv_heads, num_pages, page_size, head_dim]   int8 or float8_e4m3fn
    k_scales, v_scales  [num_kv_heads, num_pages, page_size]             float32
The value a row stands for is `pages[h, p, s, :] * scales[h, p, s]`. A new row is quantized
symmetrically with `scale = max|x| / qmax` (qmax 127 for int8, 448 for e4m3), so its largest
entry maps to +-qmax. The attention kernel (ops/ragged_attention.py)
reads these pages and dequantizes them in registers; `dequantize_pages` is the plain reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Largest magnitude each storage type holds; a row's largest entry is scaled onto it.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized_kv_dtype(dtype) -> bool:
    """True for the page storage types that carry scales (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in QMAX


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantizes rows of keys or values: x [..., D] -> (values [..., D] dtype, scales [...] f32).

    One scale per row (per token and head): scale = max|x| / qmax; an all-zero row gets scale 0
    and zero values.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in QMAX:
        raise ValueError(f"quantize_kv: dtype {dtype} is not one of {sorted(map(str, QMAX))}")
    qmax = QMAX[dtype]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax  # [...]
    safe = jnp.where(scale > 0, scale, 1.0)
    y = jnp.clip(x / safe[..., None], -qmax, qmax)  # [..., D]
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def write_kv_quantized(k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array,
                       v_scales: jax.Array, k: jax.Array, v: jax.Array,
                       slot_mapping: jax.Array):
    """Quantizes new keys and values and scatters them, with their scales, at flat slots.

    k_pages, v_pages: [KVH, P, S, D] int8 or float8_e4m3fn; k_scales, v_scales: [KVH, P, S]
    float32; k, v: [N, KVH, D] (any float dtype); slot_mapping: int32 [N], slot = page * S +
    offset, -1 (or any slot outside [0, P * S)) for padding, which is dropped.
    Returns (k_pages, v_pages, k_scales, v_scales). Donated to the enclosing jit, the scatters
    run in place (written in the 4-D page layout, as ops.paged_attention.write_kv does).
    """
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"write_kv_quantized: v_pages {v_pages.shape} {v_pages.dtype} must match "
                         f"k_pages {k_pages.shape} {k_pages.dtype}")
    if not is_quantized_kv_dtype(k_pages.dtype):
        raise ValueError(f"write_kv_quantized: pages of dtype {k_pages.dtype} are not quantized "
                         "(int8 or float8_e4m3fn)")
    if k_scales.shape != k_pages.shape[:3] or v_scales.shape != k_pages.shape[:3]:
        raise ValueError(f"write_kv_quantized: k_scales {k_scales.shape} and v_scales "
                         f"{v_scales.shape} must be {k_pages.shape[:3]} for pages {k_pages.shape}")
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"write_kv_quantized: k {k.shape} and v {v.shape} must be "
                         f"[N, {num_kv_heads}, {head_dim}] to match pages {k_pages.shape}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"write_kv_quantized: slot_mapping {slot_mapping.shape} must be "
                         f"[{k.shape[0]}]")
    kq, ks = quantize_kv(k.swapaxes(0, 1), k_pages.dtype)  # [KVH, N, D], [KVH, N]
    vq, vs = quantize_kv(v.swapaxes(0, 1), v_pages.dtype)
    out_of_range = (slot_mapping < 0) | (slot_mapping >= num_pages * page_size)
    page = jnp.where(out_of_range, num_pages, slot_mapping // page_size)  # [N]; num_pages: dropped
    offset = slot_mapping % page_size  # [N]
    k_pages = k_pages.at[:, page, offset].set(kq, mode="drop")
    v_pages = v_pages.at[:, page, offset].set(vq, mode="drop")
    k_scales = k_scales.at[:, page, offset].set(ks, mode="drop")
    v_scales = v_scales.at[:, page, offset].set(vs, mode="drop")
    return k_pages, v_pages, k_scales, v_scales


def init_quantized_pages(num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
                         dtype=jnp.int8):
    """Zero pages and scales of one layer: (k_pages, v_pages, k_scales, v_scales)."""
    if not is_quantized_kv_dtype(dtype):
        raise ValueError(f"init_quantized_pages: dtype {jnp.dtype(dtype)} is not quantized")
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    pages = jnp.zeros(shape, dtype)
    scales = jnp.zeros(shape[:3], jnp.float32)
    return pages, pages, scales, scales


def dequantize_pages(pages: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Reference dequantization: pages [KVH, P, S, D] * scales [KVH, P, S] -> [KVH, P, S, D]."""
    if scales.shape != pages.shape[:3]:
        raise ValueError(f"dequantize_pages: scales {scales.shape} must be {pages.shape[:3]} "
                         f"for pages {pages.shape}")
    return (pages.astype(jnp.float32) * scales[..., None]).astype(dtype)
