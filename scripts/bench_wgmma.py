"""Benchmark of ops/quant_wgmma.py (INT4 / INT8 codes stored [N, K] times a few bf16 rows on
Hopper) against XLA's bf16 product and the Triton "nk" paths of ops/quant_matmul.py.

    python -m scripts.bench_wgmma --modes=check,table --json_out=wgmma.json
    python -m scripts.bench_wgmma --modes=sweep --ms=16 --shapes=4096x28672,4096x4096

Shapes: Llama-3.1-8B's products K x N (q/k/v 4096x6144, o 4096x4096, gate/up 4096x28672,
down 14336x4096, lm head 4096x128256) at `--ms` rows.
- check: the kernel against `int4_matmul_reference` / `int8_matmul_reference` on the same
  random codes (a few configs, offsets and per-channel scales among them); relative max error.
- table: per shape and M, device time per product of XLA's bf16 dot (the peer, weights
  [K, N]), the kernel with the dispatch's tiles (`wgmma_config`: INT4 groups of --group_size,
  INT8 per channel), the same tiles on mma.sync (`mma` rows, instruction="mma", up to
  MAX_MMA_ROWS rows), the warp-specialized persistent kernel (`ws` rows, `ws_config`; where
  the dispatch runs that one, from LARGE_M_ROWS rows, `wg1` rows: the one-warpgroup row tiles
  of `row_tile_config` instead), and
  with `--triton` the Triton "nk" path it replaced
  (PALLASITE_WGMMA=off in ops/quant_matmul.py's dispatch: Triton up to 128 rows, then XLA's
  dequantize + dot), with `--xla` XLA's dequantize + dot itself; TB/s = codes and scales read
  over the device time.
  Past MAX_ROWS rows (prefill) the kernel runs row tiles (WgmmaConfig.block_m).
- sweep: the tile variants of `ops.quant_wgmma.sweep_configs` per shape, bits and M (block_k,
  block_n, splits, stages; wgmma and, up to MAX_MMA_ROWS rows, mma.sync; the warp-specialized
  kernel with 2-3 consumers).
- bounds: where a step's time goes, by taking parts away (timing only: the probes' rows
  compute garbage): INT4 in groups of --group_size against INT4 per channel (the cost of the
  group scale on every weight), and INT4 / INT8 per channel with the code conversion taken
  out (`noconvert`: each loaded 32-bit word used as bf16 pairs as it is), with no code tile
  loaded (`noload`: a constant tile multiplies x; the pipeline and the wgmmas), and with no
  wgmma at all (`pipeline only`: the TMA copies and barrier waits, nothing else), and INT4 per
  channel in steps of 256 and 512 K (fewer steps per code); the rows' M shows how the tensor
  work scales. Per shape first `read_int4` / `read_int8` (M = 0): XLA reading the per-channel
  codes' bytes and nothing else (scripts/read_floor.py), the floor a pipeline-only row is
  measured against.
- tiles: at each of `--tiles` (block_k/stages/block_n/splits, `-` for the dispatch's value,
  then block_m=R or consumers=C: 256/4/128/1/block_m=8, or -/2/-/-/block_m=8 for the
  dispatch's tiles with two stages in row tiles of 8), INT4 in groups of --group_size
  (steps may span several groups), INT4 / INT8 per channel, and each per channel with the
  pipeline only: how the step's width, the stages in flight and the programs bound the
  product; INT4 also with each step's codes read as one contiguous block (`contiguous tiles`:
  the bytes a tile-by-tile layout would read; timing only); `--tile_probes` keeps some of them.
- run: no timing: the kernel's product of each shape, bits and M (the dispatch's tiles, or
  `--run_tile`), launched `--calls` x `--queue` times from the host (one jitted product: XLA
  cannot merge them), without jax's profiler: a fixed kernel set for Nsight Compute's
  replays, e.g.
  `ncu --kernel-name regex:wgmma --launch-skip 2 --launch-count 1 --section
  ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis python -m scripts.bench_wgmma
  --modes=run --shapes=4096x28672 --ms=16 --bits=4 --asymmetric`.
With --json_out the rows are saved as each comes; with --resume as well, a run cut short (the
10-minute limit of a device call) goes on where it stopped when the same command runs again:
the file's timed rows come back as they were (marked `resumed`) and only the others are timed.
With --asymmetric the timed codes carry offsets (zero points, the RTN / GPTQ / AWQ default):
INT4 groups add them inside the kernel, the other forms in XLA after it. The timed codes lie
along K in --k_order: "wgmma" (the default), the order the model stores on a Hopper GPU
(`ops.matmul.device_k_order`), so the kernel reads x as it is, as in the model's step;
"natural" adds an XLA gather of x to every product (the rows of the sessions before the
thirty-sixth). The codes are random either way; `check` compares natural-order codes.
Times are device busy time per product from jax's profiler (`scripts.decode_profile`): each
program runs `--calls` products on distinct weight sets, queued `--queue` times; kernel rows
also print the Mosaic GPU kernel's own time (`kernel_us`: without the wrapper's XLA kernels,
the gather of x into the K order, padding, split sums). The kernel
needs a Hopper GPU; elsewhere every row records why it did not run.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from ops import quant_wgmma as qw
from ops.quant_matmul import (int4_matmul, int4_matmul_reference, int8_matmul,
                              int8_matmul_reference)
from scripts import decode_profile
from scripts.common import write_json
from scripts.read_floor import read_floor

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["check", "table"], "check, table, sweep, bounds, tiles, run")
flags.DEFINE_list("shapes", ["4096x6144", "4096x4096", "4096x28672", "14336x4096",
                             "4096x128256"], "K x N")
flags.DEFINE_list("ms", ["1", "16", "64"], "activation rows")
flags.DEFINE_list("bits", ["4", "8"], "weight bits")
flags.DEFINE_integer("group_size", 128, "INT4 group size (INT8 is per channel)")
flags.DEFINE_integer("calls", 8, "products (distinct weight sets) per program")
flags.DEFINE_integer("queue", 3, "programs queued in the traced run")
WS_FORMS = ("ws", "ws3", "wsc", "ws3c")  # warp-specialized: 2 / 3 consumers, c: chained
flags.DEFINE_list("forms", ["mma", "ws"], "table: the kernel's other forms timed after the "
                  "dispatch's: mma, ws (two consumers; wg1 where the dispatch runs ws), ws3 "
                  "(three consumers, where N is of 192 columns), wsc / ws3c (the same with "
                  "each SM's units in one chained pipeline)")
flags.DEFINE_bool("triton", False, "table: also time the Triton 'nk' path of the same codes")
flags.DEFINE_bool("xla", False, "table: also time XLA's dequantize + dot of the same codes "
                  "(the path of other GPUs for many rows)")
flags.DEFINE_list("tiles", ["128/3/128/1", "256/3/128/1", "256/4/64/4"],
                  "tiles mode: block_k/stages/block_n/splits[/name=value...] of each tile "
                  "probed ('-': the dispatch's)")
flags.DEFINE_multi_string("tile_probes", [], "tiles mode: only these probes, one a flag "
                          "(names hold commas: --tile_probes='int4 grouped' --tile_probes="
                          "'int4 per channel, pipeline only'); none: all")
flags.DEFINE_enum("k_order", "wgmma", ["wgmma", "natural"],
                  "how the timed codes lie along K (TransposedWeight.k_order): wgmma, the "
                  "model's order on Hopper (no gather of x), or natural (a gather per product)")
flags.DEFINE_bool("asymmetric", False, "time the codes with offsets (zero points): INT4 groups "
                  "add them in the kernel, the other forms after it in XLA")
flags.DEFINE_string("run_tile", "", "run: block_k/stages/block_n/splits (else the dispatch's)")
flags.DEFINE_list("run_removed", [], "run: parts the kernel leaves out (timing probes, garbage "
                  "products): any of conversion, load, product, scatter")
flags.DEFINE_string("json_out", "", "write the rows as JSON here (rewritten after every row)")
flags.DEFINE_bool("resume", False, "with --json_out: reuse that file's timed rows (the same "
                  "product, tiles, probe, codes, --calls and --queue) and time only the others, "
                  "so that a run cut by a time limit goes on where it stopped when run again")

RESUMED: dict[str, dict] = {}  # a timed row's request -> its row from --json_out (--resume)


def codes_and_scales(bits: int, k: int, n: int, group: int, key, asymmetric=False):
    """Random codes stored [N, K] (INT4 int32 words [N, K/8], INT8 uint8 [N, K]), bf16 scales
    (and offsets) [G, N]; never all zero."""
    kc, ks, ko = jax.random.split(key, 3)
    if bits == 4:
        w_t = jax.lax.bitcast_convert_type(jax.random.bits(kc, (n, k // 8), jnp.uint32),
                                           jnp.int32)
    else:
        w_t = jax.random.bits(kc, (n, k), jnp.uint8)
    groups = -(-k // group)
    s = jax.random.uniform(ks, (groups, n), jnp.float32, 0.001, 0.01).astype(jnp.bfloat16)
    o = ((jax.random.normal(ko, (groups, n)) * 0.01).astype(jnp.bfloat16) if asymmetric
         else None)
    return w_t, s, o


def group_of(bits: int, k: int) -> int:
    return FLAGS.group_size if bits == 4 else k


def fixed_case(bits: int, m: int, k: int, n: int, group: int, asymmetric: bool):
    """x [M, K] bf16 and the codes, scales and offsets of `codes_and_scales`, seeded by the
    shape (the same case on every run): (x, w_t, s, o)."""
    key = jax.random.key(m + k + n + bits)
    w_t, s, o = codes_and_scales(bits, k, n, group, key, asymmetric)
    x = jax.random.normal(jax.random.fold_in(key, 1), (m, k)).astype(jnp.bfloat16)
    return x, w_t, s, o


def check(bits, m, k, n, group, config=None, asymmetric=False) -> dict:
    row = dict(mode="check", bits=bits, M=m, K=k, N=n, group=group, asymmetric=asymmetric,
               config=str(config or qw.wgmma_config(bits, m, k, n, group)))
    x, w_t, s, o = fixed_case(bits, m, k, n, group, asymmetric)
    try:
        y = jax.jit(lambda x, w, s, o: qw.wgmma_matmul(x, w, s, o, bits=bits, group_size=group,
                                                       config=config))(x, w_t, s, o)
        ref_fn = int4_matmul_reference if bits == 4 else int8_matmul_reference
        ref = np.asarray(ref_fn(x, w_t.T, s, o, group_size=group))
        err = float(np.abs(np.asarray(y, np.float32) - ref).max() / np.abs(ref).max())
        row.update(rel_max_err=err, ok=err < 1e-2)
    except Exception as e:  # recorded with the reason (no Hopper GPU, say)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def kernel_config(name: str, bits: int, k: int, n: int, m: int, config, group: int):
    """The tiles a `time_product` row of the kernel runs: `config`, else those of its form
    (`name`); None for the other rows (bf16, triton, xla)."""
    if name not in ("wgmma", "mma", "wg1", *WS_FORMS):
        return None
    if name in WS_FORMS:  # the warp-specialized persistent kernel
        cfg = config or qw.ws_config(bits, m, k, n, group, consumers=3 if "3" in name else 2)
        return dataclasses.replace(cfg, chained=name.endswith("c"))
    if name == "wg1":  # one warpgroup per program in row tiles
        return config or qw.row_tile_config(m, k, n, group)
    cfg = config or qw.wgmma_config(bits, m, k, n, group)
    if name == "mma":  # the same tiles, mma.sync m16n8k16 instead of wgmma
        cfg = dataclasses.replace(  # (its steps lie in one group)
            cfg, instruction="mma", block_k=qw.step_in_group(cfg.block_k, k, group))
    return cfg


def time_product(name: str, bits: int, k: int, n: int, m: int, config=None,
                 group: int | None = None, probe: str | None = None) -> dict:
    """Device microseconds per product of `name`: bf16 (XLA), wgmma (the kernel, `config` or the
    dispatch's tiles), mma / ws / ws3 / wsc / ws3c / wg1 (its mma.sync, warp-specialized with
    two or three consumers, unchained or chained, and one-warpgroup row-tile forms), triton
    (ops/quant_matmul.py's "nk" path) or xla (its dequantize + dot); `group` overrides
    `group_of`; `probe` names the parts taken out (`bound_rows`). With --resume a row an
    earlier run timed (its `request` key: the same product, tiles, probe, codes, --calls and
    --queue) comes back as it was, marked `resumed`."""
    calls = FLAGS.calls
    group = group or group_of(bits, k)
    cfg = kernel_config(name, bits, k, n, m, config, group)
    request = json.dumps([name, bits, k, n, m, str(cfg), group, probe, FLAGS.asymmetric,
                          FLAGS.k_order, calls, FLAGS.queue])
    if request in RESUMED:  # timed by an earlier run of the same command (--resume)
        return RESUMED[request] | {"resumed": True}
    row = dict(mode="time", impl=name, bits=16 if name == "bf16" else bits, M=m, K=k, N=n,
               group=None if name == "bf16" else group, request=request)
    if probe:
        row["probe"] = probe
    xs = tuple(jax.random.normal(jax.random.key(100 + c), (m, k)).astype(jnp.bfloat16)
               for c in range(calls))
    try:
        if name == "bf16":
            ws = tuple(jax.random.normal(jax.random.key(200 + c), (k, n), jnp.bfloat16)
                       for c in range(calls))
            nbytes = 2 * k * n
            fn, args = (lambda xs, ws: tuple(jnp.dot(xs[c], ws[c]) for c in range(calls))), (xs, ws)
        else:
            sets = [codes_and_scales(bits, k, n, group, jax.random.key(300 + c),
                                     FLAGS.asymmetric) for c in range(calls)]
            ws, ss = tuple(a[0] for a in sets), tuple(a[1:] for a in sets)  # (scales, offsets)
            nbytes = k * n * bits // 8 + 2 * ss[0][0].size * (2 if FLAGS.asymmetric else 1)
            row["asymmetric"], row["k_order"] = FLAGS.asymmetric, FLAGS.k_order
            if cfg is not None:  # the kernel in one of its forms
                row["config"] = str(cfg)
                fn = lambda xs, ws, ss: tuple(qw.wgmma_matmul(  # noqa: E731
                    xs[c], ws[c], *ss[c], bits=bits, group_size=group, config=cfg,
                    k_order=FLAGS.k_order) for c in range(calls))
            else:  # triton (traced below with PALLASITE_WGMMA=off) or xla (the reference)
                product = int4_matmul if bits == 4 else int8_matmul
                impl = "reference" if name == "xla" else None
                fn = lambda xs, ws, ss: tuple(product(  # noqa: E731
                    xs[c], ws[c], *ss[c], group_size=group, layout="nk", impl=impl,
                    k_order=FLAGS.k_order) for c in range(calls))
            args = (xs, ws, ss)
        if name == "triton":
            os.environ["PALLASITE_WGMMA"] = "off"
        try:
            dev = decode_profile.device_time_per_call(fn, args, calls, FLAGS.queue)
        finally:
            os.environ.pop("PALLASITE_WGMMA", None)
        row.update(dev)
        if "dev_us" in dev:
            row["TBps"] = nbytes / dev["dev_us"] / 1e6
    except Exception as e:  # recorded with the reason
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


BOUND_PROBES = (  # (probe, bits, per channel, what is taken out: ops.quant_wgmma.parts_removed,
    #                  changes to the dispatch's tiles)
    ("int4 grouped", 4, False, (), {}), ("int4 per channel", 4, True, (), {}),
    ("int4 per channel, noconvert", 4, True, ("conversion",), {}),
    ("int4 per channel, noload", 4, True, ("load",), {}),
    ("int4 per channel, pipeline only", 4, True, ("product",), {}),
    # wider steps (fewer barriers and copies per code; per channel, so that the probes do not
    # depend on the dispatch's steps over groups)
    ("int4 per channel, 256-K steps", 4, True, (), {"block_k": 256}),
    ("int4 per channel, 512-K steps", 4, True, (), {"block_k": 512, "stages": 2}),
    ("int8 per channel", 8, True, (), {}),
    ("int8 per channel, noconvert", 8, True, ("conversion",), {}),
    ("int8 per channel, noload", 8, True, ("load",), {}),
    ("int8 per channel, pipeline only", 8, True, ("product",), {}))


TILE_PROBES = (  # `tiles` mode: (probe, bits, per channel, what is taken out) at each tile
    ("int4 grouped", 4, False, ()), ("int4 per channel", 4, True, ()),
    ("int4 per channel, pipeline only", 4, True, ("product",)),
    ("int4 grouped, contiguous tiles", 4, False, ("scatter",)),
    ("int4 per channel, pipeline only, contiguous tiles", 4, True, ("product", "scatter")),
    ("int8 per channel", 8, True, ()), ("int8 per channel, pipeline only", 8, True, ("product",)))


TILE_FIELDS = ("block_k", "stages", "block_n", "num_splits")  # a tile's four numbers, in order
# its name=value fields after them
EXTRA_TILE_FIELDS = ("block_m", "consumers", "chained", "fold", "consumer_k")


def parse_tile(text: str) -> dict:
    """'block_k/stages/block_n/splits[/name=value...]' (e.g. 256/3/128/1 or -/2/-/-/block_m=8;
    '-' keeps the dispatch's value) -> the WgmmaConfig fields it changes."""
    fields = text.split("/")
    usage = (f"--tiles: {text!r} is not block_k/stages/block_n/splits[/name=value...] "
             f"(integers or '-'; names {', '.join(EXTRA_TILE_FIELDS)})")
    if len(fields) < 4:
        raise app.UsageError(usage)
    out = {}
    try:
        for name, value in zip(TILE_FIELDS, fields[:4]):
            if value != "-":
                out[name] = int(value)
        for extra in fields[4:]:
            name, _, value = extra.partition("=")
            if name not in EXTRA_TILE_FIELDS:
                raise ValueError(name)
            out[name] = int(value)
    except ValueError:
        raise app.UsageError(usage)
    return out


def tile_probes(bits_list: list[int]) -> list[tuple]:
    """The probes of --tiles: every TILE_PROBES probe of --bits at every tile."""
    unknown = set(FLAGS.tile_probes) - {probe for probe, *_ in TILE_PROBES}
    if unknown:
        raise app.UsageError(f"--tile_probes: {sorted(unknown)} not among "
                             f"{[probe for probe, *_ in TILE_PROBES]}")
    return [(f"{probe} {tile}", bits, per_channel, removed, parse_tile(tile))
            for tile in FLAGS.tiles for probe, bits, per_channel, removed in TILE_PROBES
            if bits in bits_list and (not FLAGS.tile_probes or probe in FLAGS.tile_probes)]


def bound_rows(k: int, n: int, m: int, probes=BOUND_PROBES):
    """The `bounds` rows of one shape, one at a time as each is timed: the kernel with the
    dispatch's tiles, as it is, with parts taken out and with wider steps (`probes`,
    BOUND_PROBES or `tile_probes`; a probe whose tiles the shape does not take is recorded
    with the reason)."""
    for probe, bits, per_channel, removed, changes in probes:
        group = k if per_channel else FLAGS.group_size
        cfg = dataclasses.replace(qw.wgmma_config(bits, m, k, n, group), **changes)
        if not qw.supports(bits, m, k, n, group, jnp.bfloat16, jnp.bfloat16, cfg):
            yield dict(mode="time", impl="wgmma", bits=bits, M=m, K=k, N=n, group=group,
                       probe=probe, error=f"the tiles {cfg} do not take {m}x{k}x{n}")
            continue
        with qw.parts_removed(*removed):
            yield time_product("wgmma", bits, k, n, m, cfg, group=group, probe=probe)


def read_rows(k: int, n: int, bits_list: list[int]) -> list[dict]:
    """`bounds`: XLA reading the bytes of per-channel INT4 / INT8 codes and scales and nothing
    else (scripts/read_floor.py; rows `read_int4` / `read_int8`, M = 0), to set beside the
    `pipeline only` probes on the same machine."""
    def time_fn(prog, args):  # the device's time per read where the profiler has one
        dev = decode_profile.device_time_per_call(prog, args, FLAGS.calls, FLAGS.queue)
        return {"us": dev["dev_us"], **dev} if "dev_us" in dev else {}
    rows = []
    for bits in bits_list:
        row = dict(mode="time", bits=bits, M=0, K=k, N=n, group=k)
        try:
            row |= read_floor(f"int{bits}", k * n * bits // 8 + 2 * n, FLAGS.calls, time_fn)
        except RuntimeError as e:  # no device times here (a CPU)
            row |= {"impl": f"read_int{bits}", "error": str(e)}
        rows.append(row)
    return rows


def report(row: dict, bf16_us: dict) -> None:
    key = (row["K"], row["N"], row["M"])
    if "error" in row or "dev_error" in row:
        print(f"{row['K']:>6}x{row['N']:<7} M={row['M']:<3} {row.get('impl', 'check'):<6} "
              f"int{row['bits']} {row.get('probe', '')}: "
              f"{row.get('error') or row.get('dev_error')}")
        return
    if row["mode"] == "check":
        print(f"check int{row['bits']} M={row['M']} {row['K']}x{row['N']} g{row['group']} "
              f"offsets={row['asymmetric']}: rel max err {row['rel_max_err']:.2e} "
              f"{'ok' if row['ok'] else 'FAIL'}")
        return
    if row["impl"] == "bf16":
        bf16_us[key] = row["dev_us"]
    speedup = bf16_us.get(key, float("nan")) / row["dev_us"]
    row["x_bf16"] = speedup
    own = kernel_us(row)  # the Mosaic kernel alone, without the wrapper's XLA kernels
    print(f"{row['K']:>6}x{row['N']:<7} M={row['M']:<3} {row['impl']:<6} int{row['bits']:<2} "
          f"{row['dev_us']:8.1f} us {row['TBps']:5.2f} TB/s x{speedup:5.2f}"
          f"{f' (kernel {own:.1f} us)' if own else ''}  "
          f"{row.get('probe', '')} {row.get('config', '')}"
          f"{' (resumed)' if row.get('resumed') else ''}")


def kernel_us(row: dict) -> float | None:
    """Device microseconds per product of the row's Mosaic GPU kernel alone (from the
    profiler's top kernels: the x gather and padding, split sums and output slices left out),
    or None where no such kernel ran."""
    own = [us for name, us in row.get("kernels", {}).items() if "mosaic_gpu" in name]
    if own:
        row["kernel_us"] = sum(own)
        return row["kernel_us"]
    return None


def run_product(bits: int, k: int, n: int, m: int) -> dict:
    """`run` mode: the kernel's product on fixed random codes, launched --calls x --queue
    times, waited for; the row says what ran (or why it did not)."""
    group = group_of(bits, k)
    cfg = qw.wgmma_config(bits, m, k, n, group)
    if FLAGS.run_tile:
        cfg = dataclasses.replace(cfg, **parse_tile(FLAGS.run_tile))
    row = dict(mode="run", bits=bits, M=m, K=k, N=n, group=group, config=str(cfg),
               asymmetric=FLAGS.asymmetric, k_order=FLAGS.k_order,
               removed=list(FLAGS.run_removed))
    x, w_t, s, o = fixed_case(bits, m, k, n, group, FLAGS.asymmetric)
    fn = jax.jit(lambda x, w, s, o: qw.wgmma_matmul(x, w, s, o, bits=bits, group_size=group,
                                                    config=cfg, k_order=FLAGS.k_order))
    try:
        with qw.parts_removed(*FLAGS.run_removed):  # traced on the first call
            outs = [fn(x, w_t, s, o) for _ in range(FLAGS.calls * FLAGS.queue)]
        jax.block_until_ready(outs)
        row["kernels_run"] = FLAGS.calls * FLAGS.queue
    except Exception as e:  # recorded with the reason (no Hopper GPU, say)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def resumable_rows(path: str, device: str) -> dict[str, dict]:
    """--resume: the rows of an earlier run's --json_out (`path`) on this kind of device that
    have a device time, by their `request`; none if the file does not exist yet."""
    if not path:
        raise app.UsageError("--resume needs --json_out: the file of the run to go on with")
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            earlier = json.load(f)
        rows = earlier["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise app.UsageError(f"--resume: {path} is not a bench_wgmma JSON file ({e})")
    if earlier.get("device") != device:
        raise app.UsageError(f"--resume: {path} was timed on {earlier.get('device')!r}, "
                             f"not on this {device!r}")
    return {row["request"]: row for row in rows
            if isinstance(row, dict) and "request" in row and "dev_us" in row}


def main(_):
    shapes = [tuple(int(v) for v in s.split("x")) for s in FLAGS.shapes]
    ms = [int(m) for m in FLAGS.ms]
    bits_list = [int(b) for b in FLAGS.bits]
    rows, bf16_us = [], {}
    if set(FLAGS.forms) - {"mma", *WS_FORMS}:
        raise app.UsageError(f"--forms: {FLAGS.forms}, not among mma, {', '.join(WS_FORMS)}")
    unknown = sorted(set(FLAGS.run_removed) - set(qw.PROBE_PARTS))
    if unknown:
        raise app.UsageError(f"--run_removed: {unknown} not among {list(qw.PROBE_PARTS)}")
    device = jax.devices()[0].device_kind
    print(f"device: {device}; Hopper kernel available: {qw.available()}")
    if FLAGS.resume:
        RESUMED.update(resumable_rows(FLAGS.json_out, device))
        print(f"--resume: {len(RESUMED)} timed rows of {FLAGS.json_out} reused")
    run_flags = {k: str(v) for k, v in FLAGS.flag_values_dict().items()
                 if k in ("modes", "shapes", "ms", "bits", "group_size", "calls", "queue",
                          "triton", "xla")}

    def add(row: dict, show: bool = True) -> None:  # printed, and saved as it comes
        rows.append(row)
        if show:
            report(row, bf16_us)
        if FLAGS.json_out:
            write_json(FLAGS.json_out, {"device": device, "rows": rows, "flags": run_flags})
    if "check" in FLAGS.modes:
        for bits, m, k, n, group, cfg, asym in (
                (4, 16, 4096, 4096, 128, None, False), (4, 5, 4096, 4096, 128, None, True),
                (4, 1, 4096, 6144, 4096, None, False), (8, 16, 4096, 4096, 4096, None, False),
                (8, 64, 4096, 4096, 4096, None, True), (8, 3, 4096, 6144, 128, None, False),
                (4, 40, 1024, 512, 256, qw.WgmmaConfig(block_k=256, num_splits=2, stages=2),
                 False)):
            add(check(bits, m, k, n, group, cfg, asym))
    for mode in ("table", "sweep"):
        if mode not in FLAGS.modes:
            continue
        for k, n in shapes:
            for m in ms:
                add(time_product("bf16", 16, k, n, m))
                for bits in bits_list:
                    configs = [None] if mode == "table" else qw.sweep_configs(bits, k, n, m)
                    for cfg in configs:
                        add(time_product("wgmma", bits, k, n, m, cfg))
                    if mode == "table":  # the kernel's other forms, then the peers asked for
                        group = group_of(bits, k)  # `wg1` where the dispatch takes `ws`'s
                        form = ("wg1" if qw.wgmma_config(bits, m, k, n, group).consumers
                                else "ws")
                        forms = {"mma": qw.padded_rows(m) <= qw.MAX_MMA_ROWS, "ws": True,
                                 "wsc": True, "ws3": n % 192 == 0,  # 3 x 64 columns
                                 "ws3c": n % 192 == 0}
                        others = [form if name == "ws" else name for name in FLAGS.forms
                                  if forms.get(name)] + [
                            peer for peer in ("triton", "xla") if FLAGS[peer].value]
                        for name in others:
                            add(time_product(name, bits, k, n, m))
    if "run" in FLAGS.modes:
        for k, n in shapes:
            for m in ms:
                for bits in bits_list:
                    row = run_product(bits, k, n, m)
                    add(row, show=False)
                    print(f"run int{bits} M={m} {k}x{n}: "
                          f"{row.get('error') or row['kernels_run']} {row['config']}")
    for mode, probes in (("bounds", BOUND_PROBES), ("tiles", tile_probes(bits_list))):
        if mode not in FLAGS.modes:
            continue
        for k, n in shapes:
            if mode == "bounds":
                for row in read_rows(k, n, bits_list):
                    add(row)
            for m in ms:
                add(time_product("bf16", 16, k, n, m))
                for row in bound_rows(k, n, m, probes):
                    add(row)
    if FLAGS.json_out:
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
