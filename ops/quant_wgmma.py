"""W4A16 / W8A16 on Hopper (Pallas Mosaic GPU): x [M, K] @ W^T with the weight's codes stored
[N, K] (the "nk" layout of ops.matmul.TransposedWeight); made for a few activation rows
(decode, M <= 64, one row tile), and run in row tiles for more (prefill, `block_m`).

Why a second backend: the Triton paths of ops/quant_matmul.py reach the tensor cores only
through tl.dot, whose operand layout Triton picks; the dequantized tile makes a trip through
shared memory to get there, and at 16 rows INT4 ran at about the speed of XLA's bf16 product
(docs/PERFORMANCE.md). Here the product is turned round (swap AB): the weight tile is wgmma's A
operand, taken from registers right after its dequantization, and the activations are its B
operand, read by the tensor cores from shared memory:

    acc [BN, MP] (float32, wgmma accumulator) += dequant(w tile [BN, BK]) @ x tile [MP, BK]^T

BN output columns per program (64 or 128: m64 wgmmas), MP the activation rows padded to a
multiple of 8 (wgmma's N), BK K positions per pipeline step. TMA copies code tiles and x's tiles
into swizzled shared memory `stages` steps ahead (emit_pipeline); one warpgroup per program.

Row tiles (`WgmmaConfig.block_m`, the default from MAX_ROWS to LARGE_M_ROWS rows:
`row_tile_config`): a third grid axis over tiles of block_m rows (up to 256, wgmma's largest N;
block_m x BN at most MAX_ACC accumulator elements, 128 float32 registers per thread), each
program the product above for its rows; the codes are read once per row tile. The
conversion's cost is shared by block_m rows, so the product is bound by the tensor cores: on
the H200 at 128 rows about as fast as XLA's bf16 product, at 1024 rows 0.66-0.87x of it, against
0.63-0.70x for XLA's dequantize + dot (docs/PERFORMANCE.md). From LARGE_M_ROWS rows the
warp-specialized form below takes over.

Codes to bf16 without moving data between threads. Mosaic GPU loads a code tile one 32-bit
register per thread (eight INT4 / four INT8 codes of consecutive K positions: layouts
WGMMA_UPCAST_4X / _2X); wgmma's A fragment wants, per thread, bf16 pairs at columns
(2t + 8j, 2t + 8j + 1) (t = lane mod 4), so the library's conversion shuffles codes between
lanes. But the order of K inside a product is free: `codes_to_bf16` turns each loaded word in
place into the registers the fragment needs and calls them columns 2t + 8j + h, and the caller
permutes x's columns the same way (`wgmma_k_order`; a small XLA gather of x), unless the codes
are stored in that order (`stored_k_positions`, k_order "wgmma": ops.matmul.reorder_k at load
time, like Marlin's repacking), when x enters as it is. Per pair of codes:
INT4 a shift, one LOP3 (nibbles j and j + 4 under bf16 128.0's exponent: 128 + c) and one bf16x2
subtraction of 136; INT8 a PRMT, an AND, a LOP3 and a bf16x2 subtraction (the byte's top bit
handled through the exponent: c - 128 exactly). Codes are our unsigned ones with zero point
z = 8 / 128; INT4 words [N, K/8] enter as jnp.int4 [N, K], the same bytes (a bitcast).
`convert="mosaic"` keeps the library's conversion (XOR of the sign bit, then astype), for
comparison.

Scales and offsets. Weight w = s (c - z) (+ o' with asymmetric codes, o' = o + z s). Group
scales multiply the dequantized tile in bf16 before the wgmma: exactly the bf16 rounding of
s (c - z) that the reference (`int4_matmul_reference`) makes. A step lies in one group, or
spans several whole ones (of at least MIN_GROUP_PART positions: INT4 decode steps are 256
wide, its groups 128): then each part of the tile, its group's columns, gets its own scales
and its own wgmma into the same accumulator (`group_parts`); the K order permutes columns
within 32 (INT4) or 16 (INT8), so a part's columns hold its group's positions. Per-channel
scales multiply the accumulator once, at the end. Offsets add o' times the activations' group
sums after the kernel (an [M, G] @ [G, N] product in XLA). INT4 groups under the inline
conversion take their offsets in the kernel instead (`offsets_in_kernel`): the conversion gives
the codes c themselves (a subtraction of 128 in place of 136), and each group part becomes
s c + o, the reference's dequantized weight, before its wgmma; the output is then direct like a
symmetric one's, and the XLA kernels of the group sums, their product and the add are gone.

Output: with one K split (and no offsets after the kernel) the program writes its bf16 tile
transposed, straight into y [M, N]; x is not padded to whole row tiles either: TMA reads zeros
past x's last row and drops the stores past y's (the one-warpgroup kernel, for fewer than 8
rows or a multiple of 8; the padding and slice were XLA kernels of 1.2-1.9 us each at one row).
With more splits, float32 partials [splits, N, MP] (MP: whole row tiles), that one XLA fusion
sums, slices to M rows and transposes; x is not padded for them either (same rows).

`instruction="mma"` (up to MAX_MMA_ROWS rows; not the dispatch's default: on the H200 it is
within 5% of wgmma, docs/PERFORMANCE.md): the same pipeline and conversion, multiplied by the
warp-level mma.sync m16n8k16 (Mosaic's `plgpu.mma`) instead of wgmma: each warp its own 16
weight rows, x's step tile loaded into every warp's registers (MMA_RHS), the sum carried in
registers across steps. Built to test whether each few-column wgmma carries a fixed cost
(mma.sync's N is 8); the equal times say it does not. The conversion writes its registers
straight into mma.sync's A layout (MMA_LHS): per warp the same values in the same lanes as
WGMMA's, in 16-column register tiles where WGMMA has 8-column ones (`register_relabeling`,
worked out from the two layouts by `element_coords`), so the K order and x's permutation stay
as they are.
The f32 accumulator layouts of the two instructions are the same, and so is the epilogue.

`consumers=C` (C = 2 or 3) runs the warp-specialized persistent form in
ops/quant_wgmma_ws.py instead: a TMA warpgroup and C consumer warpgroups per SM sharing each x
tile. The dispatch's from LARGE_M_ROWS rows (256-row tiles, two consumers: at 1024 rows
0.72-0.97x XLA's bf16 product on the H200, 8-12% faster than one-warpgroup row tiles); not for
decode (12-35% slower than this kernel at 1 and 16 rows).

The in-kernel building blocks (conversion, scales, store, timing probes) are in
ops/quant_wgmma_convert.py. The register layouts and K orders (`tile_layout`, `register_relabeling`, `wgmma_k_order`,
`stored_k_positions`) are in ops/quant_wgmma_layout.py, pure Python and numpy.

The configuration (`WgmmaConfig`), the rule of what the kernels take (`supports`) and the tile
choices (`wgmma_config`, `large_m_config`, `row_tile_config`, `ws_config`, the sweep's) are in
ops/quant_wgmma_tiles.py, pure Python over shapes.

Used by ops/quant_matmul.py for "nk" weights on a Hopper GPU; its reference is that file's
`int4_matmul_reference` / `int8_matmul_reference` on the same codes (tests/ops/
test_quant_wgmma_hopper.py; the CPU-side checks in tests/ops/test_quant_wgmma.py). Figures on
the H200: docs/PERFORMANCE.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ops.quant_wgmma_convert import (channel_scaled, codes_to_bf16, removed, scaled_parts,
                                     store_tile, swizzled)

from ops.quant_wgmma_layout import (  # noqa: F401  (callers use quant_wgmma.X)
    K_ORDER_SPAN, K_ORDERS, element_coords, register_relabeling, stored_k_positions,
    tile_layout, wgmma_k_order)
from ops.quant_wgmma_ws import ws_product
from ops.quant_wgmma_tiles import (  # noqa: F401  (the tiles; callers use quant_wgmma.X)
    LARGE_M_ROWS, MANY_ROWS, MAX_ACC, MAX_BLOCK_M, MAX_MMA_ROWS, MAX_ROWS, WS_SMEM_BYTES,
    WgmmaConfig, group_parts, padded_rows, program_columns, row_tile_config,
    row_tiling, smem_bytes, step_in_group, supports, sweep_configs, wgmma_config, ws_balance,
    ws_config, ws_stages)


def _kernel(x_gmem, w_gmem, s_gmem, *refs, bits: int, grouped: bool, offsets: bool,
            steps: int, k_steps: int, block_n: int, block_k: int, group_steps: int,
            group_count: int, stages: int, block_m: int, convert: str, direct: bool,
            instruction: str):
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
    upcast, inline = codes_to_bf16(bits, block_n, block_k, instruction, unsigned=offsets)
    layout = tile_layout(instruction)

    def dequantize(codes):  # [BN, BK] codes as loaded -> bf16 c - z (c: offsets) in `layout`
        if convert == "inline":
            return inline(codes)
        sign = jnp.asarray(-2 ** (bits - 1), jnp.int4 if bits == 4 else jnp.int8)  # top bit
        codes = codes ^ sign  # c - z, signed
        return plgpu.layout_cast(codes, layout).astype(jnp.bfloat16)

    def parts(w_smem, s_smem):  # the step's dequantized tile in `group_count` parts, each
        # its group's scale times its codes (plus offsets): [(bf16 [BN, width], its columns)]
        if removed("load"):  # the probe: a constant tile, nothing loaded or converted
            return [(plgpu.layout_cast(jnp.full((block_n, block_k), 1.0, jnp.bfloat16), layout),
                     slice(None))]
        w = dequantize(plgpu.load(w_smem, layout=upcast))  # c - z (c: offsets) [BN, BK]
        return scaled_parts(w, group_count, layout,
                            (lambda j: s_smem[0].at[j]) if grouped else None,
                            (lambda j: s_smem[1].at[j]) if offsets else None)

    def compute(acc_ref):
        def step(_, w_smem, x_smem, *s_smem):
            if removed("product"):  # the probe: the pipeline alone
                return
            for w, cols in parts(w_smem, s_smem):  # [BN, width] @ [width, BM]
                plgpu.wgmma(acc_ref, w, x_smem.at[:, cols].T)
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs,
                            max_concurrent_steps=stages)(*args)
        return acc_ref[...]

    def mma_step(_, w_smem, x_smem, *rest):  # instruction="mma": the sum is the carry
        *s_smem, acc = rest
        xb = plgpu.load(x_smem.T, layout=rhs)  # [BK, BM], all of it in every warp
        (w, _), = parts(w_smem, s_smem)  # one part: mma takes steps within one group
        return plgpu.mma(acc, w, xb)  # acc [BN, BM] f32

    if removed("scatter"):  # the probe: tile (nb, step) is block nb * k_steps + step
        code_block = lambda k: (nb * k_steps + first + k, 0)  # noqa: E731
    else:
        code_block = lambda k: (nb, first + k)  # noqa: E731
    in_specs = [
        plgpu.BlockSpec((block_n, block_k), code_block, transforms=swizzled(block_k, bits)),
        plgpu.BlockSpec((block_m, block_k), lambda k: (mb, first + k),
                        transforms=swizzled(block_k, 16)),
    ]
    args = [w_gmem, x_gmem]
    if grouped:  # the step's groups' rows of the scales (and offsets)
        for ref in (s_gmem, o_gmem) if offsets else (s_gmem,):
            in_specs.append(plgpu.BlockSpec((group_count, block_n),
                                            lambda k: ((first + k) // group_steps, nb)))
            args.append(ref)
    if instruction == "mma":  # the float32 sum carried through the pipeline
        rhs = plgpu.Layout.MMA_RHS(jnp.bfloat16, m_warps=4)
        zeros = plgpu.layout_cast(jnp.zeros((block_n, block_m), jnp.float32),
                                  plgpu.Layout.WGMMA)
        acc = plgpu.emit_pipeline(mma_step, grid=(steps,),
                                  in_specs=in_specs, max_concurrent_steps=stages,
                                  init_carry=zeros)(*args)
    else:
        acc = pl.run_scoped(compute, plgpu.ACC((block_n, block_m), jnp.float32))  # [BN, BM]
    cols = pl.ds(nb * block_n, block_n)
    rows = pl.ds(mb * block_m, block_m)
    if not grouped:  # per-channel scales, once per output
        acc = channel_scaled(acc, s_gmem.at[0, cols])
    store_tile(acc, out_smem, out_gmem.at[rows, cols] if direct else out_gmem.at[split, cols, rows],
               direct)
    plgpu.wait_smem_to_gmem(0)


def on_hopper() -> bool:
    """The default backend is a Hopper GPU (compute capability 9.x: wgmma)."""
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
    if removed("scatter"):  # the probe: the same bytes as contiguous [BN, BK] blocks
        codes = codes.reshape(n * k // cfg.block_k, cfg.block_k)
    kernel = functools.partial(
        _kernel, bits=bits, grouped=scales.shape[0] > 1, offsets=offsets is not None,
        steps=k // cfg.block_k // cfg.num_splits, k_steps=k // cfg.block_k,
        block_n=cfg.block_n, block_k=cfg.block_k,
        group_steps=steps_per_group, group_count=groups_per_step, stages=cfg.stages,
        block_m=block_m, convert=cfg.convert, direct=direct, instruction=cfg.instruction)
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


def offsets_in_kernel(bits: int, groups: int, dtype, cfg: WgmmaConfig) -> bool:
    """Whether the kernel (one warpgroup or warp-specialized) adds offsets of `dtype` itself
    (s c + o per group part, in bf16: the reference's dequantized weight): bf16 offsets of INT4
    groups under the inline conversion (which then gives c itself). Elsewhere (INT8, per
    channel) XLA adds o' times the activations' group sums after the kernel."""
    return bits == 4 and groups > 1 and dtype == jnp.bfloat16 and cfg.convert == "inline"


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
        rows = MAX_MMA_ROWS if cfg.instruction == "mma" else MAX_ROWS
        raise ValueError(f"wgmma_matmul: x {x.shape} {x.dtype}, w_t {w_t.shape}, scales "
                         f"{scales.shape} {scales.dtype}, group_size {group_size}, config "
                         f"{cfg}: needs bf16 x with at most {rows} rows per tile (block_m 0: "
                         f"one tile; else a multiple of 8 up to {MAX_BLOCK_M}, block_m x "
                         f"block_n <= {MAX_ACC}), N a multiple of {cfg.block_n}, bf16 scales "
                         f"and groups of whole K steps ({cfg.block_k})")
    if not on_hopper():
        raise ValueError(f"wgmma_matmul: needs a Hopper GPU (wgmma); the default backend here "
                         f"is {jax.default_backend()} ({jax.devices()[0].device_kind})")
    groups = scales.shape[0]
    block_m, mp = row_tiling(m, cfg)
    # x's column c multiplies the tile's column c: stored column `cols[c]` of the codes (the
    # inline conversion's K order), which holds K position `stored[cols[c]]`
    cols = wgmma_k_order(bits, k) if cfg.convert == "inline" else np.arange(k)
    stored = stored_k_positions(bits, k, k_order)
    positions = cols if stored is None else stored[cols]
    same = np.array_equal(positions, np.arange(k))  # "wgmma" codes under the inline conversion
    xk = x if same else jnp.take(x, jnp.asarray(positions, np.int32), axis=1)
    if bits == 4:  # the same bytes: nibble j of word w is K position 8w + j
        codes = jax.lax.bitcast_convert_type(w_t, jnp.int4).reshape(n, k)
    else:
        codes = jax.lax.bitcast_convert_type(w_t, jnp.int8)
    in_kernel = offsets is not None and offsets_in_kernel(bits, groups, offsets.dtype, cfg)
    direct = cfg.direct and cfg.num_splits == 1 and (offsets is None or in_kernel)
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
