"""The grouped expert product of a mixture of experts, per form, against its touched-bytes floor.

    python -m scripts.bench.moe_matmul --model=qwen3-30b-a3b --rows=8,128,512,16384 \
        --forms=gathered,kernel,tiles,ragged,mgpu --json_out=moe_matmul.json

One projection (--projection: gate [E, hidden, I], gate_up [E, hidden, 2 I] or down
[E, I, hidden]) of `--copies` layers, each its own
weights (so no step finds its experts in the L2 cache), multiplied by M = tokens x k rows
routed uniformly (each token k distinct experts; --routing=crowded: all tokens the same k) and
sorted by expert, as models/moe.py sorts them. Forms: the XLA forms of ops/moe_matmul.py
(`gathered` only up to E rows; `ragged` without XLA's grouped-GEMM flag is the padded dense
alternative: every expert times every row), `gathered_reduce` (the gathered form written as multiply and sum, which XLA may fuse with the
gather and the codes' unpacking into one reduction instead of writing the gathered weights
first),
`kernel`: ops/expert_gemv.py's Pallas Triton kernel (up to MAX_ROWS_PER_EXPERT x E rows: each
row's expert read by the kernel itself, no gathered copy; `kernel:BN/BK/S/W/ST/P` the same with
the tiles ExpertGemvConfig(block_n, block_k, splits (0: the default), num_warps, num_stages,
prefetch 0/1), for a tile sweep in one run; `kernel_gated` the kernel over GatedRows of
--gated_splits float32 partials, as a mixture's down product takes its input, against its own
reference), `grouped`: ops/expert_gemm.py's kernel (each expert's run of sorted rows by
one program per column block, the expert read once per chunk of rows; `grouped:BM/BN/BK/W/ST`
with the tiles ExpertGemmConfig(block_m, block_n, block_k, num_warps, num_stages)), `router` /
`router_xla` (ops/moe_router.py: the norm, router logits and top-k of the rows' tokens, the
kernel / XLA's ops; the floor is the routers' bytes), and
`mgpu`: jax's Pallas Mosaic GPU ragged_dot (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu;
Hopper, bf16, tiles from --mgpu_tiles). --quant=int4 / int8: RTN codes per expert (the XLA
forms and the kernel). The floor is the bytes of the experts the rows touch (plus x and y) over
the copy bandwidth measured in the same run; each row also records its largest difference from the
tiles form's product (relative to its largest value). A failing row records its error.
--device_times adds the profiler's device busy time per product and its top kernels.
--impl=pallas_interpret runs the Pallas forms interpreted: a CPU check of every form's answer.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

from configs.model import get_preset
from ops import expert_gemm, expert_gemv, moe_matmul
from ops.moe_router import route_rows
from quant.model import quantize_experts
from scripts.bench.common import (calibrate, error_text, markdown_table, run_info,
                                  time_per_call, write_json)
from scripts.bench.profile import device_time_per_call
from scripts.common import set_xla_flags

flags.DEFINE_string("model", "qwen3-30b-a3b", "A mixture-of-experts preset.")
flags.DEFINE_list("rows", ["8", "128", "512", "16384"], "Rows (tokens x experts per token).")
flags.DEFINE_list("forms", ["gathered", "gathered_reduce", "kernel", "kernel_gated", "grouped",
                            "tiles", "ragged", "mgpu", "router", "router_xla"],
                  "Forms to time (kernel:BN/BK/S/W/ST/P, grouped:BM/BN/BK/W/ST: the kernel "
                  "with those tiles).")
flags.DEFINE_enum("quant", "none", ["none", "int8", "int4"], "Expert weights' format.")
flags.DEFINE_enum("projection", "gate", ["gate", "gate_up", "down"], "Which expert product: "
                  "gate [hidden, I], gate and up fused [hidden, 2 I] (a decode layer's first "
                  "product on one GPU), or down [I, hidden].")
flags.DEFINE_enum("impl", "pallas", ["pallas", "pallas_interpret"], "The Pallas forms "
                  "compiled, or interpreted (a CPU check of every form's answer; times mean "
                  "nothing).")
flags.DEFINE_integer("copies", 8, "Layers of distinct weights per timed call.")
flags.DEFINE_integer("runs", 5, "Timings per row (median).")
flags.DEFINE_bool("device_times", False, "Also each row's device busy time per product and its "
                  "top kernels, from jax's profiler (where the wall time goes at few rows).")
flags.DEFINE_string("mgpu_tiles", "64,128,64,4,1", "block_m,block_n,block_k,"
                    "max_concurrent_steps,grid_block_n of the mgpu form.")
flags.DEFINE_integer("gated_splits", 8, "Partials per row of the kernel_gated form (a batch-1 "
                     "gate-up product's K splits).")
flags.DEFINE_enum("routing", "uniform", ["uniform", "crowded"], "Which experts the rows' "
                  "tokens choose: k distinct experts each, uniformly; or all tokens the same k "
                  "(as a random-weight model's deeper layers route a prompt).")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS


def routed_group_sizes(rng, rows: int, experts: int, k: int, crowded: bool = False
                       ) -> np.ndarray:
    """Rows per expert (summing to `rows`) of ceil(rows / k) tokens, each choosing k distinct
    experts uniformly, or with `crowded` all choosing the same k."""
    tokens = -(-rows // k)
    choice = np.argsort(rng.random((1 if crowded else tokens, experts)), axis=1)[:, :k]
    chosen = np.broadcast_to(choice, (tokens, k)).reshape(-1)[:rows]
    return np.bincount(chosen, minlength=experts).astype(np.int32)


def product(form: str, bits: int):
    """fn(x [M, K], group_sizes [E], weight) -> [M, N] of one form over one layer's weight (an
    argument, so that jit takes it as a buffer rather than a constant of the program)."""
    if form == "mgpu":
        bm, bn, bk, steps, gbn = (int(v) for v in FLAGS.mgpu_tiles.split(","))
        return lambda x, gs, weight: ragged_dot_mgpu.ragged_dot(
            x, weight, group_sizes=gs, block_m=bm, block_n=bn, block_k=bk,
            max_concurrent_steps=steps, grid_block_n=gbn)
    if form == "gathered_reduce":
        return functools.partial(gathered_reduce, bits=bits)
    if form.split(":")[0] == "kernel":
        return functools.partial(kernel_product, config=kernel_config(form))
    if form.split(":")[0] == "grouped":
        return functools.partial(grouped_product, config=grouped_config(form))
    if form == "kernel_gated":  # x: the partials [S, M, 2 K]
        return lambda p, gs, weight: kernel_product(
            moe_matmul.GatedRows(p, "silu", jnp.bfloat16), gs, weight, config=None)
    if form not in moe_matmul.FORMS:
        raise ValueError(f"unknown form {form!r}")

    def run(x, gs, weight):
        if bits:
            return moe_matmul.grouped_coded_matmul(x, weight.packed, weight.scales,
                                                   weight.offsets, gs, bits=bits,
                                                   group_size=weight.group_size, form=form)
        return moe_matmul.grouped_matmul(x, weight, gs, form=form)
    return run


def kernel_config(form: str) -> expert_gemv.ExpertGemvConfig | None:
    """The tiles of a `kernel:BN/BK/S/W/ST/P` form (None for `kernel`: the default tiles)."""
    if ":" not in form:
        return None
    bn, bk, splits, warps, stages, prefetch = (int(v) for v in form.split(":")[1].split("/"))
    return expert_gemv.ExpertGemvConfig(bn, bk, splits or None, warps, stages, bool(prefetch))


def grouped_config(form: str) -> expert_gemm.ExpertGemmConfig | None:
    """The tiles of a `grouped:BM/BN/BK/W/ST` form (None for `grouped`: the default tiles)."""
    if ":" not in form:
        return None
    return expert_gemm.ExpertGemmConfig(*(int(v) for v in form.split(":")[1].split("/")))


def grouped_product(x, gs, weight, config):
    """The `grouped` form: ops/expert_gemm.py's kernel over the sorted rows; float experts or
    codes."""
    if isinstance(weight, jax.Array):
        return expert_gemm.expert_group_matmul(x, weight, gs, config=config,
                                               interpret=interpreted())
    return expert_gemm.expert_group_matmul(x, weight.packed, gs, scales=weight.scales,
                                           offsets=weight.offsets,
                                           group_size=weight.group_size, config=config,
                                           interpret=interpreted())


def interpreted() -> bool:
    return FLAGS.impl == "pallas_interpret"


def kernel_product(x, gs, weight, config):
    """The `kernel` form: each sorted row's expert from the group sizes, as the gathered form
    finds it, and the kernel's product (rows past the groups zero); float experts or codes."""
    e = jax.tree.leaves(weight)[0].shape[0]
    expert = moe_matmul.row_experts(gs, x.shape[0])  # E for rows past the groups
    clamped = jnp.minimum(expert, e - 1)
    if isinstance(weight, jax.Array):
        y = expert_gemv.expert_gemv(x, weight, clamped, config=config, interpret=interpreted())
    else:
        y = expert_gemv.expert_gemv(x, weight.packed, clamped, scales=weight.scales,
                                    interpret=interpreted(),
                                    offsets=weight.offsets, group_size=weight.group_size,
                                    config=config)
    return jnp.where((expert < e)[:, None], y, 0).astype(x.dtype)


def route_product(x, gs, router, norm_weight, top_k: int, normalize: bool, impl: str):
    """The `router` / `router_xla` forms: the normed rows and the routing weights of x's
    tokens (ops.moe_router.route_rows), the weights as the answer checked."""
    del gs
    return route_rows(x, norm_weight, 1e-6, router, top_k=top_k, normalize=normalize,
                      impl=impl)[1]


def gathered_reduce(x, gs, weight, bits: int):
    """The gathered form as an elementwise product and a sum over K (float) or over each group
    of K with the scales after it (codes), which XLA may fuse with the gather and the codes'
    unpacking into one reduction that reads the gathered weights once."""
    e = jax.tree.leaves(weight)[0].shape[0]
    expert = jnp.minimum(moe_matmul.row_experts(gs, x.shape[0]), e - 1)
    if not bits:
        prod = x[:, :, None].astype(jnp.float32) * weight[expert].astype(jnp.float32)
        return jnp.sum(prod, axis=1).astype(x.dtype)
    m, k = x.shape
    g, n = weight.scales.shape[1:]
    size = k // g
    codes = moe_matmul.unpack_codes(weight.packed[expert], bits).reshape(m, g, size, n)
    xg = x.reshape(m, g, size).astype(jnp.float32)
    yg = jnp.sum(xg[..., None] * codes.astype(jnp.float32), axis=2)  # [M, G, N]
    s = weight.scales.astype(jnp.float32)[expert]
    z = (-moe_matmul.CODE_ZEROS[bits] * s if weight.offsets is None
         else weight.offsets.astype(jnp.float32)[expert])
    return jnp.sum(yg * s + jnp.sum(xg, axis=-1)[..., None] * z, axis=1).astype(x.dtype)


def main(argv):
    del argv
    set_xla_flags()
    cfg = get_preset(FLAGS.model)
    if not cfg.is_moe:
        raise app.UsageError(f"--model={FLAGS.model} is not a mixture of experts")
    e, h, i, k = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                  cfg.num_experts_per_tok)
    din, dout = {"gate": (h, i), "gate_up": (h, 2 * i), "down": (i, h)}[FLAGS.projection]
    bits = {"none": 0, "int8": 8, "int4": 4}[FLAGS.quant]
    keys = jax.random.split(jax.random.key(0), FLAGS.copies)
    weights = [(0.02 * jax.random.normal(key, (e, din, dout), jnp.float32)).astype(jnp.bfloat16)
               for key in keys]
    if bits:
        weights = [quantize_experts(w, bits, 128 if bits == 4 else -1, False, jnp.bfloat16)
                   for w in weights]
    expert_bytes = sum(a.nbytes for a in jax.tree.leaves(weights[0])) / e
    routers = [(0.02 * jax.random.normal(key, (h, e), jnp.float32)).astype(jnp.bfloat16)
               for key in jax.random.split(jax.random.key(1), FLAGS.copies)]
    norm_weight = (1.0 + 0.1 * jax.random.normal(jax.random.key(2), (h,))).astype(jnp.bfloat16)
    results = {**run_info(), "model": FLAGS.model, "quant": FLAGS.quant,
               "projection": FLAGS.projection, "routing": FLAGS.routing, "rows": []}
    # interpreted (a CPU check of the forms): a small calibration that fits the CPU's memory
    results["calibration"] = calib = (calibrate(copy_bytes=64 << 20, matmul=1024)
                                      if interpreted() else calibrate())
    rng = np.random.default_rng(0)
    for rows in map(int, FLAGS.rows):
        gs = jnp.asarray(routed_group_sizes(rng, rows, e, k, FLAGS.routing == "crowded"))
        touched = int((np.asarray(gs) > 0).sum())
        x = jax.random.normal(jax.random.key(rows), (rows, din), jnp.bfloat16)
        floor = (touched * expert_bytes + rows * (din + dout) * 2) / (calib["copy_TBps"] * 1e12)
        partials = jax.random.normal(jax.random.key(rows + 1),
                                     (FLAGS.gated_splits, rows, 2 * din))
        tokens = jax.random.normal(jax.random.key(rows + 2), (-(-rows // k), h), jnp.bfloat16)
        tiles = jax.jit(product("tiles", bits))
        reference = np.asarray(tiles(x, gs, weights[0]), np.float32)
        for form in FLAGS.forms:
            row = {"rows": rows, "form": form, "touched_experts": touched, "floor_s": floor}
            try:
                if form.startswith("gathered") and rows > e:
                    raise ValueError(f"the {form} form takes at most E={e} rows")
                most = expert_gemv.MAX_ROWS_PER_EXPERT * e  # as models/moe.py takes it
                if form.startswith("kernel") and rows > most:
                    raise ValueError(f"the {form} form takes at most {most} rows")
                ws = weights
                if form.startswith("router"):  # the rows' tokens, each a router of its own
                    x_in, ws = tokens, routers
                    fn = functools.partial(route_product, norm_weight=norm_weight, top_k=k,
                                           normalize=cfg.norm_topk_prob,
                                           impl=FLAGS.impl if form == "router" else "reference")
                    want = np.asarray(jax.jit(functools.partial(fn, impl="reference"))(
                        x_in, gs, ws[0]), np.float32)
                    row["floor_s"] = ws[0].nbytes / (calib["copy_TBps"] * 1e12)
                elif form == "kernel_gated":  # its own input, and the tiles form of its rows
                    fn, x_in = product(form, bits), partials
                    want = np.asarray(tiles(moe_matmul.GatedRows(
                        partials, "silu", jnp.bfloat16).rows(), gs, ws[0]), np.float32)
                else:
                    fn, x_in, want = product(form, bits), x, reference
                got = np.asarray(jax.jit(fn)(x_in, gs, ws[0]), np.float32)  # one answer
                row["max_rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
                seconds = time_per_call(lambda x, gs, ws: [fn(x, gs, w) for w in ws],
                                        (x_in, gs, ws), len(ws), FLAGS.runs, 4)
                row |= {"step_s": seconds, "fraction_of_floor": row["floor_s"] / seconds}
                if FLAGS.device_times:
                    row |= device_time_per_call(lambda x, gs, ws: [fn(x, gs, w) for w in ws],
                                                (x_in, gs, ws), len(ws), 4)
            except Exception as exc:  # noqa: BLE001 - a failing row is a result
                row["error"] = error_text(exc)
            results["rows"].append(row)
            print(row, flush=True)
            if FLAGS.json_out:
                write_json(FLAGS.json_out, results)
    table = [[r["rows"], r["form"], r["touched_experts"], f"{r['floor_s'] * 1e6:.1f}",
              f"{r['step_s'] * 1e6:.1f}" if "step_s" in r else r.get("error", "")[:50],
              f"{r['fraction_of_floor']:.1%}" if "step_s" in r else "",
              f"{r['dev_us']:.1f}" if "dev_us" in r else ""]
             for r in results["rows"]]
    print(markdown_table(["rows", "form", "experts touched", "floor us", "us", "of floor",
                          "device us"], table))


if __name__ == "__main__":
    app.run(main)
