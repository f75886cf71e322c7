"""The INT8 decode path for one or two activation rows with per-channel scales: x [M, K] @
dequantize(codes uint8 [K, N]), four codes per 32-bit load.

ops/quant_gemv.py's kernel reads int8 codes one byte per element: per weight a byte load and
widening, a shift, a LOP3, a multiply and a fused multiply-add, with one weight per byte
where int4 has two. This kernel reads the same uint8 [K, N] array as int32 words [K, N/4] (a
bitcast, no copy): word c of row k holds the codes of columns 4c..4c+3, byte j for column 4c + j. Per word:

* One PRMT per code. The byte permute builds the bytes (0, c, 0x80, 0x3F) from the word and
  the bits of 1.0: the float v = 1 + c 2^-15 exactly (the code at mantissa bit p = 8,
  `CODE_POSITION`), with no shift and no integer-to-float conversion.
* One fused multiply-add per code into the accumulator of its column lane j, [R', BW] each:
  x' v = x c + x 2^15, with x' = x 2^15 (`X_SCALE`, computed outside, exact).
* No large cancellation. A tile is CHAIN = 4 sub-tiles of R' K rows; per lane one chain of
  fused multiply-adds starts from minus the sub-tiles' excess and zero-point terms,
  -(1 + 128 2^-15) (x'_1 + .. + x'_4) per row (symmetric; no zero point when asymmetric),
  and runs through the four sub-tiles' codes, so it ends at x (c - 128) summed over them,
  which one add puts into the accumulator. Cancelling the excess within each chain, not once
  per split, keeps activations of mean 1 over K = 14336 within 6e-5 of the output
  (tests/ops/test_quant_matmul.py).
* Per-channel scales (and offsets, times the split's sum of x) apply once, after the loop.

So a word of four weights costs 4 PRMT and 4 FFMA, a quarter of a 16-byte load, one add per
four codes (the chain's end), and a share of the activation loads.

Used by `int8_matmul` (ops/quant_matmul.py) for one or two rows when the scales are per
channel and N is a multiple of 4; group-wise INT8 keeps ops/quant_gemv.py's kernel. Its
reference is `int8_matmul_reference` (the tests compare both on the same packed arrays).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.ptx import fma
from ops.quant_gemv import ONE_BITS
from ops.quant_tiles import _load, _program_tiles, split_output, sum_splits

CODE_POSITION = 8  # p: a byte code's mantissa position (one PRMT puts it there)
X_SCALE = 2.0 ** (23 - CODE_POSITION)  # the kernel's activations: x 2^(23 - p)
CHAIN = 4  # sub-tiles (K rows apart) whose codes one accumulator chain sums per tile


def word_codes(word, interpret: bool) -> list:
    """The floats 1 + c_j 2^(p - 23) [R, BW] of the four byte codes c_j of int32 words
    [R, BW] (byte j = bits 8j..8j+7; p = CODE_POSITION = 8), exactly."""
    out = []
    for j in range(4):
        if interpret:
            u = jax.lax.bitcast_convert_type(word, jnp.uint32)
            code = jax.lax.shift_right_logical(u, jnp.uint32(8 * j)) & jnp.uint32(0xFF)
            bits_ = jax.lax.bitcast_convert_type((code << CODE_POSITION) | jnp.uint32(ONE_BITS),
                                                 jnp.int32)
        else:  # bytes (0, c_j, 0x80, 0x3F) from (word, 1.0's bits): one PRMT, selector 0x76j4
            [bits_] = plgpu.elementwise_inline_asm(
                f"{{ .reg .b32 one; mov.b32 one, {ONE_BITS:#010x}; "
                f"prmt.b32 $0, $1, one, 0x76{j}4; }}",
                args=[word], constraints="=r,r", pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(word.shape, jnp.int32)])
        out.append(jax.lax.bitcast_convert_type(bits_, jnp.float32))
    return out


def supports(bits: int, n: int, num_groups: int, block_k: int = CHAIN) -> bool:
    """Whether this kernel serves the product: INT8, per-channel scales, N a multiple of 4,
    block_k a multiple of CHAIN (the caller keeps it for the fma path's few rows)."""
    return bits == 8 and num_groups == 1 and n % 4 == 0 and block_k % CHAIN == 0


def _gemv8_kernel(xs_ref, w_ref, s_ref, *refs, m: int, n_words: int, rows: int, block_m: int,
                  block_w: int, step: int, num_splits: int, asymmetric: bool, interpret: bool):
    # xs_ref: [M, K] float32, x 2^(23-p) (X_SCALE; act-order already gathered)
    # w_ref:  [K, N/4] int32: the uint8 codes [K, N], byte j of word c = column 4c + j
    # s_ref:  [1, N] per-channel scales; refs: (o_ref [1, N] offsets when asymmetric), out_ref
    #         [M, N] in x's dtype (one split) or float32 (this split's partial)
    o_ref = refs[0] if asymmetric else None
    out_ref = refs[-1]
    mb = pl.program_id(0)
    wcols, wcol_ok, _, _, first, last = _program_tiles(m, n_words, rows, block_m, block_w,
                                                       step, num_splits)
    sub = step // CHAIN  # rows per sub-tile
    # Each chain starts from minus the excess of its CHAIN codes (and, symmetric, the zero
    # point's 128 x): x 2^(23-p) (1 + zero 2^(p-23)) per activation.
    start = 1.0 + (0.0 if asymmetric else 128.0) / X_SCALE

    def full(a):  # -> [R', BW]
        return jnp.broadcast_to(a, (sub, block_w))

    def body(t, carry):  # carry: block_m x (4 lane accumulators [R', BW], sum of x 2^(23-p)
        # over the split's rows when asymmetric, else None)
        tiles = []  # CHAIN sub-tiles: (rows [R'], their mask, codes per byte j [R', BW])
        for c in range(CHAIN):
            r = t * step + c * sub + jnp.arange(sub, dtype=jnp.int32)  # [R'] K rows
            r_ok = r < rows if rows % step else None
            word = _load(w_ref, r, wcols, r_ok, wcol_ok)  # [R', BW] int32
            tiles.append((r, r_ok, word_codes(word, interpret)))
        out = []
        for i, (accs, xsum) in enumerate(carry):
            row = jnp.minimum(mb * block_m + i, m - 1)
            xps = [plgpu.load(xs_ref.at[row, r]) if r_ok is None
                   else plgpu.load(xs_ref.at[row, r], mask=r_ok, other=0.0)
                   for r, r_ok, _ in tiles]  # [R'] x 2^(23-p) per sub-tile
            excess = full((-start * sum(xps[1:], xps[0]))[:, None])  # [R', BW]
            new_accs = []
            for j, acc in enumerate(accs):
                part = excess
                for xp, (_, _, codes) in zip(xps, tiles):
                    part = fma(full(xp[:, None]), codes[j], part, interpret)  # x (c - zero)
                new_accs.append(acc + part)
            if asymmetric:  # the offsets' term needs the sum of x
                xsum = xsum + sum(jnp.sum(xp) for xp in xps)
            out.append((tuple(new_accs), xsum))
        return tuple(out)

    init = tuple((tuple(jnp.zeros((sub, block_w), jnp.float32) for _ in range(4)),
                  jnp.zeros((), jnp.float32) if asymmetric else None) for _ in range(block_m))
    carry = jax.lax.fori_loop(first, last, body, init)
    first_row = jnp.zeros((1,), jnp.int32)
    for i, (accs, xsum) in enumerate(carry):
        row = mb * block_m + i
        out_row = jnp.full((1,), jnp.where(row < m, row, m), jnp.int32)  # masked: past the end
        for j, acc in enumerate(accs):
            cols = 4 * wcols + j  # [BW] output columns of lane j
            s = _load(s_ref, first_row, cols, None, wcol_ok, jnp.float32)  # [1, BW]
            result = s * jnp.sum(acc, axis=0)[None, :]
            if asymmetric:  # + offset * sum of x over this split's K rows
                result = result + _load(o_ref, first_row, cols, None, wcol_ok,
                                        jnp.float32) * (xsum / X_SCALE)
            ok = jnp.broadcast_to(row < m, result.shape)
            if wcol_ok is not None:
                ok &= wcol_ok[None, :]
            plgpu.store(out_ref.at[out_row[:, None], cols[None, :]],
                        result.astype(out_ref.dtype), mask=ok)


def gemv8_call(x, codes, scales, offsets, *, block_m: int, block_n: int, block_k: int,
               num_splits: int, num_warps: int, num_stages: int, interpret: bool):
    """x [M, K] @ dequantize(codes uint8 [K, N], per-channel scales [1, N]) -> [M, N] in x's
    dtype; block_n output columns (block_n / 4 words) and block_k K rows per program tile."""
    m, k = x.shape
    n = codes.shape[1]
    n_words = n // 4
    words = jax.lax.bitcast_convert_type(codes.reshape(k, n_words, 4), jnp.int32)  # [K, N/4]
    block_w = block_n // 4
    grid = (pl.cdiv(m, block_m), pl.cdiv(n_words, block_w), num_splits)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))  # noqa: E731
    asymmetric = offsets is not None
    args = [x.astype(jnp.float32) * X_SCALE, words, scales] + ([offsets] if asymmetric else [])
    in_specs = [full(a.shape) for a in args]
    out_shape, out_spec = split_output(m, n, num_splits, x.dtype)
    kernel = functools.partial(
        _gemv8_kernel, m=m, n_words=n_words, rows=k, block_m=block_m, block_w=block_w,
        step=block_k, num_splits=num_splits, asymmetric=asymmetric, interpret=interpret)
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int8_gemv_words",
    )(*args)
    return sum_splits(out, num_splits, x.dtype)
