"""The one matmul entry point of the model's linear layers.

`linear(x, weight)` takes a plain weight array [in, out] or a quantized weight (a pytree node
from quant/, which registers its product here) and returns x @ W in x's dtype. Keeping every
linear layer behind this function is what lets quantized weights and GPU kernels plug in without
touching the model.

`TransposedWeight` holds a weight stored [out, in] (models.llama.transpose_for_gemv): float, or
INT8 / INT4 codes with their scales. `linear` multiplies by its transpose, and the model's
layers hand it to ops/gemv.py's kernel for one-token decode steps. Codes at more rows run
ops/quant_matmul.py's tensor-core kernels over the same words (layout "nk") on a GPU, and
`coded_product` (XLA) elsewhere.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ops import quant_wgmma
from ops.kernel_choice import KernelBackends, or_reference
from ops.quant_matmul import int4_matmul, int8_matmul

# Quantized weight type -> function (x, weight, kernels) -> x @ dequantize(weight).
_QUANTIZED_MATMULS: dict[type, Callable] = {}


INT8_ZERO = 128  # a symmetric INT8 code c stands for c - 128 (quant/qtensor.py)
INT4_ZERO = 8  # and a symmetric INT4 code for c - 8
INT4_PER_WORD = 8  # INT4 codes per int32 word, K position 8w + j in bits 4j..4j+3
CODE_ZEROS = {8: INT8_ZERO, 4: INT4_ZERO}  # bits -> the symmetric zero point


def code_bits(w_t: jax.Array) -> int | None:
    """Bits per code of a transposed weight's array: 8 (uint8), 4 (int32 words of eight codes),
    None for float values."""
    if w_t.dtype == jnp.uint8:
        return 8
    return 4 if w_t.dtype == jnp.int32 else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedWeight:
    """A weight [in, out] stored as its transpose w_t [out, in].

    Float: w_t holds the values. Quantized (scales given), quant/qtensor.py's codes transposed:
    w_t is uint8 [out, in] (INT8) or int32 [out, in / 8] (INT4, eight codes per word along in),
    scales (and offsets) keep their [G, out] layout, G = ceil(in / group_size); the value of
    code c is scales * (c - zero), or scales * c + offsets when asymmetric.

    k_order: how the codes lie along `in`: "natural" (column q is input q), or "wgmma" (stored
    column q is input ops.quant_wgmma.stored_k_positions(...)[q]: reordered by `reorder_k` for
    the Hopper kernel, which then reads x as it is; every other product permutes x to match).
    """

    w_t: jax.Array  # [out, in], or [out, in / 8] int32 INT4 words
    scales: jax.Array | None = None  # [G, out]
    offsets: jax.Array | None = None  # [G, out] (asymmetric codes) or None
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: per channel
    k_order: str = dataclasses.field(default="natural", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's logical shape [in, out]."""
        words = INT4_PER_WORD if code_bits(self.w_t) == 4 else 1
        return self.w_t.shape[1] * words, self.w_t.shape[0]


def stored_inputs(weight: TransposedWeight) -> np.ndarray | None:
    """The input position that each stored column of the weight's codes multiplies (numpy
    int32 [in]), None in natural order: x[..., stored_inputs] meets the codes as stored."""
    bits = code_bits(weight.w_t)
    if weight.k_order == "natural" or bits is None:
        return None
    return quant_wgmma.stored_k_positions(bits, weight.shape[0], weight.k_order)


def reorder_k(weight: TransposedWeight, k_order: str) -> TransposedWeight:
    """The same weight with its codes stored along `in` in `k_order` (see TransposedWeight):
    a permutation within blocks of ops.quant_wgmma.K_ORDER_SPAN inputs, done once (at load
    time; the Marlin kernels' repacking is the same idea). Raises ValueError for float weights,
    for groups that are not whole blocks and for an unknown order."""
    bits = code_bits(weight.w_t)
    if bits is None or weight.scales is None:
        raise ValueError("reorder_k: float weights keep the natural order (codes only)")
    k, n = weight.shape
    span = quant_wgmma.K_ORDER_SPAN[bits]
    if k_order != "natural" and weight.group_size and weight.group_size < k and (
            weight.group_size % span):
        raise ValueError(f"reorder_k: groups of {weight.group_size} are not whole blocks of "
                         f"{span} inputs (k_order {k_order!r} permutes within them)")
    if k_order == weight.k_order:
        return weight
    # new stored column q <- natural position new[q], which the old order stores at column
    # where[new[q]] (where: the inverse of the old positions)
    old = stored_inputs(weight)
    where = np.arange(k) if old is None else np.argsort(old)
    new = quant_wgmma.stored_k_positions(bits, k, k_order)
    columns = where if new is None else where[new]
    codes = jnp.take(unpack_rows(weight.w_t), jnp.asarray(columns, np.int32), axis=1)  # [N, K]
    if bits == 4:
        shifts = (4 * jnp.arange(INT4_PER_WORD, dtype=jnp.uint32))[None, None, :]
        nibbles = codes.astype(jnp.uint32).reshape(n, k // INT4_PER_WORD, INT4_PER_WORD)
        w_t = jax.lax.bitcast_convert_type(jnp.sum(nibbles << shifts, axis=2, dtype=jnp.uint32),
                                           jnp.int32)
    else:
        w_t = codes.astype(jnp.uint8)
    return dataclasses.replace(weight, w_t=w_t, k_order=k_order)


def device_k_order(weight: TransposedWeight, kernels: KernelBackends | None = None) -> str:
    """The K order in which the decode products of `kernels` read the weight's codes fastest:
    "wgmma" where kernels.k_order is "wgmma" (the Hopper kernel, ops/quant_wgmma.py) and that
    kernel takes the codes at 16 rows (it then skips its gather of x), else "natural"."""
    bits = code_bits(weight.w_t)
    if bits is None or weight.scales is None or or_reference(kernels).k_order != "wgmma":
        return "natural"
    k, n = weight.shape
    group = weight.group_size or k
    if group < k and group % quant_wgmma.K_ORDER_SPAN[bits]:
        return "natural"
    takes = quant_wgmma.supports(bits, 16, k, n, group, jnp.bfloat16, weight.scales.dtype)
    return "wgmma" if takes else "natural"


def unpack_rows(w_t: jax.Array) -> jax.Array:
    """A transposed weight's codes (or values) [N, K]: INT4 words unpacked, low nibble first."""
    if code_bits(w_t) != 4:
        return w_t
    shifts = jnp.arange(INT4_PER_WORD, dtype=jnp.uint32) * 4
    u = jax.lax.bitcast_convert_type(w_t, jnp.uint32)[..., None]
    codes = jnp.right_shift(u, shifts) & jnp.uint32(0xF)  # [N, K/8, 8]
    return codes.reshape(w_t.shape[0], -1)


def dequantize_rows(w_t: jax.Array, scales: jax.Array | None = None,
                    offsets: jax.Array | None = None, group_size: int = 0) -> jax.Array:
    """The float32 values [N, K] of a transposed weight (see TransposedWeight): w_t itself
    without scales, else its codes times their group's scale (plus offset), or minus the zero
    point first when symmetric."""
    w = unpack_rows(w_t).astype(jnp.float32)
    if scales is None:
        return w
    k = w.shape[1]

    def per_k(a):  # [G, N] -> [N, K]: each group's value over its group_size rows
        a = a.astype(jnp.float32).T
        return a if a.shape[1] == 1 else jnp.repeat(a, group_size, axis=1)[:, :k]
    if offsets is None:
        return per_k(scales) * (w - CODE_ZEROS[code_bits(w_t)])
    return per_k(scales) * w + per_k(offsets)


GROUPED_PRODUCT_MAX_ROWS = 64  # more rows: dequantize the weight once, then one product


def coded_product(x: jax.Array, weight: TransposedWeight) -> jax.Array:
    """x [..., K] @ a transposed weight of codes -> [..., N] float32, in XLA (steps the
    ops/gemv.py kernel does not take: more than one row, or no GPU).

    The codes enter the product as they are, converted to x's dtype (exact: at most 255), so
    XLA can fuse the conversion into its GEMM and no dequantized weight is written: per group g,
    y = scale_g (x_g @ c_g) + z_g sum(x_g), z = offsets, or -zero x scales when symmetric. Per
    channel that is one product; with groups a batched product over [G, group] while the rows
    are few (GROUPED_PRODUCT_MAX_ROWS), else the weight dequantized once and one product.
    """
    *lead, k = x.shape
    x2 = x.reshape(-1, k)  # [M, K]
    w = weight
    stored = stored_inputs(w)
    if stored is not None:  # x's columns in the codes' stored order
        x2 = jnp.take(x2, jnp.asarray(stored), axis=1)
    groups = w.scales.shape[0]
    if groups > 1 and x2.shape[0] > GROUPED_PRODUCT_MAX_ROWS:
        dense = dequantize_rows(w.w_t, w.scales, w.offsets, w.group_size).astype(x.dtype)
        y = jax.lax.dot_general(x2, dense, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y.reshape(*lead, -1)
    codes = unpack_rows(w.w_t).astype(x.dtype)  # [N, K]
    scales = w.scales.astype(jnp.float32)  # [G, N]
    z = (-CODE_ZEROS[code_bits(w.w_t)] * scales if w.offsets is None
         else w.offsets.astype(jnp.float32))  # [G, N]
    size = k if groups == 1 else w.group_size
    pad = groups * size - k  # the last group may be shorter
    xg = jnp.pad(x2, ((0, 0), (0, pad))).reshape(-1, groups, size)  # [M, G, size]
    cg = jnp.pad(codes, ((0, 0), (0, pad))).reshape(-1, groups, size)  # [N, G, size]
    yg = jnp.einsum("mgs,ngs->mgn", xg, cg, preferred_element_type=jnp.float32)  # [M, G, N]
    x_sums = jnp.sum(xg.astype(jnp.float32), axis=-1)  # [M, G]
    # elementwise float32 (not a product at the default precision, TF32 on a GPU): z's term
    # cancels most of the codes' product when symmetric
    y = jnp.sum(yg * scales + x_sums[:, :, None] * z, axis=1)  # [M, N]
    return y.reshape(*lead, -1)


def transposed_codes_product(x: jax.Array, weight: TransposedWeight,
                             kernels: KernelBackends | None = None) -> jax.Array:
    """x [..., K] @ a transposed weight of codes -> [..., N]: unless kernels.quant_matmul is
    "reference", the kernels of ops/quant_matmul.py reading the codes where they lie (layout
    'nk': the Hopper kernel or tensor-core tiles; XLA's dequantize + dot past 128 rows), else
    `coded_product`."""
    kernels = or_reference(kernels)
    if kernels.quant_matmul == "reference":
        return coded_product(x, weight)
    bits = code_bits(weight.w_t)
    product = int4_matmul if bits == 4 else int8_matmul
    return product(x, weight.w_t, weight.scales, weight.offsets,
                   group_size=weight.group_size or x.shape[-1], layout="nk",
                   k_order=weight.k_order, kernels=kernels)


def register_quantized_matmul(weight_type: type, fn: Callable) -> None:
    """Makes `linear` route weights of `weight_type` to `fn(x, weight, kernels)`."""
    _QUANTIZED_MATMULS[weight_type] = fn


def linear(x: jax.Array, weight, bias: jax.Array | None = None,
           kernels: KernelBackends | None = None) -> jax.Array:
    """x [..., in] @ weight [in, out] (+ bias [out]) -> [..., out] in x's dtype.

    Float weights: XLA's product on every platform. Codes: as kernels.quant_matmul says
    (kernels None: the XLA reference)."""
    fn = _QUANTIZED_MATMULS.get(type(weight))
    if fn is not None:
        y = fn(x, weight, kernels)
    else:
        if len(weight.shape) != 2 or x.shape[-1] != weight.shape[0]:
            raise ValueError(f"linear: x {x.shape} does not fit weight {weight.shape} [in, out]")
        if isinstance(weight, TransposedWeight) and weight.scales is not None:
            y = transposed_codes_product(x, weight, kernels)
        elif isinstance(weight, TransposedWeight):  # x @ w_t^T, no transposed copy
            y = jax.lax.dot_general(x, weight.w_t.astype(x.dtype),
                                    (((x.ndim - 1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        else:
            y = jnp.dot(x, weight.astype(x.dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
