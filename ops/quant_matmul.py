"""Weight-only quantized matmul, W4A16 and W8A16: x [M, K] @ dequantize(W) [K, N] (Pallas
Triton, GPU).

Weights arrive in the packed layouts of quant/qtensor.py, read as they are stored:
    int4  packed int32 [K/8, N]: rows 8i..8i+7 of column n in packed[i, n], row 8i+j in bits
          4j..4j+3. A row of words is contiguous along N, so a tile [R, BN] is R coalesced rows.
    int8  codes uint8 [K, N].
    scales (and asymmetric offsets) [ceil(K / group_size), N] in a float dtype:
          symmetric w = s * (c - 2^(bits-1)), asymmetric w = s * c + offset.
    layout "nk": the same int4 words / int8 codes stored transposed, [N, K/8] / [N, K]
          (ops.matmul.TransposedWeight, the --gemv_layers models). On a Hopper GPU, with bf16
          activations, the dispatch runs ops/quant_wgmma.py (Pallas Mosaic GPU: the
          dequantized tile is wgmma's register operand; row tiles past 64 rows). Otherwise
          the tensor-core paths ("auto" with block_m >= 16, "mma") read their tiles
          through transposed indices (ops.quant_tiles._load_codes); matmul_config gives them
          those paths from one row up.

Kernel: one program per (row block, column block, K split). It walks its slice of K one tile at a
time (block_k rows: R = block_k / 8 words for int4), dequantizes the tile in registers and
accumulates in float32:
  * Unpacking without integer-to-float conversions (a slow instruction; the dot path): nibble j
    of a word is masked in place and OR-ed under an exponent that makes its lowest bit worth 1, so
    `bitcast(bits) - magic` is exactly c - zero as a float32 (one LOP3 and one FADD per weight).
    Nibbles 4..7 come from the word shifted right by 16 (one shift per four weights).
  * The K order inside a tile is free: nibble j of R words holds rows 8i + j, so the tile is R x
    BN weights times the activation columns 8i + j (a strided load of x, which sits in cache).
    The 8 rows of a word always share a group (group_size is a multiple of 8).
  * block_m < 16 ("fma" path, decode with one or two rows): ops/quant_gemv.py, float32
    fused multiply-adds over "mantissa codes" and pre-scaled activations (its docstring).
    Per-channel INT8 with N a multiple of 4 runs ops/quant_gemv8.py instead, which reads four
    codes per 32-bit word.
  * block_m >= 16 ("dot" path): the scaled tile, cast to the activation dtype, feeds tl.dot
    (tensor cores), 8 dots of K = R per int4 tile.
  * Split-K: with num_splits > 1 each program writes a float32 partial [M, N] and the splits
    are summed in jnp (a small fused reduction).
The paths above are MatmulConfig.path "auto" (`matmul_config` runs them for M <= 2 and
17 <= M <= 128). The tensor-core path for decode, "mma" (M <= 16, the activation rows padded
to block_m >= 16 by masked loads), ops/quant_mma.py:
  * acc [BM, BN] += x [BM, R] @ w [R, BN] per code j, as the dot path.
  * Codes go straight into the activation dtype, without a float instruction: c | magic16 is
    the bit pattern of base + c (bf16 128.0 = 0x4300 for 4-bit codes, fp16 1024.0 = 0x6400 for 4-
    and 8-bit codes): a shift and one LOP3 per weight, then a 32 -> 16 bit truncation. The dot of
    x with base + c overshoots by (base + zero) x the activations' row sum over the tile, which
    is subtracted once per group on the float32 accumulator (a cancellation of about base / 8
    times fp32 epsilon, far below the bf16 rounding of the weights that the reference does).
    bf16 activations with 8-bit codes (more than bf16's 8 significant bits with the magic) and
    float32 activations take the exact float32 c - zero of the fma path, cast (no excess).
  * Group scales are applied after the dot: where a K tile lies in one group, or is whole
    groups of >= 16 packed rows (one dot chain per group), acc += s[g] * (tile - excess * xsum)
    (+ offset[g] * xsum), once per [BM, BN] and group instead of once per weight. Groups that
    cut the dot's K (group_size / 8 < 16 int4 rows with a larger tile, or not dividing it) fall
    back to scaling every weight before the dot.
For large M the product is compute-bound and XLA's dequantize-then-dot (the reference below) is
the fallback where it measured faster; `matmul_config` encodes that choice. The KernelBackends'
quant_matmul (and wgmma) choose the path.

Files: this one holds the fma / dot kernel and the dispatch; ops/quant_matmul_config.py the
configs and the tile choice; ops/quant_mma.py the tensor-core paths' kernel; ops/quant_tiles.py
the tile loads and code unpacking the kernels share.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.quant_mma import _mma_kernel
from ops import quant_gemv8, quant_wgmma
from ops.kernel_choice import KernelBackends, choose_impl, or_reference
from ops.quant_gemv import gemv_kernel, prescale
from ops.tpu_quant_matmul import tpu_quant_matmul
from ops.quant_matmul_config import (  # noqa: F401  (NUM_SMS: scripts/bench/matmul.py)
    NUM_SMS, PATHS, MatmulConfig, matmul_config)
from ops.quant_tiles import (_dequant_tile, _load, _load_codes, _program_tiles,
                              _tile_rows_and_scales, split_output, sum_splits)

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
LAYOUTS = ("kn", "nk")  # weights stored [K, N] (quant/qtensor.py) or transposed [N, K]


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _matmul_kernel(x_ref, w_ref, s_ref, *refs, bits: int, m: int, n: int, rows: int,
                   group_rows: int, num_groups: int, block_m: int, block_n: int, step: int,
                   num_splits: int, asymmetric: bool, stored_nk: bool = False):
    # The "dot" path (block_m >= 16; block_m < 16 runs ops/quant_gemv.py's kernel).
    # x_ref:  [M, K] activations (act-order already gathered), x dtype
    # w_ref:  [K/8, N] int32 (int4) or [K, N] uint8 (int8): the packed weights, `rows` rows
    #         ([N, K/8] / [N, K] when `stored_nk`)
    # s_ref:  [G, N] group scales; refs: (o_ref [G, N] offsets when asymmetric), out_ref:
    #         [M, N] in x's dtype (one split) or [M, N] float32 (this split's partial)
    o_ref = refs[0] if asymmetric else None
    out_ref = refs[-1]
    per_word = 8 if bits == 4 else 1  # K rows per packed row
    zero = 0 if asymmetric else 2 ** (bits - 1)
    cols, col_ok, x_rows, x_row_ok, first, last = _program_tiles(
        m, n, rows, block_m, block_n, step, num_splits)
    k_total = rows * per_word

    def x_cols(r, j):
        return r * per_word + j  # [R] activation columns of code j of rows r

    def body(t, acc):  # acc [BM, BN] float32
        r, r_ok, s, o = _tile_rows_and_scales(t, step, rows, group_rows, num_groups, s_ref,
                                              o_ref, cols, col_ok)  # s, o [1 or R, BN]
        word = _load_codes(w_ref, r, cols, r_ok, col_ok, stored_nk=stored_nk)  # [R, BN]
        for j in range(per_word):
            w = _dequant_tile(word, j, zero, bits)  # [R, BN] c - zero
            w = w * s + o if asymmetric else w * s
            kc = x_cols(r, j)
            k_ok = kc < k_total if r_ok is not None else None
            xj = _load(x_ref, x_rows, kc, x_row_ok, k_ok)  # [BM, R]
            acc += plgpu.dot(xj, w.astype(xj.dtype))
        return acc

    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((block_m, block_n), jnp.float32))
    mask = jnp.ones(acc.shape, jnp.bool_)
    if x_row_ok is not None:
        mask &= x_row_ok[:, None]
    if col_ok is not None:
        mask &= col_ok[None, :]
    out_rows = jnp.where(x_rows < m, x_rows, m)  # masked rows go past the end
    plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
                mask=mask)


# jitted: the unrolled layers share one trace and one lowering per shape (ARCHITECTURE.md
# "Kernel calls")
@functools.partial(jax.jit, static_argnames=("bits", "group_size", "config", "interpret",
                                             "stored_nk"))
def _pallas_matmul(x, w, scales, offsets, *, bits: int, group_size: int, config: MatmulConfig,
                   interpret: bool, stored_nk: bool = False):
    m, k = x.shape
    rows, n = w.shape[::-1] if stored_nk else w.shape
    num_groups = scales.shape[0]
    asymmetric = offsets is not None
    per_word = 8 if bits == 4 else 1
    step = config.block_k // per_word
    splits = config.num_splits
    grid = (pl.cdiv(m, config.block_m), pl.cdiv(n, config.block_n), splits)  # (rows, cols, K split)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))  # noqa: E731
    gemv = config.path == "auto" and config.block_m < 16
    if gemv and quant_gemv8.supports(bits, n, num_groups, config.block_k):
        return quant_gemv8.gemv8_call(
            x, w, scales, offsets, block_m=config.block_m, block_n=config.block_n,
            block_k=config.block_k, num_splits=splits, num_warps=config.num_warps,
            num_stages=config.num_stages, interpret=interpret)
    in_specs = [full((m, k)), full(w.shape), full((num_groups, n))]
    args = [prescale(x, bits) if gemv else x, w, scales]
    if asymmetric:
        in_specs.append(full((num_groups, n)))
        args.append(offsets)
    if gemv:  # ops/quant_gemv.py: pre-scaled float32 activations, then x itself
        in_specs.append(full((m, k)))
        args.append(x)
    out_shape, out_spec = split_output(m, n, splits, x.dtype)
    if gemv:
        body = functools.partial(gemv_kernel, interpret=interpret)
    elif config.path == "auto":
        body = functools.partial(_matmul_kernel, stored_nk=stored_nk)
    else:
        body = functools.partial(_mma_kernel, stored_nk=stored_nk)
    kernel = functools.partial(
        body, bits=bits, m=m, n=n, rows=rows, group_rows=max(1, group_size // per_word),
        num_groups=num_groups, block_m=config.block_m, block_n=config.block_n, step=step,
        num_splits=splits, asymmetric=asymmetric)
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret, name=f"int{bits}_matmul",
    )(*args)
    return sum_splits(out, splits, x.dtype)


def _check(name: str, bits: int, x, w, scales, offsets, group_size: int, perm,
           config: MatmulConfig | None, layout: str = "kn") -> tuple[int, int]:
    """Raises ValueError naming the shapes unless the operands fit; returns (K, N)."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: layout {layout!r} must be one of {LAYOUTS}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{name}: x dtype {x.dtype} must be bfloat16, float16 or float32")
    want = jnp.int32 if bits == 4 else jnp.uint8
    if w.ndim != 2 or w.dtype != want:
        raise ValueError(f"{name}: packed weights {w.shape} {w.dtype} must be 2-D {jnp.dtype(want)}")
    rows, n = w.shape[::-1] if layout == "nk" else w.shape
    k = rows * 8 if bits == 4 else rows
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"{name}: x {x.shape} does not fit packed weights {w.shape} (K = {k})")
    if group_size < 1 or (bits == 4 and group_size % 8):
        raise ValueError(f"{name}: group_size {group_size} must be >= 1"
                         + (" and a multiple of 8 (a packed word's rows share a group)"
                            if bits == 4 else ""))
    groups = -(-k // group_size)
    if scales.shape != (groups, n) or jnp.dtype(scales.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{name}: scales {scales.shape} {scales.dtype} must be float "
                         f"[{groups}, {n}] for K={k} in groups of {group_size}")
    if offsets is not None and (offsets.shape != (groups, n)
                                or jnp.dtype(offsets.dtype) not in FLOAT_DTYPES):
        raise ValueError(f"{name}: offsets {offsets.shape} {offsets.dtype} must be float "
                         f"[{groups}, {n}] like scales {scales.shape}")
    if perm is not None and (perm.shape != (k,) or not jnp.issubdtype(perm.dtype, jnp.integer)):
        raise ValueError(f"{name}: perm {perm.shape} {perm.dtype} must be integer [{k}]")
    if config is not None:
        per_word = 8 if bits == 4 else 1
        sizes = (config.block_m, config.block_n, config.block_k // per_word)
        dot = config.block_m >= 16 or config.path != "auto"
        if (not all(map(_pow2, sizes)) or config.block_k % per_word or config.num_splits < 1
                or (dot and sizes[2] < 16) or config.block_n < 16 or config.path not in PATHS
                or (config.path == "mma" and config.block_m < 16)):
            raise ValueError(f"{name}: config {config} needs power-of-two blocks, block_n >= "
                             f"16, block_k a multiple of {per_word}, path in {PATHS} and, for "
                             f"block_m >= 16 or the mma paths, block_k >= {16 * per_word} (the "
                             f"mma paths also block_m >= 16)")
        if layout == "nk" and not dot:
            raise ValueError(f"{name}: config {config}: weights stored [N, K] (layout 'nk') "
                             f"take the tensor-core paths: block_m >= 16, path auto or mma")
    return k, n


def _quantized_matmul(name, bits, x, w, scales, offsets, group_size, perm, impl, config,
                      layout="kn", k_order="natural", kernels=None):
    k, n = _check(name, bits, x, w, scales, offsets, group_size, perm, config, layout)
    if k_order != "natural" and (layout != "nk" or perm is not None):
        raise ValueError(f"{name}: k_order {k_order!r} is for codes stored [N, K] (layout 'nk') "
                         f"without act-order perm; got layout {layout!r}"
                         + (" and a perm" if perm is not None else ""))
    stored = quant_wgmma.stored_k_positions(bits, k, k_order)  # None: natural order
    stored_nk = layout == "nk"
    kernels = or_reference(kernels)
    resolved = choose_impl(name, impl, kernels.quant_matmul)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    if (stored_nk and config is None and resolved == "pallas" and impl is None
            and kernels.wgmma
            and quant_wgmma.supports(bits, m, k, n, group_size, x.dtype, scales.dtype)):
        if perm is not None:
            x2 = jnp.take(x2, perm, axis=1)  # stored row order (act-order)
        out = quant_wgmma.wgmma_matmul(x2, w, scales, offsets, bits=bits, group_size=group_size,
                                       k_order=k_order)
        return out.reshape(*lead, n)
    if stored is not None:  # the other paths read the codes as if in natural order
        x2 = jnp.take(x2, jnp.asarray(stored), axis=1)
    if kernels.tpu and resolved != "reference" and impl is None and config is None:
        # The Mosaic TPU kernel (ops/tpu_quant_matmul.py) for codes [K, N] of the shapes it
        # takes; the rest, and codes stored [N, K], take XLA's dequantize + dot.
        out = None
        if not stored_nk and m > 0:
            out = tpu_quant_matmul(x2 if perm is None else jnp.take(x2, perm, axis=1), w,
                                   scales, offsets, bits=bits, group_size=group_size,
                                   interpret=resolved == "pallas_interpret")
        if out is not None:
            return out.reshape(*lead, n)
        resolved = "reference"
    if config is None and resolved == "pallas" and impl is None and m > 0:
        config = matmul_config(bits, m, k, n, group_size, stored_nk)
        if config is None:
            resolved = "reference"  # XLA's dequantize + dot measures faster here
    if resolved == "reference" or m == 0:
        ref = int4_matmul_reference if bits == 4 else int8_matmul_reference
        out = ref(x2, w.T if stored_nk else w, scales, offsets, group_size=group_size,
                  perm=perm)
        return out.astype(x.dtype).reshape(*lead, n)
    if config is None:
        config = (matmul_config(bits, m, k, n, group_size, stored_nk)
                  or MatmulConfig(block_m=64, block_n=64, block_k=128 if bits == 4 else 32))
    if perm is not None:
        x2 = jnp.take(x2, perm, axis=1)  # stored row order (act-order)
    out = _pallas_matmul(x2, w, scales, offsets, bits=bits, group_size=group_size,
                         config=config, interpret=resolved == "pallas_interpret",
                         stored_nk=stored_nk)
    return out.reshape(*lead, n)


def int4_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array,
                offsets: jax.Array | None = None, *, group_size: int,
                perm: jax.Array | None = None, impl: str | None = None,
                config: MatmulConfig | None = None, layout: str = "kn",
                k_order: str = "natural", kernels: KernelBackends | None = None) -> jax.Array:
    """W4A16: x [..., K] @ the int4 weight [K, N] -> [..., N] in x's dtype (float32 accumulation).

    packed: int32 [K/8, N] (layout int4_k8 of quant/qtensor.py), or with layout "nk" the same
    words stored transposed, [N, K/8] (ops.matmul.TransposedWeight). scales, offsets: float
    [ceil(K / group_size), N]; without offsets w = s * (c - 8), with them w = s * c + offset.
    group_size: a multiple of 8 (K for per-channel scales; the last group may be shorter).
    perm: act-order, int32 [K]: stored row k multiplies input channel perm[k].
    impl: None (kernels.quant_matmul: "pallas" runs the Hopper kernel for codes stored [N, K]
    where kernels.wgmma and it takes the product, else the Pallas kernels with the XLA fallback
    of `matmul_config`; kernels None: the reference), 'pallas', 'pallas_interpret' (CPU tests)
    or 'reference'.
    config overrides the tuning heuristic `matmul_config`.
    k_order (layout "nk"): "natural", or "wgmma" for codes reordered along K for the Hopper
    kernel (ops.matmul.reorder_k; ops.quant_wgmma.stored_k_positions): that kernel takes x as
    it is, the other paths permute x's columns to match.
    """
    return _quantized_matmul("int4_matmul", 4, x, packed, scales, offsets, group_size, perm,
                             impl, config, layout, k_order, kernels)


def int8_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array,
                offsets: jax.Array | None = None, *, group_size: int,
                perm: jax.Array | None = None, impl: str | None = None,
                config: MatmulConfig | None = None, layout: str = "kn",
                k_order: str = "natural", kernels: KernelBackends | None = None) -> jax.Array:
    """W8A16: x [..., K] @ the int8 weight [K, N] -> [..., N] in x's dtype (float32 accumulation).

    codes: uint8 [K, N] (layout int8_kn; "nk": stored transposed, [N, K]); without offsets
    w = s * (c - 128), with them w = s * c + offset; other arguments as in `int4_matmul` (any
    group_size >= 1).
    """
    return _quantized_matmul("int8_matmul", 8, x, codes, scales, offsets, group_size, perm,
                             impl, config, layout, k_order, kernels)


# ---------------------------------------------------------------------------------------------
# References: dequantize the very same packed arrays, then one XLA dot (also the large-M path).


def _dequantize(codes, scales, offsets, group_size: int, bits: int, dtype):
    """codes int32 [K, N] -> float weights [K, N] in dtype (computed in float32)."""
    k, n = codes.shape
    groups = scales.shape[0]
    expand = lambda a: jnp.broadcast_to(  # noqa: E731  [G, N] -> [K, N]
        a.astype(jnp.float32)[:, None, :], (groups, group_size, n)).reshape(-1, n)[:k]
    c = codes.astype(jnp.float32)
    if offsets is None:
        w = expand(scales) * (c - 2 ** (bits - 1))
    else:
        w = expand(scales) * c + expand(offsets)
    return w.astype(dtype)


def int4_matmul_reference(x, packed, scales, offsets=None, *, group_size: int, perm=None):
    """x [M, K] @ dequantize(packed int32 [K/8, N]) -> [M, N] float32 (XLA dot, x's dtype)."""
    rows, n = packed.shape
    words = jax.lax.bitcast_convert_type(packed, jnp.uint32)[:, None, :]  # [K/8, 1, N]
    shifts = (4 * jnp.arange(8, dtype=jnp.uint32))[None, :, None]  # [1, 8, 1]
    codes = ((words >> shifts) & 0xF).astype(jnp.int32).reshape(rows * 8, n)  # [K, N]
    if perm is not None:
        x = jnp.take(x, perm, axis=-1)
    w = _dequantize(codes, scales, offsets, group_size, 4, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def int8_matmul_reference(x, codes, scales, offsets=None, *, group_size: int, perm=None):
    """x [M, K] @ dequantize(codes uint8 [K, N]) -> [M, N] float32 (XLA dot, x's dtype)."""
    if perm is not None:
        x = jnp.take(x, perm, axis=-1)
    w = _dequantize(codes.astype(jnp.int32), scales, offsets, group_size, 8, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)
