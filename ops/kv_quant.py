"""Quantized KV pages: int8 and float8_e4m3fn rows with per-token, per-head scales.

Layout of a quantized cache, per layer (the float cache's layout plus one scale per stored row):
    values  [num_kv_heads, num_pages, page_size, head_dim]   int8 or float8_e4m3fn
    scales  [num_kv_heads, num_pages, page_size]             float32
The value a row stands for is `values[h, p, s, :] * scales[h, p, s]`. A row is quantized
symmetrically with `scale = max|x| / qmax` (qmax 127 for int8, 448 for e4m3), so its largest
entry maps to +-qmax. `QuantizedPages` carries one layer's keys (or values) through the model
in place of a float page array: the KV write (ops/paged_attention.py) quantizes new rows into
it, the attention kernel (ops/ragged_attention.py) dequantizes pages in registers, and the jnp
reference dequantizes the pages it gathers.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Largest magnitude each storage type holds; a row's largest entry is scaled onto it.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# The names of --kv_cache_dtype; "auto" is the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "bf16": jnp.dtype(jnp.bfloat16), "int8": jnp.dtype(jnp.int8),
                   "fp8": jnp.dtype(jnp.float8_e4m3fn)}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def is_quantized_kv_dtype(dtype) -> bool:
    """True for the page storage types that carry scales (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in QMAX


def kv_cache_dtype(name, model_dtype) -> jnp.dtype:
    """The storage dtype of a KV cache: name one of KV_CACHE_DTYPES ('auto': model_dtype), None
    (model_dtype), or a dtype / dtype name (float32, bfloat16, int8, float8_e4m3fn, ...)."""
    if name is None or name == "auto":
        return jnp.dtype(model_dtype)
    if isinstance(name, str) and name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not (is_quantized_kv_dtype(dtype) or jnp.issubdtype(dtype, jnp.floating)):
        raise ValueError(f"KV cache dtype {name!r} must be one of {tuple(KV_CACHE_DTYPES)} or a "
                         f"float / int8 / float8_e4m3fn dtype")
    return dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's quantized key (or value) pages: values [KVH, P, S, D] int8 / float8_e4m3fn
    and scales [KVH, P, S] float32. Shape and dtype are the values'."""

    values: jax.Array
    scales: jax.Array

    def __post_init__(self):
        values, scales = self.values, self.scales
        if not hasattr(values, "shape") or not hasattr(scales, "shape"):
            return  # a pytree of specs or tracers' stand-ins (jax transformations)
        if values.ndim != 4 or scales.shape != values.shape[:3]:
            raise ValueError(f"QuantizedPages: scales {scales.shape} must be the values' "
                             f"{values.shape[:3]} (values [KVH, P, S, D])")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


def zero_pages(shape: tuple[int, ...], dtype, sharding=None):
    """Zero pages of `shape` [KVH, P, S, D]: a float array, or QuantizedPages for int8 / fp8."""
    if not is_quantized_kv_dtype(dtype):
        return jnp.zeros(shape, dtype, device=sharding)
    return QuantizedPages(jnp.zeros(shape, dtype, device=sharding),
                          jnp.zeros(shape[:3], SCALE_DTYPE, device=sharding))


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
    """Reference dequantization: pages [KVH, P, S, D] * scales [KVH, P, S] -> [KVH, P, S, D]
    (any leading shape: scales are pages' shape less the last axis)."""
    if scales.shape != pages.shape[:-1]:
        raise ValueError(f"dequantize_pages: scales {scales.shape} must be {pages.shape[:-1]} "
                         f"for pages {pages.shape}")
    return (pages.astype(jnp.float32) * scales[..., None]).astype(dtype)
