"""Round-to-nearest (RTN) quantization of a [K, N] kernel, group-wise along K.

Per group of `group_size` input rows and per output column, the grid is set by the group's range:
    symmetric    scale = max|w| / (2^(bits-1) - 1), codes c = round(w / scale) + 2^(bits-1)
    asymmetric   scale = (max - min) / (2^bits - 1), offset = min, c = round((w - min) / scale)
so every weight is within half a step (scale / 2) of its dequantized value. Scales and offsets are
rounded to the storage dtype *before* the codes are chosen, so the bound holds for the stored
grid. These functions are plain jnp and run on any backend; GPTQ and AWQ reuse them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from quant.qtensor import QuantizedWeight, expand_groups, make_quantized_weight, num_groups


def resolve_group_size(group_size: int | None, in_features: int) -> int:
    """group_size <= 0 or None means one group per output channel (group_size = K)."""
    if group_size is None or group_size <= 0 or group_size >= in_features:
        return in_features
    return group_size


def grouped(w: jax.Array, group_size: int) -> jax.Array:
    """[K, N] -> [G, group_size, N]; a short last group is padded by repeating its last row."""
    k, n = w.shape
    g = num_groups(k, group_size)
    return jnp.pad(w, ((0, g * group_size - k), (0, 0)), mode="edge").reshape(g, group_size, n)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "dtype"))
def minmax_params(w: jax.Array, bits: int, group_size: int, symmetric: bool,
                  clip: jax.Array | None = None, dtype=jnp.float32):
    """(scales [G, N], offsets [G, N] or None) of RTN over groups of rows of w [K, N].

    clip [G, N] in (0, 1] shrinks each group's range (AWQ's clipping search); None keeps it.
    Returned in `dtype`, the storage dtype.
    """
    wg = grouped(w.astype(jnp.float32), group_size)  # [G, gs, N]
    if symmetric:
        absmax = jnp.max(jnp.abs(wg), axis=1)  # [G, N]
        if clip is not None:
            absmax = absmax * clip
        scales = absmax / (2 ** (bits - 1) - 1)
        offsets = None
    else:
        lo, hi = wg.min(axis=1), wg.max(axis=1)  # [G, N]
        if clip is not None:
            lo, hi = lo * clip, hi * clip
        scales = (hi - lo) / (2 ** bits - 1)
        offsets = lo.astype(dtype)
    scales = jnp.where(scales > 0, scales, 1.0).astype(dtype)  # a constant group: any scale
    return scales, offsets


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def codes_for(w: jax.Array, scales: jax.Array, offsets: jax.Array | None, bits: int,
              group_size: int) -> jax.Array:
    """Nearest codes (int32 [K, N], clipped to [0, 2^bits)) of w [K, N] on the given grid."""
    k = w.shape[0]
    s = expand_groups(scales.astype(jnp.float32), group_size, k)
    if offsets is None:
        c = jnp.round(w.astype(jnp.float32) / s) + 2 ** (bits - 1)
    else:
        c = jnp.round((w.astype(jnp.float32) - expand_groups(offsets.astype(jnp.float32),
                                                              group_size, k)) / s)
    return jnp.clip(c, 0, 2 ** bits - 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def values_for(codes: jax.Array, scales: jax.Array, offsets: jax.Array | None, bits: int,
               group_size: int) -> jax.Array:
    """Dequantized float32 [K, N] of codes [K, N] (the same formula as qtensor.dequantize)."""
    k = codes.shape[0]
    s = expand_groups(scales.astype(jnp.float32), group_size, k)
    if offsets is None:
        return s * (codes - 2 ** (bits - 1))
    return s * codes + expand_groups(offsets.astype(jnp.float32), group_size, k)


def quantize_rtn(w: jax.Array, bits: int, group_size: int | None, symmetric: bool,
                 dtype=None, clip: jax.Array | None = None) -> QuantizedWeight:
    """Round-to-nearest QuantizedWeight of a float kernel w [K, N] (scales in `dtype`, default w's)."""
    if w.ndim != 2:
        raise ValueError(f"quantize_rtn: kernel must be [in, out], got {w.shape}")
    return _quantize_rtn(w, bits, resolve_group_size(group_size, w.shape[0]), symmetric,
                         jnp.dtype(dtype or w.dtype), clip)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "dtype"))
def _quantize_rtn(w, bits, group_size, symmetric, dtype, clip):
    scales, offsets = minmax_params(w, bits, group_size, symmetric, clip, dtype)
    codes = codes_for(w, scales, offsets, bits, group_size)
    return make_quantized_weight(codes, scales, offsets, bits, group_size)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def fake_quantize(w: jax.Array, bits: int, group_size: int | None, symmetric: bool,
                  clip: jax.Array | None = None) -> jax.Array:
    """RTN then dequantize, float32 [K, N]: what the quantized kernel computes with."""
    group_size = resolve_group_size(group_size, w.shape[0])
    scales, offsets = minmax_params(w, bits, group_size, symmetric, clip)
    return values_for(codes_for(w, scales, offsets, bits, group_size), scales, offsets, bits,
                      group_size)
