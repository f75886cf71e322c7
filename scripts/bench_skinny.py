"""Benchmark of the skinny bf16 product kernel (ops/skinny_matmul.py) against XLA's dot.

    python -m scripts.bench_skinny --json_out=skinny.json
    python -m scripts.bench_skinny --modes=calib,sweep --ms=1

Shapes: Llama-3.1-8B's linear layers K x N at M = 1 ... 16 rows of bf16 activations (decode at
small batch), each as the model runs it:
  qkv 4096x6144 and gate_up 4096x28672: RMSNorm of x, then the product ("norm");
  o 4096x4096: the product, then the residual add ("residual");
  down 14336x4096: SiLU(gate) x up, the product, the residual add ("gated+residual");
  lm_head 4096x128256: RMSNorm, the product.
- calib: the card's copy bandwidth (bytes read + written over time) in the same run.
- bench: per shape and M, XLA (the jnp reference, which XLA compiles and fuses as it can) and the
  kernel with `skinny_config`'s tiles, both with the shape's fusions, and the plain products.
  TB/s = weight bytes over time; "% copy" against the calibration; speedup = XLA / kernel.
- sweep: per shape and M, the plain product through every tile of `sweep_configs`.

Timing (as scripts/bench_matmul.py): each jitted program runs `--calls` products on distinct
inputs (a weight set per product); it is queued `--queue` times and synchronized once; time per
product = wall time / (queue x calls), median of `--runs`.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
from absl import app, flags

from ops.skinny_matmul import SkinnyConfig, skinny_config, skinny_matmul
from scripts import timing

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["calib", "bench"], "calib, bench, sweep")
flags.DEFINE_list("shapes", ["qkv", "o", "gate_up", "down", "lm_head"], "layers of SHAPES")
flags.DEFINE_list("ms", ["1", "4", "16"], "activation rows (at most 16)")
flags.DEFINE_integer("calls", 8, "products (distinct inputs) per jitted program")
flags.DEFINE_integer("queue", 3, "programs queued before one sync")
flags.DEFINE_integer("runs", 3, "timed repetitions (median)")
flags.DEFINE_string("json_out", "", "write all rows as JSON here")
flags.DEFINE_enum("impl", "pallas", ["pallas", "pallas_interpret"], "interpret: CPU smoke test")
flags.DEFINE_float("scale", 1.0, "shrink K and N by this factor (CPU smoke tests)")

# name: (K, N, fusion) of llama3.1-8b's fused projections
SHAPES = {"qkv": (4096, 6144, "norm"), "o": (4096, 4096, "residual"),
          "gate_up": (4096, 28672, "norm"), "down": (14336, 4096, "gated+residual"),
          "lm_head": (4096, 128256, "norm")}


def sweep_configs(k: int) -> list[SkinnyConfig]:
    """Tiles tried by the sweep (block_k clipped to divide K)."""
    out = []
    for bn in (16, 32, 64, 128):
        for bk in (128, 256, 512):
            out.append(SkinnyConfig(block_n=bn, block_k=bk))
    out += [SkinnyConfig(32, 256, num_warps=2), SkinnyConfig(32, 256, num_warps=8),
            SkinnyConfig(32, 256, num_stages=3), SkinnyConfig(32, 256, num_stages=6),
            SkinnyConfig(64, 256, num_warps=8), SkinnyConfig(64, 256, num_stages=6)]
    return [c for c in out if k % c.block_k == 0]


def operands(k: int, n: int, m: int, fusion: str, key):
    """`calls` distinct input sets: (x, w, norm weight, residual) each, random, never zero."""
    sets = []
    gated = "gated" in fusion
    for i in range(FLAGS.calls):
        kx, kw, kn, kr = jax.random.split(jax.random.fold_in(key, i), 4)
        x = jax.random.normal(kx, (m, 2 * k if gated else k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        nw = jax.random.uniform(kn, (k,), jnp.bfloat16, 0.5, 1.5)
        r = jax.random.normal(kr, (m, n), jnp.bfloat16)
        sets.append((x, w, nw, r))
    return jax.block_until_ready(sets)


def run_fn(fusion: str, impl: str, config: SkinnyConfig | None):
    """fn(sets) running one product per set with `fusion` through `impl`."""
    def fn(sets):
        outs = []
        for x, w, nw, r in sets:
            outs.append(skinny_matmul(
                x, w, norm_weight=nw if "norm" in fusion else None, eps=1e-5,
                gated="gated" in fusion, residual=r if "residual" in fusion else None,
                config=config, impl=impl))
        return outs
    return fn


def time_us(fn, sets) -> float:
    return 1e6 * timing.time_per_call(fn, (sets,), FLAGS.calls, FLAGS.runs, FLAGS.queue)


def calibrate() -> dict:
    x = jax.random.bits(jax.random.key(0), (1 << 29,), jnp.uint32)  # 2 GiB
    t = timing.time_per_call(lambda x: x ^ jnp.uint32(1), (x,), 1, FLAGS.runs, FLAGS.queue)
    copy = 2 * x.nbytes / t / 1e12
    print(f"calib: copy {copy:.2f} TB/s (read + write)")
    return {"copy_TBps": copy}


def row(name, k, n, m, fusion, variant, us, calib, config=None) -> dict:
    tbs = k * n * 2 / (us * 1e-6) / 1e12
    copy = calib.get("copy_TBps")
    out = {"shape": name, "K": k, "N": n, "M": m, "fusion": fusion, "variant": variant,
           "us": us, "weight_TBps": tbs, "pct_copy": 100 * tbs / copy if copy else None,
           "config": dataclasses.asdict(config) if config else None}
    pct = f" ({out['pct_copy']:.0f}% copy)" if copy else ""
    print(f"{name:8s} {k}x{n} M={m:3d} {fusion:15s} {variant:28s} {us:9.1f} us "
          f"{tbs:5.2f} TB/s{pct}", flush=True)
    return out


def bench_shape(name: str, m: int, calib: dict, sweep: bool) -> list[dict]:
    k, n, fusion = SHAPES[name]
    k, n = int(k / FLAGS.scale), int(n / FLAGS.scale)
    rows = []
    fusions = ["plain"] if sweep else ["plain", fusion]
    for fu in fusions:
        sets = operands(k, n, m, fu, jax.random.key(m))
        xla = time_us(run_fn(fu, "reference", None), sets)
        rows.append(row(name, k, n, m, fu, "xla", xla, calib))
        configs = sweep_configs(k) if sweep else [skinny_config(m, k, n)]
        best = None
        for cfg in configs:
            try:
                us = time_us(run_fn(fu, FLAGS.impl, cfg), sets)
            except Exception as e:  # noqa: BLE001 - a tile Triton rejects is reported, skipped
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            label = (f"kernel {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}")
            rows.append(row(name, k, n, m, fu, label, us, calib, cfg) | {"speedup": xla / us})
            best = us if best is None else min(best, us)
        if best is not None:
            print(f"  best kernel: {xla / best:.2f}x XLA")
        del sets
    return rows


def main(_):
    calib = calibrate() if "calib" in FLAGS.modes else {}
    rows = []
    for mode in ("bench", "sweep"):
        if mode not in FLAGS.modes:
            continue
        for name in FLAGS.shapes:
            for m in map(int, FLAGS.ms):
                rows += [r | {"mode": mode} for r in bench_shape(name, m, calib, mode == "sweep")]
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "calib": calib, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    app.run(main)
