"""A bf16 product for decode at batch 1 with its neighbours folded in: x [M, K] @ W^T for a
weight stored transposed, w_t [N, K] (the kernel takes any M; the model uses it for one row).

At batch 1 a Llama layer is four weight reads (q/k/v, o, gate/up, down) and around them about
eight small XLA kernels (the RMSNorms' reductions and multiplies, the split-K sums, SiLU x up,
the residual adds) of 1.3-1.7 us each: about 12 us of a 127 us layer on an H200, plus a launch
gap each (docs/PERFORMANCE.md, "Decode roofline"). XLA fuses none of them into its products. This
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

`gemv_reference` computes the same function in jnp (the tests compare both); `fused_gemv`
dispatches: the kernel on a GPU for bf16 operands and at most MAX_ROWS rows, the reference
elsewhere. The model's layers use it when their weights are stored transposed
(models/llama.py, `transpose_for_gemv`). Measured on the H200: docs/PERFORMANCE.md, "Sixteenth
session".
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.ptx import fma
from ops.quant_tiles import _load

HIGH_HALF = -65536  # int32 0xFFFF0000: the bf16 in a word's upper half, as float32 bits
MAX_ROWS = 1  # fused_gemv runs the kernel for at most this many activation rows (at two rows
# a llama3.1-8b step was 11% slower than XLA's products: docs/PERFORMANCE.md)
IMPLS = ("pallas", "pallas_interpret", "reference")


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tiles: block_n output columns (rows of w_t; of each half when gated) per program,
    block_k K positions per loop step."""
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # each loop step loads the next K tile before its own math


def gemv_config(gated: bool, norm: bool) -> GemvConfig:
    """Tiles for one row on an H200, from device-time sweeps of 54 and 27 tiles on the four
    Llama-3.1-8B layer products (docs/PERFORMANCE.md, sixteenth session): gated (gate/up)
    [4 columns of each half, 256 K] without prefetch; normed (q/k/v) [8, 512]; plain products
    (o, down) [4, 1024] with prefetch; 4 warps each. (num_stages changed nothing: Triton does
    not pipeline this loop, hence the explicit prefetch.)"""
    if gated:
        return GemvConfig(block_n=4, block_k=256, num_warps=4, num_stages=3)
    if norm:
        return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)
    return GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=1, prefetch=True)


def _words(a):
    """bf16 [..., K] (K even) -> int32 [..., K/2]: the same bytes, two values per word."""
    return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // 2, 2), jnp.int32)


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


def _gemv_kernel(x_ref, w_ref, *refs, m: int, n_out: int, k_words: int, block_n: int,
                 block_w: int, has_norm: bool, eps: float, gated: bool, has_bias: bool,
                 has_residual: bool, prefetch: bool, interpret: bool):
    # x_ref: [M, K/2] int32 (bf16 pairs); w_ref: [N, K/2] int32 (N = 2 n_out when gated);
    # refs: (nw_ref [1, K/2] int32 norm weight pairs), (b_ref [1, N] bias), (res_ref
    # [M, n_out]), out_ref [M, n_out]
    refs = list(refs)
    nw_ref = refs.pop(0) if has_norm else None
    b_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if has_residual else None
    out_ref = refs[0]
    nb = pl.program_id(0)
    cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN] output columns
    col_ok = cols < n_out if n_out % block_n else None
    row_sets = [cols, cols + n_out] if gated else [cols]  # w_t rows of each accumulator
    steps = pl.cdiv(k_words, block_w)

    def load_tile(t):  # K tile t: (weight words [BN, BW] per row set, norm weight words
        # [BW] or None, x words [BW] per x row); past the last tile every read is masked
        kw = t * block_w + jnp.arange(block_w, dtype=jnp.int32)  # [BW] word columns
        kw_ok = kw < k_words if (k_words % block_w or prefetch) else None
        words = tuple(_load(w_ref, r, kw, col_ok, kw_ok) for r in row_sets)
        norm = _load_row(nw_ref, 0, kw, kw_ok) if has_norm else None
        return words, norm, tuple(_load_row(x_ref, i, kw, kw_ok) for i in range(m))

    def body(t, carry):  # carry: (the prefetched tile or None, per x row (accumulators
        # [BN, BW] per row set, x^2 sums [BW] with a norm, else None))
        tile, rows_ = carry
        if prefetch:  # issue the next tile's loads before this tile's math
            nxt = load_tile(t + 1)
        else:
            tile, nxt = load_tile(t), None
        words, norm, xs = tile
        halves = [_halves(w) for w in words]  # [BN, BW]
        if has_norm:
            n_lo, n_hi = _halves(norm)  # [BW]
        out = []
        for (accs, sq), x_words in zip(rows_, xs):
            x_lo, x_hi = _halves(x_words)  # [BW]
            if has_norm:
                sq = fma(x_lo, x_lo, fma(x_hi, x_hi, sq, interpret), interpret)
                x_lo, x_hi = x_lo * n_lo, x_hi * n_hi
            new = []
            for acc, (w_lo, w_hi) in zip(accs, halves):
                acc = fma(w_lo, jnp.broadcast_to(x_lo[None, :], w_lo.shape), acc, interpret)
                new.append(fma(w_hi, jnp.broadcast_to(x_hi[None, :], w_hi.shape), acc,
                               interpret))
            out.append((tuple(new), sq))
        return nxt, tuple(out)

    init = tuple((tuple(jnp.zeros((block_n, block_w), jnp.float32) for _ in row_sets),
                  jnp.zeros((block_w,), jnp.float32) if has_norm else None) for _ in range(m))
    _, carry = jax.lax.fori_loop(0, steps, body, (load_tile(0) if prefetch else None, init))
    for i, (accs, sq) in enumerate(carry):
        ys = [jnp.sum(acc, axis=1) for acc in accs]  # [BN] each
        if has_norm:
            scale = jax.lax.rsqrt(jnp.sum(sq) / (2 * k_words) + eps)
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


def _check(x, w_t, norm_weight, gated: bool, bias, residual) -> int:
    """Raises ValueError naming the operand whose shape does not fit; returns n_out."""
    if x.ndim != 2 or w_t.ndim != 2 or w_t.shape[1] != x.shape[1]:
        raise ValueError(f"gemv: x {x.shape} does not fit w_t {w_t.shape} [N, K]")
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
    return n_out


def gemv(x, w_t, *, norm_weight=None, eps: float = 1e-6, gated: bool = False, bias=None,
         residual=None, config: GemvConfig | None = None, interpret: bool = False):
    """The Pallas kernel: x [M, K] @ w_t [N, K]^T, both bf16 (K even), with the options of
    the module docstring -> [M, N] ([M, N/2] when gated) in x's dtype. norm_weight [K]:
    RMSNorm of x first (eps); bias [N]; residual [M, N or N/2]: added to the output."""
    n_out = _check(x, w_t, norm_weight, gated, bias, residual)
    m, k = x.shape
    if k % 2 or x.dtype != jnp.bfloat16 or w_t.dtype != jnp.bfloat16:
        raise ValueError(f"gemv: the kernel takes bf16 x {x.shape} {x.dtype} and w_t "
                         f"{w_t.shape} {w_t.dtype} with an even K")
    args = [_words(x), _words(w_t)]
    if norm_weight is not None:
        args.append(_words(norm_weight.astype(jnp.bfloat16).reshape(1, k)))
    if bias is not None:
        args.append(bias.reshape(1, -1))
    if residual is not None:
        args.append(residual)
    cfg = config or gemv_config(gated, norm_weight is not None)
    block_w = cfg.block_k // 2
    kernel = functools.partial(
        _gemv_kernel, m=m, n_out=n_out, k_words=k // 2, block_n=cfg.block_n, block_w=block_w,
        has_norm=norm_weight is not None, eps=float(eps), gated=gated,
        has_bias=bias is not None, has_residual=residual is not None,
        prefetch=cfg.prefetch, interpret=interpret)
    full = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(n_out, cfg.block_n),), in_specs=[full(a.shape) for a in args],
        out_specs=full((m, n_out)), out_shape=jax.ShapeDtypeStruct((m, n_out), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret, name="gemv_nk",
    )(*args)


def gemv_reference(x, w_t, *, norm_weight=None, eps: float = 1e-6, gated: bool = False,
                   bias=None, residual=None):
    """`gemv` in jnp: float32 sums and products (at jax's default matmul precision, like the
    model's other products: TF32 on a GPU unless jax.default_matmul_precision says 'highest';
    exact on the CPU, where an explicit HIGHEST made the product 6x slower), rounded to x's dtype
    at the end."""
    _check(x, w_t, norm_weight, gated, bias, residual)
    h = x.astype(jnp.float32)
    if norm_weight is not None:
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
        h = h * norm_weight.astype(jnp.float32)
    y = jax.lax.dot_general(h, w_t.astype(jnp.float32), (((1,), (1,)), ((), ())))  # h @ w_t^T
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if gated:
        g, u = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(g) * u
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(x.dtype)


def fused_gemv(x, w_t, *, norm_weight=None, eps: float = 1e-6, gated: bool = False, bias=None,
               residual=None, impl: str | None = None):
    """`gemv`'s function, dispatched. impl None: PALLASITE_GEMV if set, else the kernel on a GPU
    when x and w_t are bf16, K is even and M <= MAX_ROWS, the reference otherwise; or
    'pallas', 'pallas_interpret' (CPU tests), 'reference'."""
    impl = impl or os.environ.get("PALLASITE_GEMV") or None
    if impl is None:
        fits = (x.ndim == 2 and x.shape[0] <= MAX_ROWS and x.shape[-1] % 2 == 0
                and x.dtype == jnp.bfloat16 and w_t.dtype == jnp.bfloat16)
        impl = "pallas" if fits and jax.default_backend() == "gpu" else "reference"
    if impl not in IMPLS:
        raise ValueError(f"fused_gemv: impl {impl!r} must be None or one of {IMPLS}")
    kw = dict(norm_weight=norm_weight, eps=eps, gated=gated, bias=bias, residual=residual)
    if impl == "reference":
        return gemv_reference(x, w_t, **kw)
    return gemv(x, w_t, interpret=impl == "pallas_interpret", **kw)
