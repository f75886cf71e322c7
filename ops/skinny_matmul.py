"""Skinny bf16 / fp16 products for decode: y = prologue(x) @ W (+ residual), few rows (Pallas).

A decode step of a small batch multiplies a few activation rows by every weight of the model
once: the products are bound by reading the weights, and what sits around them (the RMSNorm
before q/k/v and gate/up, SiLU(gate) x up before down, the residual add after o_proj and down)
reads almost nothing but costs a kernel's start and drain each. This kernel folds those into the
product:
  * `norm_weight` (prologue): x is RMSNorm-ed first. Each program computes the rows' sums of
    squares over K (the rows are a few kilobytes, read from L2), then normalizes every x tile
    as it multiplies it, rounding as ops/rms_norm.py's reference does.
  * `gated` (prologue): x is [M, 2K] = [gate | up] and the product takes SiLU(gate) x up
    (rounded to the activation dtype, as the model's MLP does).
  * `residual` (epilogue): y = residual + round(x @ W), rounded again, as `h + linear(...)`.

Kernel: one program per column block of `block_n` outputs walks all of K, `block_k` rows at a
time: the x tile [16, BK] (rows past M masked to zero: tl.dot needs 16 rows) times the weight
tile [BK, BN] into a float32 [16, BN] accumulator on the tensor cores; Triton pipelines the
weight loads `num_stages` deep. There is no split-K, so nothing is summed after the kernel and
the epilogue is exact. K must be a multiple of block_k (a power of two dividing K is chosen).

Dispatch (`skinny_matmul`, impl None): the kernel on GPU for M <= MAX_ROWS rows of bf16 / fp16
weights whose K has a power-of-two divisor >= 64, the jnp reference elsewhere (XLA fuses what it
can). PALLASITE_MATMUL=reference|pallas|pallas_interpret overrides, as for the quantized kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.quant_tiles import _load

MAX_ROWS = 16  # the x tile is 16 rows (the smallest tl.dot)
IMPLS = ("pallas", "pallas_interpret", "reference")
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Static tiling of the skinny kernel."""

    block_n: int  # output columns per program (power of two >= 16)
    block_k: int  # K rows per loop step (power of two >= 16 dividing K)
    num_warps: int = 4
    num_stages: int = 4


def _k_block(k: int, want: int) -> int:
    """The largest power of two <= want that divides k (>= 16), or 0 if none."""
    b = want
    while b >= 16 and k % b:
        b //= 2
    return b if b >= 16 else 0


def skinny_config(m: int, k: int, n: int) -> SkinnyConfig | None:
    """The tiling heuristic, or None when the kernel cannot take K (no power-of-two divisor
    >= 16)."""
    del m
    block_k = _k_block(k, 256)
    if not block_k:
        return None
    block_n = 32 if n <= 8192 else 64
    return SkinnyConfig(block_n=block_n, block_k=block_k)


# ---- reference ------------------------------------------------------------------------------


def _norm_reference(x, weight, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _gate_reference(x):
    gate, up = jnp.split(x, 2, axis=-1)
    return jax.nn.silu(gate) * up


def skinny_matmul_reference(x, w, *, norm_weight=None, eps: float = 1e-6, gated: bool = False,
                            residual=None):
    """The jnp definition: [residual +] (prologue(x) @ W) in x's dtype."""
    if norm_weight is not None:
        x = _norm_reference(x, norm_weight, eps)
    if gated:
        x = _gate_reference(x)
    y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return y if residual is None else residual + y


# ---- kernel ---------------------------------------------------------------------------------


def _skinny_kernel(x_ref, w_ref, *refs, m: int, k: int, n: int, block_n: int, block_k: int,
                   norm: bool, gated: bool, residual: bool, eps: float):
    # x_ref: [M, K] ([M, 2K] = [gate | up] when gated); w_ref: [K, N]
    # refs: (nw_ref [K] when norm), (r_ref [M, N] when residual), o_ref [M, N]
    refs = list(refs)
    nw_ref = refs.pop(0) if norm else None
    r_ref = refs.pop(0) if residual else None
    (o_ref,) = refs
    dtype = o_ref.dtype
    rows = jnp.arange(MAX_ROWS, dtype=jnp.int32)  # [16]
    row_ok = rows < m if m < MAX_ROWS else None
    safe_rows = jnp.minimum(rows, m - 1)
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [BN]
    col_ok = cols < n if n % block_n else None
    safe_cols = jnp.minimum(cols, n - 1)
    steps = k // block_k
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def x_tile(i, offset=0):  # [16, BK] in x's dtype, masked rows 0
        kk = offset + i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        return _load(x_ref, safe_rows, kk, row_ok, None)

    scale = None
    if norm:
        def sum_squares(i, total):  # total [16] float32
            xt = x_tile(i).astype(jnp.float32)
            return total + jnp.sum(xt * xt, axis=1)

        total = jax.lax.fori_loop(0, steps, sum_squares, jnp.zeros((MAX_ROWS,), jnp.float32))
        scale = jax.lax.rsqrt(total / k + eps)  # [16]

    def body(i, acc):  # acc [16, BN] float32
        kk = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        xt = x_tile(i)
        if norm:
            nw = plgpu.load(nw_ref.at[kk]).astype(jnp.float32)  # [BK]
            xn = (xt.astype(jnp.float32) * scale[:, None]).astype(dtype).astype(jnp.float32)
            xt = (xn * nw[None, :]).astype(dtype)
        if gated:
            gate = xt.astype(jnp.float32)
            up = x_tile(i, k).astype(jnp.float32)
            silu = (gate * jax.nn.sigmoid(gate)).astype(dtype).astype(jnp.float32)
            xt = (silu * up).astype(dtype)
        wt = _load(w_ref, kk, safe_cols, None, col_ok, dtype)  # [BK, BN]
        return acc + plgpu.dot(xt, wt, precision=precision)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((MAX_ROWS, block_n), jnp.float32))
    y = acc.astype(dtype)
    mask = jnp.ones((MAX_ROWS, block_n), jnp.bool_)
    if row_ok is not None:
        mask &= row_ok[:, None]
    if col_ok is not None:
        mask &= col_ok[None, :]
    if residual:
        res = plgpu.load(r_ref.at[safe_rows[:, None], safe_cols[None, :]])
        y = (res.astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)
    out_rows = jnp.where(rows < m, rows, m)  # masked rows point past the end (not written)
    out_cols = jnp.where(cols < n, cols, n)
    plgpu.store(o_ref.at[out_rows[:, None], out_cols[None, :]], y, mask=mask)


@functools.partial(jax.jit, static_argnames=("config", "eps", "gated", "interpret"))
def _skinny_pallas(x, w, norm_weight, residual, *, config: SkinnyConfig, eps: float,
                   gated: bool, interpret: bool):
    m = x.shape[0]
    k, n = w.shape
    norm, has_res = norm_weight is not None, residual is not None
    full = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    args, in_specs = [x, w], [full(x.shape), full(w.shape)]
    if norm:
        args.append(norm_weight)
        in_specs.append(full(norm_weight.shape))
    if has_res:
        args.append(residual)
        in_specs.append(full(residual.shape))
    kernel = functools.partial(
        _skinny_kernel, m=m, k=k, n=n, block_n=config.block_n, block_k=config.block_k,
        norm=norm, gated=gated, residual=has_res, eps=eps)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(n, config.block_n),), in_specs=in_specs,
        out_specs=full((m, n)), out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret, name="skinny_matmul",
    )(*args)


def _resolve_impl(impl: str | None) -> str:
    impl = impl or os.environ.get("PALLASITE_MATMUL") or None
    if impl is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl not in IMPLS:
        raise ValueError(f"skinny_matmul: impl {impl!r} must be None or one of {IMPLS}")
    return impl


def skinny_matmul(x: jax.Array, w: jax.Array, *, norm_weight: jax.Array | None = None,
                  eps: float = 1e-6, gated: bool = False, residual: jax.Array | None = None,
                  config: SkinnyConfig | None = None, impl: str | None = None) -> jax.Array:
    """[residual +] prologue(x) @ w for a few rows, in x's dtype (float32 accumulation).

    x [M, K] ([M, 2K] = [gate | up] with `gated`); w [K, N] in x's dtype; norm_weight [K]:
    RMSNorm x first (with eps); gated: SiLU(gate) x up first; residual [M, N]. impl None: the
    Pallas kernel on GPU for M <= MAX_ROWS (module docstring), else the jnp reference;
    'pallas', 'pallas_interpret' (CPU tests) or 'reference' force one.
    """
    name = "skinny_matmul"
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"{name}: x {x.shape} and w {w.shape} must be 2-D")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"{name}: x {x.dtype} and w {w.dtype} must share a float dtype")
    m, k = x.shape[0], w.shape[0]
    n = w.shape[1]
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"{name}: x {x.shape} does not fit w {w.shape}"
                         + (" (gated: x holds [gate | up], 2K columns)" if gated else ""))
    if norm_weight is not None and (gated or norm_weight.shape != (k,)):
        raise ValueError(f"{name}: norm_weight {norm_weight.shape} must be [{k}] (and not "
                         f"gated)")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"{name}: residual {residual.shape} must be [{m}, {n}]")
    resolved = _resolve_impl(impl)
    cfg = config or skinny_config(m, k, n)
    if impl is None and (m > MAX_ROWS or cfg is None):
        resolved = "reference"
    if resolved == "reference" or m == 0:
        return skinny_matmul_reference(x, w, norm_weight=norm_weight, eps=eps, gated=gated,
                                       residual=residual)
    if m > MAX_ROWS:
        raise ValueError(f"{name}: the kernel takes at most {MAX_ROWS} rows, got {m}")
    if cfg is None or k % cfg.block_k:
        raise ValueError(f"{name}: K={k} has no power-of-two block >= 16 dividing it"
                         if cfg is None else f"{name}: block_k {cfg.block_k} must divide K={k}")
    if norm_weight is not None:
        norm_weight = norm_weight.astype(x.dtype)
    return _skinny_pallas(x, w, norm_weight, residual, config=cfg, eps=float(eps),
                          gated=gated, interpret=resolved == "pallas_interpret")
