"""Weight-only INT4 / INT8 matmul for TPU (W4A16, W8A16): a Pallas Mosaic TPU kernel that reads
the packed codes of quant/qtensor.py and dequantizes them in VMEM.

Codes and scales as ops/quant_matmul.py takes them, layout [K, N]: int4 words int32 [K/8, N]
(row 8i + j of column n in bits 4j..4j+3 of word [i, n]), int8 codes uint8 [K, N]; scales (and
asymmetric offsets) [ceil(K / group_size), N]. Symmetric w = s * (c - 2^(bits-1)), asymmetric
w = s * c + offset.

Kernel: grid (row block, column block, K block), K last and sequential, with a float32
accumulator in VMEM; Pallas double-buffers each operand's blocks. A K block lies in one scale
group (block_k divides group_size), so scales apply once per block on the MXU's float32 result:
acc += (x @ (c - zero)) * s, plus rowsum(x) * offset when asymmetric; the codes minus their zero
point are small integers, exact in bf16. An int4 block of R = block_k / 8 words unpacks nibble j
of every word into rows j * R .. j * R + R - 1 of the dequantized tile (eight [R, BN] slabs
stacked), so x's columns of each K block are permuted to that order in jnp before the call
(8i + j -> j * R + i). Block sizes: rows padded to 16 (at most 256 per block), columns 512, 256
or 128 (whichever divides N), block_k 512, 256 or 128 dividing the group (per-channel: dividing K).
Shapes outside that (N or the group not a multiple of 128) take the XLA reference.
The TPU's MXU also multiplies int8 natively; this kernel keeps the activations in bf16 and
dequantizes, so one kernel serves INT4 and INT8.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ops.tpu_ragged_attention import interpret_params

LANES = 128
MAX_BLOCK_M = 256


@dataclasses.dataclass(frozen=True)
class TpuMatmulBlocks:
    block_m: int
    block_n: int
    block_k: int


def _largest_dividing(n: int, choices=(512, 256, 128)) -> int | None:
    return next((c for c in choices if n % c == 0), None)


def tpu_matmul_blocks(m: int, k: int, n: int, group_size: int) -> TpuMatmulBlocks | None:
    """Block sizes for x [m, k] @ codes [k, n] with scale groups of group_size rows (k for per
    channel), or None where the kernel does not take the shape (see the module docstring)."""
    block_n = _largest_dividing(n)
    block_k = _largest_dividing(min(group_size, k) if group_size < k else k)
    if block_n is None or block_k is None or k % block_k or (group_size < k and
                                                              group_size % block_k):
        return None
    block_m = min(MAX_BLOCK_M, -(-m // 16) * 16)
    return TpuMatmulBlocks(block_m, block_n, block_k)


def _kernel(x_ref, w_ref, s_ref, *refs, bits: int, asymmetric: bool):
    # x_ref [BM, BK] (columns permuted for int4, see the module docstring); w_ref int4 words
    # int32 [BK / 8, BN] or int8 codes uint8 [BK, BN]; s_ref (and o_ref) [1, BN] this block's
    # group; out_ref [BM, BN] x's dtype; acc_ref [BM, BN] float32 VMEM.
    if asymmetric:
        o_ref, out_ref, acc_ref = refs
    else:
        o_ref = None
        out_ref, acc_ref = refs
    kb = pl.program_id(2)

    @pl.when(kb == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    zero = 0 if asymmetric else 2 ** (bits - 1)
    if bits == 4:
        words = w_ref[...]  # [R, BN]
        slabs = [((words >> (4 * j)) & 0xF) - zero for j in range(8)]
        codes = jnp.concatenate(slabs, axis=0)  # [BK, BN], row j * R + i = K row 8i + j
    else:
        codes = w_ref[...].astype(jnp.int32) - zero  # [BK, BN]
    product = jnp.dot(x, codes.astype(x.dtype), preferred_element_type=jnp.float32)
    update = product * s_ref[...].astype(jnp.float32)  # [BM, BN]
    if asymmetric:
        row_sum = jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)  # [BM, 1]
        update = update + row_sum * o_ref[...].astype(jnp.float32)
    acc_ref[...] += update

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "blocks", "interpret"))
def _tpu_quant_matmul(x, codes, scales, offsets, *, bits: int, group_size: int,
                      blocks: TpuMatmulBlocks, interpret: bool):
    m, k = x.shape
    n = codes.shape[1]
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    rows = -(-m // bm) * bm
    x = jnp.pad(x, ((0, rows - m), (0, 0)))
    if bits == 4:  # within each K block, column 8i + j moves to j * (bk / 8) + i
        x = x.reshape(rows, k // bk, bk // 8, 8).swapaxes(2, 3).reshape(rows, k)
    group_of = lambda kb: kb * bk // group_size  # noqa: E731  the K block's scale group
    per_word = 8 if bits == 4 else 1
    in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kb: (i, kb)),
                pl.BlockSpec((bk // per_word, bn), lambda i, j, kb: (kb, j)),
                pl.BlockSpec((None, 1, bn), lambda i, j, kb: (group_of(kb), 0, j))]
    args = [x, codes, scales.reshape(-1, 1, n)]
    if offsets is not None:
        in_specs.append(pl.BlockSpec((None, 1, bn), lambda i, j, kb: (group_of(kb), 0, j)))
        args.append(offsets.reshape(-1, 1, n))
    kernel = functools.partial(_kernel, bits=bits, asymmetric=offsets is not None)
    out = pl.pallas_call(
        kernel, grid=(rows // bm, n // bn, k // bk), in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kb: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_params(interpret),
        name="tpu_quant_matmul",
    )(*args)
    return out[:m]


def tpu_quant_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array,
                     offsets: jax.Array | None = None, *, bits: int, group_size: int,
                     interpret: bool = False) -> jax.Array | None:
    """x [M, K] @ the INT4 / INT8 weight [K, N] -> [M, N] in x's dtype (float32 accumulation),
    as a Pallas TPU kernel (interpret=True: TPU interpret mode, any backend); None when the
    shape is not one the kernel takes (`tpu_matmul_blocks`), for the caller's XLA path.

    codes: int32 words [K/8, N] (bits 4) or uint8 [K, N] (bits 8); scales, offsets float
    [ceil(K / group_size), N]; group_size: rows per scale group (K: per channel).
    """
    name = "tpu_quant_matmul"
    if bits not in (4, 8):
        raise ValueError(f"{name}: bits must be 4 or 8, got {bits}")
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [M, K], got {x.shape}")
    m, k = x.shape
    per_word = 8 if bits == 4 else 1
    if codes.ndim != 2 or codes.shape[0] * per_word != k:
        raise ValueError(f"{name}: codes {codes.shape} must be [{k // per_word}, N] for x "
                         f"{x.shape} ({bits}-bit)")
    n = codes.shape[1]
    groups = -(-k // group_size)
    if scales.shape != (groups, n) or (offsets is not None and offsets.shape != (groups, n)):
        raise ValueError(f"{name}: scales {scales.shape} (and offsets) must be [{groups}, {n}] "
                         f"for group_size {group_size}")
    blocks = tpu_matmul_blocks(m, k, n, group_size)
    if blocks is None or m == 0:
        return None
    return _tpu_quant_matmul(x, codes, scales, offsets, bits=bits, group_size=group_size,
                             blocks=blocks, interpret=interpret)
