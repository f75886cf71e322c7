"""The one matmul entry point of the model's linear layers.

`linear(x, weight)` takes a plain weight array [in, out] or a quantized weight (a pytree node
from quant/, which registers its product here) and returns x @ W in x's dtype. Keeping every
linear layer behind this function is what lets quantized weights and GPU kernels plug in without
touching the model.

`TransposedWeight` holds a weight stored [out, in] (models.llama.transpose_for_gemv): float, or
INT8 codes with per-output-channel scales. `linear` multiplies by its transpose, and the model's
layers hand it to ops/gemv.py's kernel for one-token decode steps.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# Quantized weight type -> function (x, weight) -> x @ dequantize(weight).
_QUANTIZED_MATMULS: dict[type, Callable] = {}


INT8_ZERO = 128  # a symmetric INT8 code c stands for c - 128 (quant/qtensor.py)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedWeight:
    """A weight [in, out] stored as its transpose w_t [out, in].

    Float: w_t holds the values. INT8 (scales given): w_t holds uint8 codes and the value of
    w_t[n, k] is scales[n] * (c - 128), or scales[n] * c + offsets[n] when asymmetric.
    """

    w_t: jax.Array  # [out, in]
    scales: jax.Array | None = None  # [out] per output channel (INT8 codes)
    offsets: jax.Array | None = None  # [out] (asymmetric INT8 codes) or None

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's logical shape [in, out]."""
        return self.w_t.shape[1], self.w_t.shape[0]


def dequantize_rows(w_t: jax.Array, scales: jax.Array | None = None,
                    offsets: jax.Array | None = None) -> jax.Array:
    """The float32 values [N, K] of a transposed weight (see TransposedWeight): w_t itself
    without scales, else its INT8 codes times the per-row scales (plus offsets)."""
    w = w_t.astype(jnp.float32)
    if scales is None:
        return w
    s = scales.astype(jnp.float32)[:, None]
    if offsets is None:
        return s * (w - INT8_ZERO)
    return s * w + offsets.astype(jnp.float32)[:, None]


def register_quantized_matmul(weight_type: type, fn: Callable) -> None:
    """Makes `linear` route weights of `weight_type` to `fn(x, weight)`."""
    _QUANTIZED_MATMULS[weight_type] = fn


def linear(x: jax.Array, weight, bias: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ weight [in, out] (+ bias [out]) -> [..., out] in x's dtype."""
    fn = _QUANTIZED_MATMULS.get(type(weight))
    if fn is not None:
        y = fn(x, weight)
    else:
        if len(weight.shape) != 2 or x.shape[-1] != weight.shape[0]:
            raise ValueError(f"linear: x {x.shape} does not fit weight {weight.shape} [in, out]")
        if isinstance(weight, TransposedWeight):  # x @ w_t^T, no transposed copy
            w_t = (weight.w_t if weight.scales is None else
                   dequantize_rows(weight.w_t, weight.scales, weight.offsets))
            y = jax.lax.dot_general(x, w_t.astype(x.dtype),
                                    (((x.ndim - 1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        else:
            y = jnp.dot(x, weight.astype(x.dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
