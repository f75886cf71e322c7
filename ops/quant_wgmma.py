"""W4A16 / W8A16 on Hopper (Pallas Mosaic GPU): x [M, K] @ W^T with the weight's codes stored
[N, K] (the "nk" layout of ops.matmul.TransposedWeight). The dispatch's kernel for such codes
on a Hopper GPU, from decode (one row tile of up to MAX_ROWS rows) to prefill (row tiles).

Why a second backend: the Triton paths of ops/quant_matmul.py reach the tensor cores only through
tl.dot, whose operand layout Triton picks, so the dequantized tile makes a trip through shared
memory. Here the product is turned round (swap AB): the weight tile is wgmma's A operand, taken
from registers right after its dequantization, and the activations are its B operand, read by the
tensor cores from shared memory:

    acc [BN, BM] (float32, wgmma accumulator) += dequant(w tile [BN, BK]) @ x tile [BM, BK]^T

BN output columns per program (64 or 128: m64 wgmmas), BM activation rows per program (all of
them padded to a multiple of 8, or `WgmmaConfig.block_m` in row tiles), BK K positions per
pipeline step. TMA copies code tiles and x's tiles into swizzled shared memory `stages` steps
ahead (emit_pipeline); one warpgroup per program. From LARGE_M_ROWS rows the warp-specialized
form (ops/quant_wgmma_ws.py: consumer warpgroups sharing each x tile) takes over.

Codes to bf16 without moving data between threads (ops/quant_wgmma_convert.py): each loaded
32-bit word becomes, in place, the registers of wgmma's A fragment, and the K order of those
registers (`wgmma_k_order`) is met by permuting x's columns (a small XLA gather), unless the codes
are stored in that order (k_order "wgmma": ops.matmul.reorder_k at load time), when x enters as
it is. Group scales multiply the dequantized tile in bf16 (the reference's rounding of s (c - z));
a step spanning several whole groups scales each part by its own group (`group_parts`).
Per-channel scales multiply the accumulator once. INT4 group offsets are added in the kernel
(s c + o, `offsets_in_kernel`); other offsets add o' times the activations' group sums in XLA.

Output: with one K split the program writes its bf16 tile transposed, straight into y [M, N]
(TMA reads zeros past x's last row and drops stores past y's, so the one-warpgroup kernel needs
no padding of x where it has fewer than 8 rows or a multiple of 8); with more splits float32
partials [splits, N, MP] that one XLA fusion sums.

Tiles and the rule of what the kernels take: ops/quant_wgmma_tiles.py. The K orders:
ops/quant_wgmma_layout.py. Used by ops/quant_matmul.py for "nk" weights on a Hopper GPU;
its reference is that file's `int4_matmul_reference` / `int8_matmul_reference` on the same codes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ops.lowering_target import abstract_gpu_kind, is_hopper
from ops.quant_wgmma_convert import (channel_scaled, codes_to_bf16, scaled_parts, store_tile,
                                     swizzled)
from ops.quant_wgmma_layout import (  # noqa: F401  (callers use quant_wgmma.X)
    K_ORDER_SPAN, K_ORDERS, stored_k_positions, wgmma_k_order)
from ops.quant_wgmma_tiles import (  # noqa: F401  (the tiles; callers use quant_wgmma.X)
    LARGE_M_ROWS, MANY_ROWS, MAX_ACC, MAX_BLOCK_M, MAX_ROWS, WS_SMEM_BYTES, WgmmaConfig,
    group_parts, row_tiling, smem_bytes, supports, sweep_configs, wgmma_config, ws_balance,
    ws_config, ws_stages)
from ops.quant_wgmma_ws import ws_product


def _kernel(x_gmem, w_gmem, s_gmem, *refs, bits: int, grouped: bool, offsets: bool,
            steps: int, block_n: int, block_k: int, group_steps: int, group_count: int,
            stages: int, block_m: int, direct: bool):
    # x_gmem [MP, K] bf16 (column c multiplies the tile's column c: wgmma_matmul orders it);
    # w_gmem [N, K] int4 / int8 codes;
    # s_gmem [G, N] scales (G = 1: per channel, applied to the accumulator at the end; else a
    # step lies in one group, group_steps steps each, or spans group_count whole groups);
    # refs: with `offsets` (INT4 groups) first o_gmem [G, N], each group's offset added to its
    # scaled codes (s c + o); then out_gmem: `direct` [MP, N] bf16 (one split: the product
    # itself, in the output's layout), else [splits, N, MP] float32 partials; out_smem: its
    # tile, [BM, BN] / [BN, BM] (BM = block_m rows of x per program, MP / BM row tiles).
    refs = list(refs)
    o_gmem = refs.pop(0) if offsets else None
    out_gmem, out_smem = refs
    nb = jax.lax.axis_index("n")
    split = jax.lax.axis_index("s")
    mb = jax.lax.axis_index("m")
    first = split * steps  # this program's first K step
    upcast, inline = codes_to_bf16(bits, block_n, block_k, unsigned=offsets)

    def compute(acc_ref):
        def step(_, w_smem, x_smem, *s_smem):
            w = inline(plgpu.load(w_smem, layout=upcast))  # c - z (c: offsets) [BN, BK]
            for part, cols in scaled_parts(  # [BN, width] @ [width, BM] per group part
                    w, group_count, plgpu.Layout.WGMMA,
                    (lambda j: s_smem[0].at[j]) if grouped else None,
                    (lambda j: s_smem[1].at[j]) if offsets else None):
                plgpu.wgmma(acc_ref, part, x_smem.at[:, cols].T)
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs,
                            max_concurrent_steps=stages)(*args)
        return acc_ref[...]

    in_specs = [
        plgpu.BlockSpec((block_n, block_k), lambda k: (nb, first + k),
                        transforms=swizzled(block_k, bits)),
        plgpu.BlockSpec((block_m, block_k), lambda k: (mb, first + k),
                        transforms=swizzled(block_k, 16)),
    ]
    args = [w_gmem, x_gmem]
    if grouped:  # the step's groups' rows of the scales (and offsets)
        for ref in (s_gmem, o_gmem) if offsets else (s_gmem,):
            in_specs.append(plgpu.BlockSpec((group_count, block_n),
                                            lambda k: ((first + k) // group_steps, nb)))
            args.append(ref)
    acc = pl.run_scoped(compute, plgpu.ACC((block_n, block_m), jnp.float32))  # [BN, BM]
    cols = pl.ds(nb * block_n, block_n)
    rows = pl.ds(mb * block_m, block_m)
    if not grouped:  # per-channel scales, once per output
        acc = channel_scaled(acc, s_gmem.at[0, cols])
    store_tile(acc, out_smem, out_gmem.at[rows, cols] if direct else out_gmem.at[split, cols, rows],
               direct)
    plgpu.wait_smem_to_gmem(0)


def on_hopper() -> bool:
    """The kernel's target is a Hopper GPU (compute capability 9.x: wgmma): the default
    backend's device, or the abstract GPU that a lowering from another host targets
    (ops.lowering_target, scripts/lower.py)."""
    abstract = abstract_gpu_kind()
    if abstract is not None:
        return is_hopper(abstract)
    return (jax.default_backend() == "gpu"
            and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))


def _one_warpgroup(xp, codes, scales, offsets=None, *, bits: int, group_size: int,
                   cfg: WgmmaConfig, direct: bool, block_m: int, out_rows: int):
    """`_kernel` over xp [M, K] and the codes [N, K] (with offsets [G, N]: added in the
    kernel, `offsets_in_kernel`): the product [MP, N] bf16 when `direct`, else float32 partials
    [splits, N, MP] (MP = out_rows, a multiple of block_m for partials). xp may hold fewer rows
    than MP when it has fewer than 8 or a multiple of 8: the last row tile's copies run past
    x, and TMA reads zeros there; a direct MP may likewise be M itself, and TMA drops the
    stores past y's rows."""
    mp, k = out_rows, xp.shape[1]
    n = codes.shape[0]
    steps_per_group, groups_per_step = group_parts(k, group_size, cfg.block_k)
    extra = () if offsets is None else (offsets,)
    kernel = functools.partial(
        _kernel, bits=bits, grouped=scales.shape[0] > 1, offsets=offsets is not None,
        steps=k // cfg.block_k // cfg.num_splits, block_n=cfg.block_n, block_k=cfg.block_k,
        group_steps=steps_per_group, group_count=groups_per_step, stages=cfg.stages,
        block_m=block_m, direct=direct)
    if direct:
        out_type = jax.ShapeDtypeStruct((mp, n), jnp.bfloat16)
        tile = plgpu.SMEM((block_m, cfg.block_n), jnp.bfloat16,
                          transforms=swizzled(cfg.block_n, 16))
    else:
        out_type = jax.ShapeDtypeStruct((cfg.num_splits, n, mp), jnp.float32)
        tile = plgpu.SMEM((cfg.block_n, block_m), jnp.float32)
    return plgpu.kernel(
        kernel, out_type=out_type, grid=(n // cfg.block_n, cfg.num_splits, -(-mp // block_m)),
        grid_names=("n", "s", "m"), scratch_types=[tile], kernel_name=f"int{bits}_wgmma",
    )(xp, codes, scales, *extra)


def offsets_in_kernel(bits: int, groups: int, dtype) -> bool:
    """Whether the kernel (one warpgroup or warp-specialized) adds offsets of `dtype` itself
    (s c + o per group part, in bf16: the reference's dequantized weight): bf16 offsets of INT4
    groups (the conversion then gives c itself). Elsewhere (INT8, per channel) XLA adds o'
    times the activations' group sums after the kernel."""
    return bits == 4 and groups > 1 and dtype == jnp.bfloat16


# jitted: the unrolled layers share one trace and one lowering per shape (ARCHITECTURE.md
# "Kernel calls")
@functools.partial(jax.jit, static_argnames=("bits", "group_size", "config", "k_order"))
def wgmma_matmul(x, w_t, scales, offsets=None, *, bits: int, group_size: int,
                 config: WgmmaConfig | None = None, k_order: str = "natural"):
    """x [M, K] bf16 @ the codes w_t (INT4: int32 words [N, K/8]; INT8: uint8 [N, K]; along K
    in `k_order`, see `stored_k_positions`) with bf16 scales (and offsets) [G, N] -> [M, N]
    bf16, float32 accumulation, on a Hopper GPU. Callers check `supports` first; this raises
    ValueError naming the shapes otherwise, or saying that the backend is not a Hopper GPU."""
    m, k = x.shape
    n = w_t.shape[0]
    cfg = config or wgmma_config(bits, m, k, n, group_size)
    if not supports(bits, m, k, n, group_size, x.dtype, scales.dtype, cfg):
        raise ValueError(f"wgmma_matmul: x {x.shape} {x.dtype}, w_t {w_t.shape}, scales "
                         f"{scales.shape} {scales.dtype}, group_size {group_size}, config "
                         f"{cfg}: needs bf16 x with at most {MAX_ROWS} rows per tile (block_m 0: "
                         f"one tile; else a multiple of 8 up to {MAX_BLOCK_M}, block_m x "
                         f"block_n <= {MAX_ACC}), N a multiple of {cfg.block_n}, bf16 scales "
                         f"and groups of whole K steps ({cfg.block_k})")
    if not on_hopper():
        raise ValueError(f"wgmma_matmul: needs a Hopper GPU (wgmma); the default backend here "
                         f"is {jax.default_backend()} ({jax.devices()[0].device_kind})")
    groups = scales.shape[0]
    block_m, mp = row_tiling(m, cfg)
    # x's column c multiplies the tile's column c: stored column `cols[c]` of the codes (the
    # conversion's K order), which holds K position `stored[cols[c]]`
    cols = wgmma_k_order(bits, k)
    stored = stored_k_positions(bits, k, k_order)
    positions = cols if stored is None else stored[cols]
    same = np.array_equal(positions, np.arange(k))  # codes stored in the "wgmma" order
    xk = x if same else jnp.take(x, jnp.asarray(positions, np.int32), axis=1)
    if bits == 4:  # the same bytes: nibble j of word w is K position 8w + j
        codes = jax.lax.bitcast_convert_type(w_t, jnp.int4).reshape(n, k)
    else:
        codes = jax.lax.bitcast_convert_type(w_t, jnp.int8)
    in_kernel = offsets is not None and offsets_in_kernel(bits, groups, offsets.dtype)
    direct = cfg.num_splits == 1 and (offsets is None or in_kernel)
    # one warpgroup: x not padded (TMA reads zeros past its rows; Mosaic's 8-row TMA tiling
    # takes fewer than 8 rows or whole multiples), and a direct y not sliced (the stores past
    # its rows are dropped); else x padded to whole row tiles [MP, K]
    ragged = not cfg.consumers and (m < 8 or m % 8 == 0)
    xp = xk if ragged else jnp.pad(xk, ((0, mp - m), (0, 0)))
    if cfg.consumers and cfg.block_m and not direct:  # float32 output tiles: fewer stages fit
        stages = ws_stages(bits, block_m, cfg.consumers * cfg.block_n, cfg.block_k, out_bytes=4)
        if not stages:
            raise ValueError(f"wgmma_matmul: config {cfg}: the float32 output tiles of "
                             f"{cfg.consumers} consumers x {block_m} rows and two pipeline "
                             f"stages exceed {WS_SMEM_BYTES} bytes of shared memory")
        cfg = dataclasses.replace(cfg, stages=min(cfg.stages, stages))
    if cfg.consumers:  # several warpgroups per SM sharing each x tile
        out = ws_product(xp, codes, scales, offsets if in_kernel else None, bits=bits,
                         group_size=group_size, cfg=cfg, block_m=block_m, direct=direct,
                         out_rows=m if direct and ragged else mp)
    else:
        out = _one_warpgroup(xp, codes, scales, offsets if in_kernel else None, bits=bits,
                             group_size=group_size, cfg=cfg, direct=direct, block_m=block_m,
                             out_rows=m if direct and ragged else mp)
    if direct:
        return out if ragged else out[:m]
    y = out.sum(axis=0)[:, :m].T  # [M, N] float32
    if offsets is not None and not in_kernel:  # o' = o + z s, times each group's sum of x
        xs = x.astype(jnp.float32)
        xsum = jnp.pad(xs, ((0, 0), (0, groups * group_size - k))).reshape(m, groups, -1)
        o = offsets.astype(jnp.float32) + 2 ** (bits - 1) * scales.astype(jnp.float32)
        y = y + jnp.dot(xsum.sum(-1), o, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
