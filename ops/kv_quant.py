"""Quantized KV values: int8 and float8_e4m3fn rows with per-token, per-head scales.

Layout of quantized pages, per layer (the float cache's layout plus one scale per stored row):
    k_pages, v_pages    [num_kv_heads, num_pages, page_size, head_dim]   int8 or float8_e4m3fn
    k_scales, v_scales  [num_kv_heads, num_pages, page_size]             float32
The value a row stands for is `pages[h, p, s, :] * scales[h, p, s]`. A row is quantized
symmetrically with `scale = max|x| / qmax` (qmax 127 for int8, 448 for e4m3), so its largest
entry maps to +-qmax. The engine keeps float pages and rounds each new row through this
quantization (ops.paged_attention.write_kv's kv_quant); the attention kernel
(ops/ragged_attention.py) also reads quantized pages, dequantizing them in registers, and
`dequantize_pages` is its plain reference.
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


def dequantize_pages(pages: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Reference dequantization: pages [KVH, P, S, D] * scales [KVH, P, S] -> [KVH, P, S, D]."""
    if scales.shape != pages.shape[:3]:
        raise ValueError(f"dequantize_pages: scales {scales.shape} must be {pages.shape[:3]} "
                         f"for pages {pages.shape}")
    return (pages.astype(jnp.float32) * scales[..., None]).astype(dtype)
