"""Single PTX instructions for Pallas kernels on the Triton backend, with jnp twins for
interpret mode (the CPU tests).

Triton does not contract Pallas's separate multiply and add into a fused multiply-add (Nsight
Compute on an H200 found no fused FP32 instruction in the int4 kernel), and
jnp.exp2 lowers to libdevice's __nv_exp2f, a library function around the hardware's
approximate exp2. In an inner loop every instruction per element counts, so the hot elementwise
steps are written as inline PTX here: the quantized kernels' multiply-adds (ops/quant_gemv.py,
ops/quant_gemv8.py, ops/gemv.py) and the attention softmax's exponent (ops/attention_tiles.py;
on the H200 a 4k-token prefill went from about 270 to 379 TFLOP/s).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def _asm(code: str, args: list, constraints: str):
    [out] = plgpu.elementwise_inline_asm(
        code, args=args, constraints=constraints, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
    return out


def fma(a, b, c, interpret: bool):
    """a * b + c (float32 arrays of one shape) rounded once: PTX fma.rn.f32 when compiled,
    plain jnp when interpreted."""
    if interpret:
        return a * b + c
    return _asm("fma.rn.f32 $0, $1, $2, $3;", [a, b, c], "=f,f,f,f")


def exp2_fma(a, b, c, interpret: bool):
    """2^(a * b + c) (float32 arrays of one shape): one fma.rn.f32 and one ex2.approx.ftz.f32
    (the hardware's exp2: relative error about 2^-22, subnormal results flushed to 0) when
    compiled; jnp when interpreted."""
    if interpret:
        return jnp.exp2(a * b + c)
    return _asm("{ .reg .f32 t; fma.rn.f32 t, $1, $2, $3; ex2.approx.ftz.f32 $0, t; }",
                [a, b, c], "=f,f,f,f")
