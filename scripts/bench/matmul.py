"""Benchmark of the quantized (W4A16 / W8A16) and bf16 products against XLA's bf16 dot.

    python -m scripts.bench.matmul --json_out=matmul.json
    python -m scripts.bench.matmul --nokn --asymmetric --device_times --json_out=m.json
    python -m scripts.bench.matmul --modes=calib,sweep --shapes=4096x4096,4096x28672 --ms=1,16

Shapes: Llama-3.1-8B's linear layers K x N (fused qkv 4096x6144, o 4096x4096, fused gate+up
4096x28672, down 14336x4096, lm head 4096x128256) at M = 1 ... 1024 rows of bf16 activations.
- calib: the card's copy bandwidth in the same run (each row's TB/s as a share of it).
- bench: per shape and M: XLA's bf16 dot (the peer), then for codes stored [K, N] (--kn) the
  Triton kernel of ops/quant_matmul.py, XLA's dequantize + dot and what the dispatch picks
  (`int4` / `int8`), jax's Mosaic GPU int8 kernel (a peer, where it runs), and the products
  over weights stored [N, K] that the model runs (`bf16_nk`, `int8_nk`, `int4_nk`: what
  `linear` dispatches, the Hopper kernel of ops/quant_wgmma.py for codes where it takes the
  shape; at one row also ops/gemv.py's kernel, `int*_gemv`). Ends with a markdown table.
- sweep: per shape, M and bits, the tile variants of the Triton kernel (`int*_kernel`, the
  heuristic's `int*_heuristic` first) and, on a Hopper GPU, of the Hopper kernel
  (`int*_wgmma`, ops.quant_wgmma.sweep_configs), each with the fastest (`*_best`): the data
  of the tuned tile tables.
TB/s = weight bytes read (packed codes, scales, offsets) over time; speedup = bf16 time / time.
Timing: each jitted program runs --calls products on distinct weight sets, queued --queue times
with one sync, median of --runs; with --device_times also the device's busy time per product
from one profiler trace ("dev us", and "dev x" the bf16 peer's device time over it).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mgpu_mixed

from ops import quant_wgmma
from ops.backends import device_kernels
from ops.gemv import GemvConfig, gemv, gemv_config
from ops.kernel_choice import KernelBackends
from ops.matmul import TransposedWeight, device_k_order, linear
from ops.quant_matmul import (NUM_SMS, MatmulConfig, int4_matmul, int4_matmul_reference,
                              int8_matmul, int8_matmul_reference, matmul_config)
from scripts.bench import common
from scripts.bench.matmul_table import report, summary_table, sweep_table
from scripts.bench.profile import device_time_per_call

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["calib", "bench"], "calib, bench, sweep")
flags.DEFINE_list("shapes", ["4096x6144", "4096x4096", "4096x28672", "14336x4096",
                             "4096x128256"], "K x N")
flags.DEFINE_list("ms", ["1", "4", "16", "64", "256", "1024"], "activation rows")
flags.DEFINE_list("bits", ["4", "8"], "weight bits")
flags.DEFINE_integer("group_size", 128, "int4 group size (int8 is per channel)")
flags.DEFINE_integer("calls", 8, "products (distinct inputs) per jitted program")
flags.DEFINE_integer("queue", 3, "programs queued before one sync")
flags.DEFINE_integer("runs", 3, "timed repetitions (median)")
flags.DEFINE_integer("mgpu_max_m", 1 << 30, "time jax's hopper_mixed_type_matmul_mgpu (int8) "
                     "up to this M")
flags.DEFINE_integer("nk_max_m", 1 << 30, "time the products over transposed bf16, INT8 and "
                     "INT4 weights (bf16_nk, int8_nk, int4_nk: the model's layout) up to this "
                     "M: ops/gemv.py at one row, what `linear` runs past it (ops/quant_matmul.py's "
                     "layout 'nk' for codes: the Hopper kernel where it takes them; XLA for bf16)")
flags.DEFINE_bool("kn", True, "also time the codes stored [K, N] (the Triton kernels of "
                  "ops/quant_matmul.py and XLA's dequantize + dot)")
flags.DEFINE_bool("asymmetric", False, "INT4 codes with offsets (zero points; the RTN / GPTQ / "
                  "AWQ default) instead of symmetric codes")
flags.DEFINE_enum("variants", "all", ["all", "dispatch"], "all: kernel and XLA dequant at every "
                  "M; dispatch: only what matmul_config picks")
flags.DEFINE_list("gemv_tiles", [], "at one row, also time ops/gemv.py's kernel over the codes "
                  "with each of these tiles, block_n/block_k/warps (e.g. 8/1024/2; a sweep of "
                  "the plain product's CODE_TILES), besides its own tile")
flags.DEFINE_string("json_out", "", "write all rows as JSON here")
flags.DEFINE_bool("device_times", False, "Also trace each program with jax's profiler: device "
                  "busy time per product (see the module docstring).")
flags.DEFINE_enum("impl", "pallas", ["pallas", "pallas_interpret"], "interpret: CPU smoke test")


@functools.cache
def kernels() -> KernelBackends:
    """This device's kernel choice (ops.backends.device_kernels, the switches included): what
    the dispatch rows (`linear`, `int*_nk`) run, as the engine's runner would choose it."""
    return device_kernels()


def time_per_call(fn, args, calls: int) -> float:
    """Seconds per product: `fn(*args)` runs `calls` of them (see the module docstring)."""
    return common.time_per_call(fn, args, calls, FLAGS.runs, FLAGS.queue)


def device_per_call(fn, args, calls: int) -> dict:
    """The profiler's device time per product with --device_times, else {}."""
    if not FLAGS.device_times:
        return {}
    return device_time_per_call(fn, args, calls, FLAGS.queue)


def calibrate() -> dict:
    calib = common.calibrate(copy_bytes=2 << 30, runs=FLAGS.runs, queue=FLAGS.queue)
    return {"copy_TBps": calib["copy_TBps"]}


def num_sets(set_bytes: int) -> int:
    """One weight set per product: never two products of a program on the same weights (with
    fewer sets XLA merges the bf16 dots that share a weight into one, and the peer would read
    each weight once for several products)."""
    del set_bytes
    return FLAGS.calls


def make_weights(bits: int, k: int, n: int, group: int, sets: int, key):
    """Random packed codes (never zeros), scales and, for INT4 with --asymmetric, offsets (else
    None) for `sets` weight sets: (codes, scales, offsets), a tuple of `sets` arrays each."""
    k1, k2 = jax.random.split(key)
    packed, scales, offsets = [], [], []
    for i in range(sets):  # separate arrays: a slice of a stacked array is copied before a dot
        ka, kb, ko = jax.random.split(jax.random.fold_in(k1, i), 3)
        if bits == 4:
            packed.append(jax.lax.bitcast_convert_type(
                jax.random.bits(ka, (k // 8, n), jnp.uint32), jnp.int32))
        else:
            packed.append(jax.random.bits(ka, (k, n), jnp.uint8))
        groups = -(-k // group)
        scales.append(jax.random.uniform(kb, (groups, n), jnp.float32, 0.001,
                                         0.01).astype(jnp.bfloat16))
        offsets.append((jax.random.normal(ko, (groups, n)) * 0.01).astype(jnp.bfloat16)
                       if bits == 4 and FLAGS.asymmetric else None)
    del k2
    return tuple(packed), tuple(scales), tuple(offsets)


def weight_bytes(bits: int, k: int, n: int, group: int) -> int:
    """Bytes a product reads of the weight: packed codes, scales and (--asymmetric) offsets."""
    tables = 2 if bits == 4 and FLAGS.asymmetric else 1
    return k * n * bits // 8 + 2 * tables * -(-k // group) * n


def mgpu_fn(k: int, n: int, m: int):
    """jax's Mosaic GPU int8 x bf16 kernel for y = x @ W: computes W^T [N, K] @ x^T [K, M]."""
    mixed = mgpu_mixed
    mp = max(64, -(-m // 64) * 64)
    cfg = mixed.TuningConfig(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=4,
                             epi_tile_n=64, epi_tile_m=64,
                             wg_dimension=mixed.MatmulDimension.M)

    def fn(x, wt, s):  # x [M, K] bf16, wt int8 [N, K], s [1, N]
        xt = jnp.pad(x, ((0, mp - m), (0, 0))).T  # [K, Mp]
        y = mixed.mixed_matmul_kernel(wt, xt, out_dtype=jnp.bfloat16, config=cfg)  # [N, Mp]
        return (y[:, :m].T.astype(jnp.float32) * s.astype(jnp.float32)).astype(jnp.bfloat16)
    return fn


def bench_shape(k: int, n: int, ms: list[int], calib: dict, sweep=None) -> list[dict]:
    """Every row of one shape K x N at each of `ms`: the bf16 peer, then per --bits the codes
    stored [K, N] (`bench_kn`, with --kn or `sweep`) and the Mosaic GPU int8 peer, then the
    model's layout (`bench_nk`, up to --nk_max_m rows)."""
    rows = []
    calls = FLAGS.calls
    bf16_sets = num_sets(2 * k * n)
    wb = tuple(jax.random.normal(jax.random.key(100 + i), (k, n), jnp.bfloat16)
               for i in range(bf16_sets))
    for m in ms:
        xs = tuple(jax.random.normal(jax.random.key(1000 * m + c), (m, k), jnp.bfloat16)
                   for c in range(calls))
        def bf16_prog(xs, w):
            return tuple(jnp.dot(xs[c], w[c % bf16_sets], preferred_element_type=jnp.float32)
                         .astype(jnp.bfloat16) for c in range(calls))
        t_bf16 = time_per_call(bf16_prog, (xs, wb), calls)
        dev_bf16 = device_per_call(bf16_prog, (xs, wb), calls)
        rows.append({"K": k, "N": n, "M": m, "impl": "xla_bf16", "us": t_bf16 * 1e6,
                     "TBps": 2 * k * n / t_bf16 / 1e12, "speedup": 1.0, **dev_bf16})
        report(rows[-1], calib)
        for bits in map(int, FLAGS.bits):
            if FLAGS.kn or sweep is not None:
                rows += bench_kn(k, n, m, bits, xs, t_bf16, dev_bf16, calib, sweep)
            if sweep is None and bits == 8 and m <= FLAGS.mgpu_max_m:
                rows.append(bench_mgpu(k, n, m, xs, t_bf16, dev_bf16, calib))
        if sweep is None and m <= FLAGS.nk_max_m:
            rows += bench_nk(k, n, m, xs, t_bf16, dev_bf16, calib)
        if sweep is not None and quant_wgmma.on_hopper():
            rows += wgmma_sweep(k, n, m, xs, t_bf16, dev_bf16, calib)
    del wb
    return rows


def timed_row(row: dict, prog, args, nbytes: int, t_bf16: float, dev_bf16: dict) -> dict:
    """`row` with the time per product of `prog(*args)` (--calls products), the weight's TB/s
    and the speedup over the bf16 peer (and with --device_times the device's), or the error
    that stopped it (a config the compiler rejects is reported, not fatal)."""
    try:
        t = time_per_call(prog, args, FLAGS.calls)
        row.update(us=t * 1e6, TBps=nbytes / t / 1e12, speedup=t_bf16 / t)
        row.update(device_per_call(prog, args, FLAGS.calls))
        if "dev_us" in row and "dev_us" in dev_bf16:
            row["dev_speedup"] = dev_bf16["dev_us"] / row["dev_us"]
    except Exception as e:  # recorded with the reason
        row["error"] = common.error_text(e)
    return row


def bench_kn(k, n, m, bits, xs, t_bf16, dev_bf16, calib, sweep=None) -> list[dict]:
    """Codes stored [K, N]: the Triton kernel of ops/quant_matmul.py with `matmul_config`'s
    tiles and XLA's dequantize + dot (with --variants=dispatch only the one the heuristic
    picks), then the dispatch's row (`int4` / `int8`); or every config of `sweep(bits, m)` and
    the fastest (`int*_best`)."""
    rows, calls = [], FLAGS.calls
    group = FLAGS.group_size if bits == 4 else k
    nbytes = weight_bytes(bits, k, n, group)
    sets = num_sets(nbytes)
    w, s, o = make_weights(bits, k, n, group, sets, jax.random.key(10 + bits))
    fn = int4_matmul if bits == 4 else int8_matmul
    ref = int4_matmul_reference if bits == 4 else int8_matmul_reference
    heur = matmul_config(bits, m, k, n, group)
    if sweep is not None:  # the heuristic's own config first, then the variants
        variants = [(f"int{bits}_heuristic" if i == 0 else f"int{bits}_kernel",
                     FLAGS.impl, cfg) for i, cfg in enumerate(sweep(bits, m))]
    else:
        variants = [(f"int{bits}_kernel", FLAGS.impl, heur),
                    (f"int{bits}_xla", "reference", None)]
        if FLAGS.variants == "dispatch":
            variants = [variants[0] if heur is not None else variants[1]]
    by_name, timed = {}, []
    for name, impl, cfg in variants:
        def prog(xs, w, s, o, impl=impl, cfg=cfg):
            out = []
            for c in range(calls):
                i = c % sets
                if impl == "reference":
                    out.append(ref(xs[c], w[i], s[i], o[i], group_size=group)
                               .astype(jnp.bfloat16))
                else:
                    out.append(fn(xs[c], w[i], s[i], o[i], group_size=group, impl=impl,
                                  config=cfg))
            return tuple(out)
        row = timed_row({"K": k, "N": n, "M": m, "impl": name, "bits": bits, "group": group,
                         "config": str(cfg or "")}, prog, (xs, w, s, o), nbytes, t_bf16,
                        dev_bf16)
        if "error" not in row:
            by_name[name] = row
            timed.append(row)
        rows.append(row)
        report(row, calib)
    if sweep is not None and timed:  # the fastest config of this (shape, M, bits)
        rows.append({**min(timed, key=lambda r: r.get("dev_us", r["us"])),
                     "impl": f"int{bits}_best"})
        report(rows[-1], calib)
    if sweep is None:  # what the default dispatch runs
        pick = f"int{bits}_kernel" if heur is not None else f"int{bits}_xla"
        if pick in by_name:
            rows.append({**by_name[pick], "impl": f"int{bits}", "via": pick})
            report(rows[-1], calib)
    return rows


NK_BITS = {"bf16_nk": 16, "int8_nk": 8, "int4_nk": 4}


def nk_config(bits: int, m: int, k: int, n: int, group: int) -> str:
    """What `linear` runs over a weight stored [N, K] at m rows (past one row for bf16, where
    bench_nk runs ops/gemv.py): for codes the Hopper kernel where it takes the shape (its
    tiles), else the Triton "nk" path's config or XLA's dequantize + dot; XLA's dot for bf16."""
    if bits == 16:
        return "xla"
    if kernels().wgmma and quant_wgmma.supports(bits, m, k, n, group, jnp.bfloat16,
                                                 jnp.bfloat16):
        return f"wgmma {quant_wgmma.wgmma_config(bits, m, k, n, group)}"
    return str(matmul_config(bits, m, k, n, group, stored_nk=True) or "xla_dequantize")


def bench_nk(k, n, m, xs, t_bf16, dev_bf16, calib) -> list[dict]:
    """The products over weights stored transposed, [N, K] (the model's layout with
    `--gemv_layers`, codes in the K order this device reads fastest, `device_k_order`): bf16
    (`bf16_nk`), INT8 codes with per-channel scales (`int8_nk`) and INT4 words with
    --group_size scales (`int4_nk`; offsets with --asymmetric): what `linear` runs for such a
    weight (for codes ops/quant_matmul.py's layout "nk": the Hopper kernel of ops/quant_wgmma.py
    where it takes the shape; for bf16 XLA's dot, ops/gemv.py's kernel at one row). At one row
    codes also run ops/gemv.py's kernel (`int4_gemv`, `int8_gemv`: the model's fused decode
    product, here without its norm or residual)."""
    rows = []
    calls, sets = FLAGS.calls, num_sets(k * n)
    interpret = FLAGS.impl == "pallas_interpret"
    for name, bits in NK_BITS.items():
        if bits != 16 and str(bits) not in FLAGS.bits:
            continue
        group = FLAGS.group_size if bits == 4 else k
        if bits == 16:
            weights = tuple(TransposedWeight(jax.random.normal(jax.random.key(70 + i), (n, k),
                                                               jnp.bfloat16))
                            for i in range(sets))
            nbytes = 2 * k * n
        else:  # make_weights' codes [K/8, N] / [K, N], stored transposed; random codes, so
            # any K order holds the same kind of data
            packed, s, o = make_weights(bits, k, n, group, sets, jax.random.key(70 + bits))
            weights = [TransposedWeight(a.T, si, oi, group if group < k else 0)
                       for a, si, oi in zip(packed, s, o)]
            order = device_k_order(weights[0], kernels())
            weights = tuple(dataclasses.replace(w, k_order=order) for w in weights)
            nbytes = weight_bytes(bits, k, n, group)
        # (row name, ops/gemv.py's tile or None: what `linear` runs)
        kinds = [(name, gemv_config(False, False, 16, k) if m == 1 and bits == 16 else None)]
        if m == 1 and bits != 16:
            kinds += [(f"int{bits}_gemv", tile) for tile in gemv_tiles(bits, k)]
        for impl, tile in kinds:
            config = str(tile) if tile else nk_config(bits, m, k, n, group)
            row = {"K": k, "N": n, "M": m, "impl": impl, "bits": bits, "group": group,
                   "config": config, "k_order": weights[0].k_order}

            def prog(xs, weights, group=group, bits=bits, tile=tile):
                out = []
                for c in range(calls):
                    w = weights[c % sets]
                    if tile:
                        out.append(gemv(xs[c], w.w_t, scales=w.scales, offsets=w.offsets,
                                        group_size=group if bits != 16 else None,
                                        k_order=w.k_order, config=tile, interpret=interpret))
                    elif bits == 16:
                        out.append(linear(xs[c], w, kernels=kernels()))
                    else:
                        product = int4_matmul if bits == 4 else int8_matmul
                        out.append(product(xs[c], w.w_t, w.scales, w.offsets,
                                           group_size=group, layout="nk", k_order=w.k_order,
                                           impl="pallas_interpret" if interpret else None,
                                           kernels=kernels()))
                return tuple(out)
            rows.append(timed_row(row, prog, (xs, weights), nbytes, t_bf16, dev_bf16))
            report(rows[-1], calib)
    return rows


def gemv_tiles(bits: int, k: int) -> list[GemvConfig]:
    """ops/gemv.py's tile for a plain product of codes (o, down) over k positions, then
    --gemv_tiles'."""
    own = gemv_config(False, False, bits, k)
    tiles = [own]
    for spec in FLAGS.gemv_tiles:
        try:
            block_n, block_k, warps = (int(v) for v in spec.split("/"))
        except ValueError:
            raise app.UsageError(f"--gemv_tiles: {spec!r} is not block_n/block_k/warps")
        tiles.append(dataclasses.replace(own, block_n=block_n, block_k=block_k,
                                         num_warps=warps))
    return tiles


def bench_mgpu(k, n, m, xs, t_bf16, dev_bf16, calib) -> dict:
    """jax's Mosaic GPU int8 x bf16 kernel (`mgpu_fn`; per-channel scales applied after), or
    the reason it did not run, recorded as n/a."""
    calls, sets = FLAGS.calls, num_sets(k * n)
    wt = tuple(jax.random.bits(jax.random.key(50 + i), (n, k), jnp.uint8).astype(jnp.int8)
               for i in range(sets))
    s = tuple(jax.random.uniform(jax.random.key(60 + i), (1, n), jnp.float32, 0.001, 0.01)
              for i in range(sets))
    row = {"K": k, "N": n, "M": m, "impl": "mgpu_int8_peer", "bits": 8}
    try:
        fn = mgpu_fn(k, n, m)
    except Exception as e:  # a tuning this jax's kernel does not take
        row["error"] = common.error_text(e)
    else:
        row = timed_row(row, lambda xs, wt, s: tuple(
            fn(xs[c], wt[c % sets], s[c % sets]) for c in range(calls)), (xs, wt, s),
            k * n + 4 * n, t_bf16, dev_bf16)
    if "error" in row:
        row["error"] = "n/a: " + row["error"]
    report(row, calib)
    return row


def sweep_configs(bits: int, m: int) -> list[MatmulConfig]:
    """Tile variants of the Triton kernel for one row count (num_splits 0: filled in by
    `triton_sweep`'s rule). M <= 16 (decode): the fma path at block_m 16 (M < 16 only), then
    the tensor-core "mma" path over block_n, block_k, warps and stages. Larger M: tiles around
    the heuristic's dot path."""
    bk = (128, 256, 512) if bits == 4 else (32, 64, 128)  # small, medium, large K tile
    if m <= 16:
        fma = [MatmulConfig(16, 256, bk[2] if bits == 4 else bk[1], 0, 8, 2)] if m < 16 else []
        mma = [MatmulConfig(16, bn, k_, 0, w, st, "mma")
               for bn, k_, w, st in ((128, bk[1], 4, 3), (256, bk[1], 4, 3), (256, bk[2], 8, 2))]
        return fma + mma
    bm = max(16, 1 << (m - 1).bit_length())
    out = [MatmulConfig(bm, bn, bk[1], 0, 4, 3) for bn in (64, 128, 256)]
    return out + [MatmulConfig(bm, 128, bk[1], 0, 8, 3), MatmulConfig(bm, 128, bk[2], 0, 4, 2)]


def triton_sweep(k: int, n: int):
    """sweep(bits, m): the heuristic's config, then `sweep_configs` with K splits that give
    about two programs per SM."""
    def sweep(bits, m):
        auto = matmul_config(bits, m, k, n, FLAGS.group_size if bits == 4 else k)
        out = [auto] if auto is not None else []
        for cfg in sweep_configs(bits, m):
            tiles = -(-k // cfg.block_k)
            progs = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            splits = max(1, min(round(2 * NUM_SMS / progs), tiles // 2, 16))
            cfg = dataclasses.replace(cfg, num_splits=splits)
            if cfg not in out:
                out.append(cfg)
        return out
    return sweep


def wgmma_sweep(k: int, n: int, m: int, xs, t_bf16: float, dev_bf16: dict,
                calib: dict) -> list[dict]:
    """The Hopper kernel (ops/quant_wgmma.py) over codes stored [N, K] in its K order, with
    each of its sweep tiles per --bits (`int*_wgmma`), then the fastest (`int*_wgmma_best`)."""
    rows, calls, sets = [], FLAGS.calls, num_sets(k * n)
    for bits in map(int, FLAGS.bits):
        group = FLAGS.group_size if bits == 4 else k
        packed, s, o = make_weights(bits, k, n, group, sets, jax.random.key(80 + bits))
        codes = tuple(a.T for a in packed)  # random codes: any K order holds the same data
        nbytes = weight_bytes(bits, k, n, group)
        timed = []
        for cfg in quant_wgmma.sweep_configs(bits, k, n, m):
            def prog(xs, codes, s, o, cfg=cfg, bits=bits, group=group):
                return tuple(quant_wgmma.wgmma_matmul(
                    xs[c], codes[c % sets], s[c % sets], o[c % sets], bits=bits,
                    group_size=group, config=cfg, k_order="wgmma") for c in range(calls))
            row = timed_row({"K": k, "N": n, "M": m, "impl": f"int{bits}_wgmma", "bits": bits,
                             "group": group, "config": str(cfg)}, prog, (xs, codes, s, o),
                            nbytes, t_bf16, dev_bf16)
            rows.append(row)
            report(row, calib)
            if "error" not in row:
                timed.append(row)
        if timed:
            rows.append({**min(timed, key=lambda r: r.get("dev_us", r["us"])),
                         "impl": f"int{bits}_wgmma_best"})
            report(rows[-1], calib)
    return rows


def main(_):
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    unknown = sorted(set(FLAGS.modes) - {"calib", "bench", "sweep"})
    if unknown:
        raise app.UsageError(f"--modes: unknown {', '.join(unknown)} (calib, bench, sweep)")
    calib = calibrate() if "calib" in FLAGS.modes and FLAGS.impl == "pallas" else {}
    shapes = [tuple(int(v) for v in s.split("x")) for s in FLAGS.shapes]
    ms = [int(m) for m in FLAGS.ms]
    rows = []
    if "sweep" in FLAGS.modes:
        for k, n in shapes:
            rows += bench_shape(k, n, ms, calib, sweep=triton_sweep(k, n))
            save_rows(rows, calib)
        print(sweep_table(rows))
    if "bench" in FLAGS.modes:
        for k, n in shapes:
            rows += bench_shape(k, n, ms, calib)
            save_rows(rows, calib)
        print(summary_table(rows, calib))


def save_rows(rows: list[dict], calib: dict) -> None:
    """--json_out: every row so far (rewritten whole after each shape: a run cut short keeps
    them)."""
    if FLAGS.json_out:
        common.write_json(FLAGS.json_out, common.run_info() | {"calib": calib, "rows": rows})


if __name__ == "__main__":
    app.run(main)
