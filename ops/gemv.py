"""A product for decode at batch 1 with its neighbours folded in: x [M, K] @ W^T for a weight
stored transposed, w_t [N, K], bf16 or INT8 / INT4 codes with their scales (the kernel takes any
M; the model uses it for one row).

At batch 1 a Llama layer is four weight reads (q/k/v, o, gate/up, down) and around them about
eight small XLA kernels (the RMSNorms' reductions and multiplies, the split-K sums, SiLU x up,
the residual adds) of 1.3-1.7 us each: about 12 us of a 127 us layer on an H200, plus a launch
gap each. XLA fuses none of them into its products. This
kernel reads the weight in the [N, K] layout, so that every program owns whole output columns
and walks all of K: its outputs are final, with no split-K partials, and what comes before and
after the product runs inside it:

* `norm` (RMSNorm before q/k/v and gate/up): each program reads all of x anyway, so it also
  sums x^2 along K, multiplies x by the norm's weight as it loads it, and scales its outputs by
  rsqrt(mean(x^2) + eps) at the end: norm(x) @ W^T in exact arithmetic, with float32 sums.
* `gated` (gate/up then SiLU(gate) x up): w_t is the gate rows [F, K] over the up rows [F, K];
  a program reads the same F-rows of both and writes SiLU(gate) x up [M, F].
* `residual` (o_proj and down): the program adds the residual row to its outputs.
* `bias` (a q/k/v bias, Qwen2): added after the norm's scale.

Loads: w_t and x are read as int32 words (two bf16 values, K positions 2i and 2i+1): a shift
or a mask makes each a float32 exactly, and one fused multiply-add per weight adds it into a
[BN, BK/2] accumulator that is summed over K once, at the end.

Codes (`scales` [G, N], and `offsets` [G, N] when asymmetric: quant/qtensor.py's weights,
stored transposed by QuantizedWeight.transposed; the value of code c is scale (c - zero), or
scale c + offset). INT8: w_t uint8 [N, K], read as int32 words of four codes (K positions
4w..4w+3), each made the float 1 + c 2^-15 by one PRMT (ops/quant_gemv8.py). INT4: w_t int32
[N, K/8] words of eight codes (K position 8w + j in bits 4j..4j+3, the packing of quant/), each
made 1 + c 2^(p-23) by a shared rotation and one LOP3 (ops/quant_gemv.py). Per word, one chain
of fused multiply-adds starts from minus the floats' excess (x'_j summed, plus the zero point
times x_j when symmetric; x'_j = x_j 2^(23-p)) and runs through the word's codes, ending at
x (c - zero) summed over the word: the large terms cancel within the chain, not over K.
Per-channel scales (G = 1; and offsets times the sum of x) apply once per output, at the end;
group scales (and offsets) multiply each word's chain as it is added (a group holds whole
words). Then come the norm's scale, the bias, SiLU x up and the residual.

`gemv_reference` computes the same function in jnp (the tests compare both); `fused_gemv`
dispatches: the kernel on a GPU for bf16 activations (bf16 weights or codes) and at most
MAX_ROWS rows, the reference elsewhere. The model's layers use it when their weights are stored
transposed (models/llama.py, `transpose_for_gemv`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import quant_wgmma
from ops.gemv_config import GemvConfig, gemv_config
from ops.kernel_choice import KernelBackends, choose_impl, or_reference
from ops.matmul import CODE_ZEROS, INT4_PER_WORD, code_bits, dequantize_rows
from ops.ptx import fma
from ops.quant_gemv import NIBBLE_POSITIONS, mantissa_codes
from ops.quant_gemv8 import X_SCALE, word_codes
from ops.quant_tiles import _load

HIGH_HALF = -65536  # int32 0xFFFF0000: the bf16 in a word's upper half, as float32 bits
MAX_ROWS = 1  # fused_gemv runs the kernel for at most this many activation rows (at two rows
# a llama3.1-8b step on the H200 was 11% slower than XLA's products)


def _words(a):
    """bf16 [..., K] (K even) -> int32 [..., K/2]: the same bytes, two values per word."""
    return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // 2, 2), jnp.int32)


def _code_words(codes):
    """uint8 [..., K] (K a multiple of 4) -> int32 [..., K/4]: the same bytes, code 4w + j in
    byte j (bits 8j..8j+7) of word w."""
    return jax.lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4),
                                        jnp.int32)


def _halves(word):
    """int32 words -> (float32 of the low bf16, float32 of the high bf16), exactly."""
    lo = jax.lax.bitcast_convert_type(jax.lax.shift_left(word, 16), jnp.float32)
    hi = jax.lax.bitcast_convert_type(word & HIGH_HALF, jnp.float32)
    return lo, hi


def _load_row(ref, i: int, cols, ok):
    """ref[i, cols] [len(cols)], masked by ok (None: all in bounds; masked reads are 0)."""
    if ok is None:
        return plgpu.load(ref.at[i, cols])
    return plgpu.load(ref.at[i, cols], mask=ok, other=0)


def _code_values(word, bits: int, interpret: bool) -> list:
    """The values of a tile of w_t's words [R, BW], one [R, BW] float32 per K position of a word:
    bf16 values exactly (bits 16), else the floats 1 + c 2^(p_j - 23) of the codes c (p_j:
    CODE_FACTORS' positions)."""
    if bits == 16:
        return list(_halves(word))
    return word_codes(word, interpret) if bits == 8 else mantissa_codes(word, 4, interpret)


# per K position of a word: the factor 2^(23 - p_j) that makes x' (1 + c 2^(p_j - 23)) = x' + x c
CODE_FACTORS = {8: (X_SCALE,) * 4, 4: tuple(2.0 ** (23 - p) for p in NIBBLE_POSITIONS)}


def _x_words(kw, bits: int, k_order: str) -> list:
    """The x words (bf16 pairs) that the K positions of code words kw [BW] multiply, one [BW]
    index array per pair, in the order of `_in_word_order`: natural, the pairs P/2 kw + i
    (P positions per word); "wgmma" (ops.quant_wgmma.stored_k_positions), in each block of
    K_ORDER_SPAN positions the pairs t + 4i of word t (INT4: words t = 0..3 of 32 positions;
    INT8: of 16, t the word's index with its two bits swapped)."""
    per_word = 32 // bits
    if k_order == "natural" or bits == 16:
        return [per_word // 2 * kw + i for i in range(per_word // 2)]
    words = 4  # code words per block, both widths
    block, t = kw // words, kw % words
    if bits == 8:
        t = t % 2 * 2 + t // 2
    pairs = quant_wgmma.K_ORDER_SPAN[bits] // 2
    return [pairs * block + t + 4 * i for i in range(per_word // 2)]


def _in_word_order(values: list, bits: int, k_order: str) -> list:
    """The x values of `_x_words` (pair i's low then high half: 2i + h) in the order of the
    word's K positions. "wgmma" INT4: nibble 4h + j holds pair j's half h."""
    if k_order == "natural" or bits != 4:
        return values
    return [values[2 * (n % 4) + n // 4] for n in range(len(values))]


def _gemv_kernel(x_ref, w_ref, *refs, m: int, n_out: int, k: int, k_words: int, block_n: int,
                 block_w: int, has_norm: bool, eps: float, gated: bool, bits: int,
                 group_size: int, asymmetric: bool, has_bias: bool, has_residual: bool,
                 prefetch: bool, interpret: bool, k_order: str = "natural"):
    # x_ref: [M, K/2] int32 (bf16 pairs); w_ref: [N, K/P] int32, P = 32 / bits K positions per
    # word (bf16 pairs, four uint8 codes, or eight int4 codes; position P w + j in slot j);
    # N = 2 n_out when gated. refs: (nw_ref [1, K/2] int32 norm weight pairs), (s_ref [G, N]
    # scales, (o_ref [G, N] offsets)), (b_ref [1, N] bias), (res_ref [M, n_out]), out_ref
    # [M, n_out]. G = 1 (per channel: scales applied once at the end) or ceil(K / group_size)
    # (grouped: each word's chain is scaled by its group's scale as it is added).
    codes = bits != 16
    refs = list(refs)
    nw_ref = refs.pop(0) if has_norm else None
    s_ref = refs.pop(0) if codes else None
    o_ref = refs.pop(0) if asymmetric else None
    b_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if has_residual else None
    out_ref = refs[0]
    per_word = 32 // bits
    grouped = codes and group_size < k
    nb = pl.program_id(0)
    cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN] output columns
    col_ok = cols < n_out if n_out % block_n else None
    row_sets = [cols, cols + n_out] if gated else [cols]  # w_t rows of each accumulator
    steps = pl.cdiv(k_words, block_w)

    def load_tile(t):  # K tile t: (weight words [BN, BW] per row set, group scales / offsets
        # [BN, BW] per row set or None, norm weight words per x word, x words [BW] per x row and
        # x word); past the last tile every read is masked
        kw = t * block_w + jnp.arange(block_w, dtype=jnp.int32)  # [BW] word columns
        kw_ok = kw < k_words if (k_words % block_w or prefetch) else None
        words = tuple(_load(w_ref, r, kw, col_ok, kw_ok) for r in row_sets)
        group = (kw * per_word) // group_size if grouped else None  # [BW]
        per_group = lambda ref: tuple(  # noqa: E731  [BN, BW] float32 per row set
            _load(ref, group, r, kw_ok, col_ok, transposed=True).astype(jnp.float32)
            for r in row_sets)
        gs = per_group(s_ref) if grouped else None
        go = per_group(o_ref) if grouped and asymmetric else None
        x_cols = _x_words(kw, bits, k_order)  # x words of a word
        norm = tuple(_load_row(nw_ref, 0, c, kw_ok) for c in x_cols) if has_norm else None
        xs = tuple(tuple(_load_row(x_ref, i, c, kw_ok) for c in x_cols) for i in range(m))
        return words, gs, go, norm, xs

    def body(t, carry):  # carry: (the prefetched tile or None, per x row (accumulators
        # [BN, BW] per row set, x^2 sums [BW] or None, x sums [BW] (per-channel asymmetric)
        # or None))
        tile, rows_ = carry
        if prefetch:  # issue the next tile's loads before this tile's math
            nxt = load_tile(t + 1)
        else:
            tile, nxt = load_tile(t), None
        words, gs, go, norm, xs = tile
        weights = [_code_values(w, bits, interpret) for w in words]  # [BN, BW] per position
        if has_norm:  # [BW] per position j
            nws = _in_word_order([v for w in norm for v in _halves(w)], bits, k_order)
        out = []
        for (accs, sq, xsum), x_words in zip(rows_, xs):
            xv = _in_word_order([v for w in x_words for v in _halves(w)], bits, k_order)
            if has_norm:
                for v in xv:
                    sq = fma(v, v, sq, interpret)
                xv = [v * nv for v, nv in zip(xv, nws)]
            if not codes:
                new = []
                for acc, (w_lo, w_hi) in zip(accs, weights):
                    acc = fma(w_lo, jnp.broadcast_to(xv[0][None, :], w_lo.shape), acc,
                              interpret)
                    new.append(fma(w_hi, jnp.broadcast_to(xv[1][None, :], w_hi.shape), acc,
                                   interpret))
                out.append((tuple(new), sq, xsum))
                continue
            # one chain per word: from minus the excess of its codes' floats (x'_j, plus the
            # zero point's x_j when symmetric) through x'_j (1 + c_j 2^(p_j - 23)), ending at
            # x_j (c_j - zero) summed over the word (x'_j = x_j 2^(23 - p_j))
            xp = [v * f for v, f in zip(xv, CODE_FACTORS[bits])]
            total = sum(xp[1:], xp[0])
            x_total = sum(xv[1:], xv[0])
            start = -total if asymmetric else -(total + CODE_ZEROS[bits] * x_total)  # [BW]
            new = []
            for a, (acc, vs) in enumerate(zip(accs, weights)):
                chain = jnp.broadcast_to(start[None, :], acc.shape)
                for v, xj in zip(vs, xp):
                    chain = fma(v, jnp.broadcast_to(xj[None, :], v.shape), chain, interpret)
                if grouped:  # the word's group scale (and offset times its sum of x)
                    acc = fma(chain, gs[a], acc, interpret)
                    if asymmetric:
                        acc = fma(go[a], jnp.broadcast_to(x_total[None, :], acc.shape), acc,
                                  interpret)
                    new.append(acc)
                else:
                    new.append(acc + chain)
            if asymmetric and not grouped:
                xsum = xsum + x_total
            out.append((tuple(new), sq, xsum))
        return nxt, tuple(out)

    vector = lambda: jnp.zeros((block_w,), jnp.float32)  # noqa: E731
    init = tuple((tuple(jnp.zeros((block_n, block_w), jnp.float32) for _ in row_sets),
                  vector() if has_norm else None,
                  vector() if asymmetric and not grouped else None) for _ in range(m))
    _, carry = jax.lax.fori_loop(0, steps, body, (load_tile(0) if prefetch else None, init))
    for i, (accs, sq, xsum) in enumerate(carry):
        ys = [jnp.sum(acc, axis=1) for acc in accs]  # [BN] each
        if codes and not grouped:  # per-channel scales (and offsets times the sum of x), once
            ys = [y * _load_row(s_ref, 0, r, col_ok).astype(jnp.float32) for y, r in
                  zip(ys, row_sets)]
            if asymmetric:
                x_total = jnp.sum(xsum)
                ys = [y + x_total * _load_row(o_ref, 0, r, col_ok).astype(jnp.float32)
                      for y, r in zip(ys, row_sets)]
        if has_norm:
            scale = jax.lax.rsqrt(jnp.sum(sq) / k + eps)
            ys = [y * scale for y in ys]
        if has_bias:
            ys = [y + _load_row(b_ref, 0, r, col_ok).astype(jnp.float32)
                  for y, r in zip(ys, row_sets)]
        y = ys[0] * jax.nn.sigmoid(ys[0]) * ys[1] if gated else ys[0]
        if has_residual:
            y = y + _load_row(res_ref, i, cols, col_ok).astype(jnp.float32)
        y = y.astype(out_ref.dtype)
        if col_ok is None:
            plgpu.store(out_ref.at[i, cols], y)
        else:
            plgpu.store(out_ref.at[i, cols], y, mask=col_ok)


def _check(x, w_t, norm_weight, gated: bool, bias, residual, scales=None, offsets=None,
           group_size: int | None = None, k_order: str = "natural") -> tuple[int, int]:
    """Raises ValueError naming the operand whose shape does not fit (or the K order that
    does not); returns (n_out, the group size: K when per channel)."""
    bits = code_bits(w_t)
    if k_order not in quant_wgmma.K_ORDERS or (k_order != "natural" and bits is None):
        raise ValueError(f"gemv: k_order {k_order!r} must be one of {quant_wgmma.K_ORDERS}, "
                         "and 'natural' for bf16 weights")
    words = INT4_PER_WORD if bits == 4 else 1
    if x.ndim != 2 or w_t.ndim != 2 or w_t.shape[1] * words != x.shape[1]:
        layout = "[N, K/8] (INT4 words)" if bits == 4 else "[N, K]"
        raise ValueError(f"gemv: x {x.shape} does not fit w_t {w_t.shape} {layout}")
    m, k = x.shape
    n = w_t.shape[0]
    if gated and n % 2:
        raise ValueError(f"gemv: gated w_t {w_t.shape} needs an even N (gate over up rows)")
    n_out = n // 2 if gated else n
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"gemv: norm_weight {norm_weight.shape} is not [K] = {(k,)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias {bias.shape} is not [N] = {(n,)}")
    if residual is not None and residual.shape != (m, n_out):
        raise ValueError(f"gemv: residual {residual.shape} is not the output's {(m, n_out)}")
    if scales is None:
        if offsets is not None:
            raise ValueError("gemv: offsets without scales (offsets are for INT8/INT4 codes)")
        if bits is not None:
            raise ValueError(f"gemv: w_t {w_t.dtype} holds codes: give their scales")
        return n_out, k
    if bits is None:
        raise ValueError(f"gemv: with scales, w_t holds uint8 (INT8) or int32 (INT4) codes, "
                         f"not {w_t.dtype}")
    group_size = group_size or k
    groups = -(-k // group_size)
    for name, a in (("scales", scales), ("offsets", offsets)):
        if a is not None and a.shape != (groups, n):
            raise ValueError(f"gemv: {name} {a.shape} is not [G, N] = {(groups, n)} for groups "
                             f"of {group_size} over K = {k}")
    return n_out, group_size


def _kernel_refusal(x, w_t, group_size: int) -> str | None:
    """Why the kernel cannot take operands that passed _check (None: it can): it needs bf16 x,
    bf16 weights or codes, K a multiple of the K positions per 32-bit word, and groups of
    whole words."""
    bits = code_bits(w_t) or 16
    per_word = 32 // bits  # K positions per 32-bit word of w_t
    k = x.shape[1]
    if k % per_word or x.dtype != jnp.bfloat16 or (bits == 16 and w_t.dtype != jnp.bfloat16):
        return (f"gemv: the kernel takes bf16 x {x.shape} {x.dtype} and w_t {w_t.shape} "
                f"{w_t.dtype} (bf16 or codes) with K a multiple of {per_word}")
    if bits != 16 and group_size < k and group_size % per_word:
        return f"gemv: group_size {group_size} is not a multiple of {per_word}"
    return None


# jitted: the unrolled layers share one trace and one lowering per shape (ARCHITECTURE.md
# "Kernel calls")
@functools.partial(jax.jit, static_argnames=("eps", "gated", "group_size", "config", "interpret",
                                             "k_order"))
def gemv(x, w_t, *, norm_weight=None, eps: float = 1e-6, gated: bool = False, bias=None,
         residual=None, scales=None, offsets=None, group_size: int | None = None,
         config: GemvConfig | None = None, interpret: bool = False, k_order: str = "natural"):
    """The Pallas kernel: x [M, K] @ W^T with the options of the module docstring -> [M, N]
    ([M, N/2] when gated) in x's dtype. x bf16; w_t [N, K] bf16 (K even), or codes with scales
    [G, N] (ops.matmul.TransposedWeight): uint8 [N, K] INT8 (K a multiple of 4) or int32
    [N, K/8] INT4 words, in groups of group_size K positions (None: per channel, G = 1), with
    offsets [G, N] when asymmetric, along K in `k_order` (TransposedWeight.k_order: the kernel
    reads x's words in the codes' order). norm_weight [K]: RMSNorm of x first (eps); bias [N];
    residual [M, N or N/2]: added to the output."""
    n_out, group_size = _check(x, w_t, norm_weight, gated, bias, residual, scales, offsets,
                               group_size, k_order)
    refusal = _kernel_refusal(x, w_t, group_size)
    if refusal:
        raise ValueError(refusal)
    m, k = x.shape
    bits = code_bits(w_t) or 16
    per_word = 32 // bits  # K positions per 32-bit word of w_t
    w_words = {16: _words, 8: _code_words, 4: lambda a: a}[bits](w_t)
    args = [_words(x), w_words]
    if norm_weight is not None:
        args.append(_words(norm_weight.astype(jnp.bfloat16).reshape(1, k)))
    args += [a for a in (scales, offsets) if a is not None]
    if bias is not None:
        args.append(bias.reshape(1, -1))
    if residual is not None:
        args.append(residual)
    cfg = config or gemv_config(gated, norm_weight is not None, bits, k)
    block_w = max(cfg.block_k // per_word, 1)
    kernel = functools.partial(
        _gemv_kernel, m=m, n_out=n_out, k=k, k_words=k // per_word, block_n=cfg.block_n,
        block_w=block_w, has_norm=norm_weight is not None, eps=float(eps), gated=gated,
        bits=bits, group_size=group_size, asymmetric=offsets is not None,
        has_bias=bias is not None, has_residual=residual is not None, prefetch=cfg.prefetch,
        interpret=interpret, k_order=k_order)
    full = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(n_out, cfg.block_n),), in_specs=[full(a.shape) for a in args],
        out_specs=full((m, n_out)), out_shape=jax.ShapeDtypeStruct((m, n_out), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret, name={16: "gemv_nk", 8: "gemv8_nk", 4: "gemv4_nk"}[bits],
    )(*args)


def gemv_reference(x, w_t, *, norm_weight=None, eps: float = 1e-6, gated: bool = False,
                   bias=None, residual=None, scales=None, offsets=None,
                   group_size: int | None = None, k_order: str = "natural"):
    """`gemv` in jnp: float32 sums and products (at jax's default matmul precision, like the
    model's other products: TF32 on a GPU unless jax.default_matmul_precision says 'highest';
    exact on the CPU, where an explicit HIGHEST made the product 6x slower), rounded to x's dtype
    at the end. Codes are dequantized to float32 first (ops.matmul.dequantize_rows); codes in
    another `k_order` meet x (and the norm's weight) permuted to their stored order."""
    _, group_size = _check(x, w_t, norm_weight, gated, bias, residual, scales, offsets,
                           group_size, k_order)
    stored = quant_wgmma.stored_k_positions(code_bits(w_t), x.shape[1], k_order)
    if stored is not None:
        x = jnp.take(x, jnp.asarray(stored), axis=1)
        if norm_weight is not None:
            norm_weight = jnp.take(norm_weight, jnp.asarray(stored))
    h = x.astype(jnp.float32)
    if norm_weight is not None:
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
        h = h * norm_weight.astype(jnp.float32)
    w = dequantize_rows(w_t, scales, offsets, group_size)  # [N, K] float32
    y = jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())))  # h @ w^T
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if gated:
        g, u = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(g) * u
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(x.dtype)


APART_BITS = {"gated": (4,), "o": (), "down": (4,)}  # codes whose product runs apart at one row


def runs_apart(weight, rows: int, kernels: KernelBackends | None = None, x_dtype=jnp.bfloat16,
               product: str = "gated") -> bool:
    """Whether the model should run a one-row product (`weight`, an ops.matmul.TransposedWeight,
    of `rows` rows of x_dtype) apart, through `linear` (the Hopper kernel of ops/quant_wgmma.py),
    instead of fused here. `product`: "gated" (gate/up: RMSNorm, the product, SiLU x up) or
    "o" or "down" (the product, then the residual added in XLA, where the split-K sum takes it).
    True for the codes of APART_BITS[product] that the Hopper kernel takes (kernels.wgmma).
    Gate/up: INT4 (the Hopper kernel reads llama3.1-8b's gate/up codes at 71% of copy, this one
    at 51%); INT8's two kernels differ by about what the extra norm and SiLU kernels cost, so
    INT8 and bf16 stay fused. Down: INT4 (INT8 apart was slower end to end). o: none (apart
    added device time a step)."""
    if product not in APART_BITS:
        raise ValueError(f"runs_apart: product {product!r} must be one of {tuple(APART_BITS)}")
    bits = code_bits(weight.w_t)
    if (bits not in APART_BITS[product] or weight.scales is None
            or not or_reference(kernels).wgmma):
        return False
    k, n = weight.shape
    return quant_wgmma.supports(bits, rows, k, n, weight.group_size or k, x_dtype,
                                weight.scales.dtype)


def fused_gemv(x, w_t, *, norm_weight=None, eps: float = 1e-6, gated: bool = False, bias=None,
               residual=None, scales=None, offsets=None, group_size: int | None = None,
               impl: str | None = None, k_order: str = "natural",
               kernels: KernelBackends | None = None):
    """`gemv`'s function, dispatched. impl None: kernels.gemv when x is bf16 with M <= MAX_ROWS
    and w_t bf16 or codes that fit the kernel, the reference otherwise (kernels None: the
    reference); or 'pallas', 'pallas_interpret' (CPU tests), 'reference'."""
    if impl is None:
        fits = (x.ndim == 2 and x.shape[0] <= MAX_ROWS
                and _kernel_refusal(x, w_t, group_size or x.shape[1]) is None)
        impl = or_reference(kernels).gemv if fits else "reference"
    impl = choose_impl("fused_gemv", impl, "reference")
    kw = dict(norm_weight=norm_weight, eps=eps, gated=gated, bias=bias, residual=residual,
              scales=scales, offsets=offsets, group_size=group_size, k_order=k_order)
    if impl == "reference":
        return gemv_reference(x, w_t, **kw)
    return gemv(x, w_t, interpret=impl == "pallas_interpret", **kw)
