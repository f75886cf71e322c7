"""RMSNorm: one Pallas kernel on GPU, plain jnp elsewhere.

XLA runs a decode step's RMSNorm over a few rows as two kernels (a reduction, then the
normalizing multiply), each a kernel's start and drain for a few kilobytes: for llama3.1-8b at
batch 1 on the H200, 64 of the step's 585 kernels. The kernel here does one row per program:
the sum of squares, the scale and the weight in one pass over the row held in registers.

It runs by default for KERNEL_ROWS rows: in llama3.1-8b decode steps on the H200 it made the
step 1-2% faster at 32 rows but 3% slower at one row (a single program on one SM is slower than
XLA's two small kernels), and at 256 rows XLA already emits one normalization kernel.

Numerics follow the model's definition (HF Llama): y = (x * rsqrt(mean(x^2) + eps)) rounded to
x's dtype, times the weight, in float32 math and rounded again to x's dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention_tiles as tiles
from ops.kernel_choice import KernelBackends, choose_impl, or_reference

KERNEL_ROWS = (16, 64)  # rows (tokens) for which impl=None picks the kernel on GPU (see above)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """float32 [..., 1]: each row's rsqrt(mean(x^2) + eps) over x's last axis."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., H] normalized over its last axis and scaled by weight [H] (jnp)."""
    return weight * (x.astype(jnp.float32) * rms_scale(x, eps)).astype(x.dtype)


def normed_row(x: jax.Array, scale, weight: jax.Array, dtype) -> jax.Array:
    """w * (x * scale) with rms_norm_reference's roundings, inside a kernel: x float32, scale
    its row's rms_scale, weight any float dtype -> float32 values of `dtype`."""
    y = (x * scale).astype(dtype).astype(jnp.float32)
    return (weight.astype(jnp.float32) * y).astype(dtype).astype(jnp.float32)


def _rms_norm_kernel(x_ref, w_ref, o_ref, *, hidden: int, width: int, eps: float):
    # x_ref, o_ref: [H] this program's row; w_ref: [H]
    cols = jnp.arange(width, dtype=jnp.int32)  # [W] the row, padded to a power of two
    ok = cols < hidden
    safe = jnp.where(ok, cols, 0)
    x = plgpu.load(x_ref.at[safe], mask=ok, other=0).astype(jnp.float32)  # [W]
    scale = jax.lax.rsqrt(jnp.sum(x * x) / hidden + eps)
    w = plgpu.load(w_ref.at[safe], mask=ok, other=0)
    out = jnp.where(ok, cols, hidden)  # padding columns are written past the end (dropped)
    plgpu.store(o_ref.at[out], normed_row(x, scale, w, o_ref.dtype).astype(o_ref.dtype),
                mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _rms_norm_pallas(x, weight, *, eps: float, interpret: bool):
    rows, hidden = x.shape
    width = tiles.next_pow2(hidden)
    kernel = functools.partial(_rms_norm_kernel, hidden=hidden, width=width, eps=eps)
    return pl.pallas_call(
        kernel, grid=(rows,),
        in_specs=[pl.BlockSpec((None, hidden), lambda r: (r, 0)),
                  pl.BlockSpec((hidden,), lambda r: (0,))],
        out_specs=pl.BlockSpec((None, hidden), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=min(8, max(1, width // 512)),
                                             num_stages=1),
        interpret=interpret, name="rms_norm",
    )(x, weight)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, impl: str | None = None,
             kernels: KernelBackends | None = None) -> jax.Array:
    """RMSNorm of x [N, H] (or [H]) with weight [H] in x's dtype; float32 math.

    impl: None (kernels.norm for KERNEL_ROWS rows with the weight in x's dtype, jnp otherwise;
    kernels None: jnp), 'pallas', 'pallas_interpret' (interpreted, for CPU tests) or
    'reference'.
    """
    name = "rms_norm"
    if x.ndim not in (1, 2) or weight.shape != x.shape[-1:]:
        raise ValueError(f"{name}: x {x.shape} must be [N, H] or [H] and weight {weight.shape} "
                         f"[H]")
    resolved = choose_impl(name, impl, or_reference(kernels).norm)
    rows = x.shape[0] if x.ndim == 2 else 1
    if impl is None and (weight.dtype != x.dtype
                         or not KERNEL_ROWS[0] <= rows <= KERNEL_ROWS[1]):
        resolved = "reference"
    if resolved == "reference" or x.size == 0:
        return rms_norm_reference(x, weight, eps)
    out = _rms_norm_pallas(x.reshape(-1, x.shape[-1]), weight, eps=float(eps),
                           interpret=tiles.interpret_or_gpu(resolved))
    return out.reshape(x.shape)
