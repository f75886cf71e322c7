"""The quantized weight type: a pytree node of packed integer codes, scales and offsets.

A linear layer's kernel is [K, N] = [in, out] (x @ W). Quantized, it becomes a `QuantizedWeight`
whose arrays are pytree children (jit, orbax and sharding see them like any other weight) and whose
bits, group size and layout are static metadata.

Codes and what they mean
------------------------
Every weight is an unsigned integer code c in [0, 2^bits). Input rows are split into groups of
`group_size` consecutive rows (group_size = K: one group, i.e. per output channel; K need not be
a multiple of group_size: the last group is then shorter), each group with its own scale and,
when asymmetric, offset, per output column:

    symmetric   w[k, n] = scales[g, n] * (c[k, n] - 2^(bits-1))       g = k // group_size
    asymmetric  w[k, n] = scales[g, n] * c[k, n] + offsets[g, n]

The asymmetric offset is kept in float (it is -zero_point * scale) so the grid spans the group's
[min, max] exactly; both forms are one multiply-add per element once a group's scale and offset
are loaded.

Packed layouts (the `layout` field; the GPU int4/int8 matmul kernels read these arrays as is)
------------------------------------------------------------------------------------------
    "int4_k8"   packed int32 [K / 8, N]: the 8 codes of rows 8i..8i+7 of column n live in
                packed[i, n], row 8i + j in bits 4j..4j+3 (low nibble first). Packing runs along
                K, the reduction dimension, so a row of packed words is contiguous along N:
                neighbouring threads (or lanes) load neighbouring output columns with coalesced
                16-byte loads, and each 32-bit word unpacks into 8 consecutive K values with
                shifts and masks. K must be a multiple of 8.
    "int8_kn"   packed uint8 [K, N]: one code per byte, same row-major [K, N] order.
    scales      [ceil(K / group_size), N] in the model's float dtype; offsets likewise.

Activation order (GPTQ's act-order) quantizes input rows in a permuted order so that the groups
follow that order. The rows are then *stored* permuted, so groups stay contiguous in the packed
array, and `perm` (int32 [K]) records which input channel each stored row is:
    x @ W == x[..., perm] @ dequantize(packed)
so a kernel only gathers the activations' K columns once; the packed layout is unchanged.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ops.matmul import TransposedWeight, register_quantized_matmul
from ops.kernel_choice import KernelBackends, or_reference
from ops.quant_matmul import int4_matmul, int8_matmul

LAYOUT_INT4 = "int4_k8"
LAYOUT_INT8 = "int8_kn"
LAYOUTS = {4: LAYOUT_INT4, 8: LAYOUT_INT8}
PACK_INT4 = 8  # int4 codes per int32 word


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [K, N] linear kernel (see the module docstring for the layouts).

    packed   int32 [K/8, N] (int4_k8) or uint8 [K, N] (int8_kn): unsigned codes
    scales   float [G, N], G = ceil(K / group_size)
    offsets  float [G, N] (asymmetric) or None (symmetric: implied -2^(bits-1) * scale)
    perm     int32 [K] (act-order: stored row k is input channel perm[k]) or None
    """

    packed: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    perm: jax.Array | None
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(metadata=dict(static=True))

    @property
    def symmetric(self) -> bool:
        return self.offsets is None

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N) of the float kernel this weight stands for."""
        rows, n = self.packed.shape
        return (rows * PACK_INT4 if self.layout == LAYOUT_INT4 else rows), n

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(self))

    def transposed(self) -> TransposedWeight:
        """The same weight stored [N, K] for ops/gemv.py's decode kernel: INT8 codes uint8
        [N, K], INT4 words int32 [N, K/8] (the same words, transposed), scales and offsets as
        they are ([G, N]). Act-order is undone for INT8 per channel; other act-order weights
        (their groups follow the stored order) raise ValueError saying why."""
        k, n = self.shape
        codes = self.packed
        if self.perm is not None:
            if self.bits != 8 or num_groups(k, self.group_size) != 1:
                raise ValueError(f"act-order {self.bits}-bit weights in groups of "
                                 f"{self.group_size} cannot be stored transposed (their groups "
                                 "follow the permuted order)")
            codes = jnp.zeros_like(codes).at[self.perm].set(codes)  # stored row r: perm[r]
        per_channel = num_groups(k, self.group_size) == 1
        return TransposedWeight(codes.T, self.scales, self.offsets,
                                group_size=k if per_channel else self.group_size)


def pack_int4(codes: jax.Array) -> jax.Array:
    """uint/int codes [K, N] in [0, 16) -> int32 [K/8, N] (layout int4_k8)."""
    k, n = codes.shape
    if k % PACK_INT4:
        raise ValueError(f"pack_int4: K={k} must be a multiple of {PACK_INT4}")
    c = jnp.asarray(codes).astype(jnp.uint32).reshape(k // PACK_INT4, PACK_INT4, n)
    shifts = (4 * jnp.arange(PACK_INT4, dtype=jnp.uint32))[None, :, None]  # [1, 8, 1]
    words = jnp.sum(c << shifts, axis=1, dtype=jnp.uint32)  # [K/8, N], nibbles disjoint
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """int32 [K/8, N] (layout int4_k8) -> int32 codes [K, N] in [0, 16)."""
    rows, n = packed.shape
    words = jax.lax.bitcast_convert_type(packed, jnp.uint32)[:, None, :]  # [K/8, 1, N]
    shifts = (4 * jnp.arange(PACK_INT4, dtype=jnp.uint32))[None, :, None]  # [1, 8, 1]
    return ((words >> shifts) & 0xF).astype(jnp.int32).reshape(rows * PACK_INT4, n)


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Codes [K, N] in [0, 2^bits) -> the packed array of LAYOUTS[bits]."""
    if bits == 4:
        return pack_int4(codes)
    if bits == 8:
        return jnp.asarray(codes).astype(jnp.uint8)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def unpack_codes(w: QuantizedWeight) -> jax.Array:
    """The int32 codes [K, N] of `w` (rows in stored order, i.e. permuted under act-order)."""
    if w.layout == LAYOUT_INT4:
        return unpack_int4(w.packed)
    if w.layout == LAYOUT_INT8:
        return w.packed.astype(jnp.int32)
    raise ValueError(f"unknown quantized layout {w.layout!r}")


def expand_groups(per_group: jax.Array, group_size: int, in_features: int) -> jax.Array:
    """[G, N] -> [K, N]: row k gets group k // group_size.

    A broadcast and reshape, not a gather: under tensor parallelism the scales of a kernel split
    by rows then expand on each shard without moving (models/sharding.py).
    """
    groups, n = per_group.shape
    rows = jnp.broadcast_to(per_group[:, None, :], (groups, group_size, n))
    return rows.reshape(groups * group_size, n)[:in_features]


def dequantize(w: QuantizedWeight, dtype=jnp.float32, unpermute: bool = True) -> jax.Array:
    """The float kernel [K, N] that `w` stands for, in input-channel order when `unpermute`."""
    k, _ = w.shape
    codes = unpack_codes(w).astype(jnp.float32)
    scales = expand_groups(w.scales.astype(jnp.float32), w.group_size, k)
    if w.offsets is None:
        values = scales * (codes - 2 ** (w.bits - 1))
    else:
        values = scales * codes + expand_groups(w.offsets.astype(jnp.float32), w.group_size, k)
    if w.perm is not None and unpermute:
        values = jnp.zeros_like(values).at[w.perm].set(values)
    return values.astype(dtype)


def make_quantized_weight(codes, scales, offsets, bits: int, group_size: int,
                          perm=None) -> QuantizedWeight:
    """Packs codes [K, N] and wraps them with their scales / offsets [G, N] (and act-order perm)."""
    codes = jnp.asarray(codes)
    k, n = codes.shape
    g = num_groups(k, group_size)
    if scales.shape != (g, n) or (offsets is not None and offsets.shape != (g, n)):
        raise ValueError(f"scales {scales.shape} / offsets "
                         f"{None if offsets is None else offsets.shape} must be [{g}, {n}] for "
                         f"codes {codes.shape} in groups of {group_size}")
    return QuantizedWeight(
        packed=pack_codes(codes, bits), scales=jnp.asarray(scales),
        offsets=None if offsets is None else jnp.asarray(offsets),
        perm=None if perm is None else jnp.asarray(perm, jnp.int32),
        bits=bits, group_size=group_size, layout=LAYOUTS[bits])


def abstract_quantized_weight(in_features: int, out_features: int, bits: int, group_size: int,
                              symmetric: bool, act_order: bool, dtype) -> QuantizedWeight:
    """A shape-only QuantizedWeight (jax.ShapeDtypeStruct leaves), e.g. an orbax restore target."""
    g = num_groups(in_features, group_size)
    if bits == 4:
        packed = jax.ShapeDtypeStruct((in_features // PACK_INT4, out_features), jnp.int32)
    else:
        packed = jax.ShapeDtypeStruct((in_features, out_features), jnp.uint8)
    per_group = jax.ShapeDtypeStruct((g, out_features), jnp.dtype(dtype))
    return QuantizedWeight(
        packed=packed, scales=per_group, offsets=None if symmetric else per_group,
        perm=jax.ShapeDtypeStruct((in_features,), jnp.int32) if act_order else None,
        bits=bits, group_size=group_size, layout=LAYOUTS[bits])


def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [..., K] @ w -> [..., N] float32: dequantize-then-dot (the CPU path).

    Under act-order the activations are gathered into the stored row order instead of
    un-permuting the weight, exactly as a kernel over the packed layout does.
    """
    k, _ = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: x {x.shape} does not fit quantized weight [{k}, {w.shape[1]}]")
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    kernel = dequantize(w, x.dtype, unpermute=False)
    return jnp.dot(x, kernel, preferred_element_type=jnp.float32)


def quantized_matmul(x: jax.Array, w: QuantizedWeight,
                     kernels: KernelBackends | None = None) -> jax.Array:
    """x [..., K] @ w -> [..., N]: what ops.matmul.linear runs for a QuantizedWeight.

    With kernels.quant_matmul "pallas" the W4A16 / W8A16 kernels of ops/quant_matmul.py (which
    fall back to XLA's dequantize + dot where that measures faster, at large M); with
    "reference" (and kernels None), `quantized_matmul_reference`.
    """
    kernels = or_reference(kernels)
    if kernels.quant_matmul == "reference":
        return quantized_matmul_reference(x, w)
    fn = int4_matmul if w.layout == LAYOUT_INT4 else int8_matmul
    return fn(x, w.packed, w.scales, w.offsets, group_size=w.group_size, perm=w.perm,
              kernels=kernels)


register_quantized_matmul(QuantizedWeight, quantized_matmul)


def split_columns(w: QuantizedWeight, sizes) -> list[QuantizedWeight]:
    """Splits a weight quantized as one [K, sum(sizes)] kernel into [K, size] weights.

    Columns are quantized independently (each has its own scales), so q/k/v or gate/up quantized
    together (they share their inputs) split exactly.
    """
    bounds = np.cumsum([0, *sizes])
    if bounds[-1] != w.shape[1]:
        raise ValueError(f"split_columns: sizes {tuple(sizes)} do not add up to {w.shape[1]}")
    return [dataclasses.replace(
        w, packed=w.packed[:, a:b], scales=w.scales[:, a:b],
        offsets=None if w.offsets is None else w.offsets[:, a:b])
        for a, b in zip(bounds[:-1], bounds[1:])]
