"""Benchmark of the paged attention kernel the engine runs against JAX's Pallas kernel, XLA and
cuDNN, as a fraction of the card's ceilings measured in the same run.

    python -m scripts.bench.attention --json_out=attention.json
    python -m scripts.bench.attention --modes=calib,decode --batches=64 --contexts=512 \
        --decode_tiles=64/1/4/3,64/2/4/3 --device_times      # tiles for the tuning table

Shapes: 32 query heads, 8 kv heads, head_dim 128, page size 16, bf16 (flags change them).
- calib: the card's ceilings: a large elementwise copy (bytes read + written over time) and an
  8192^3 bf16 matrix product.
- decode: the kernel of an engine decode step (ops/ragged_attention.py, one query token per
  sequence) at batch x context, every sequence at full context, with `ragged_config`'s tiles
  and each of --decode_tiles; against jax.experimental.pallas.ops.gpu.paged_attention and an
  XLA jnp attention on identical arrays. TB/s = K + V bytes read over time (the floor).
  On a TPU (or --impl=tpu_interpret) the kernel is ops/tpu_ragged_attention.py with its
  generation's blocks, against the XLA peer, and decode rows' fraction is of the chip's
  published HBM bandwidth (ops/tpu_chips.py), not of a measured copy.
- prefill: one sequence's prompt of T tokens attending causally to itself (then a mixed ragged
  step: two prompt chunks, four verifications, 58 decodes), with `ragged_config`'s tiles and
  each of --prefill_tiles; TFLOP/s = 4 * H * D * (causal query-key pairs) over time, against
  the XLA jnp attention and cuDNN flash attention over contiguous K/V (no paging).

Timing: each jitted program runs --calls calls on distinct inputs (queries and block tables
over page groups that together exceed the L2 cache), queued --queue times with one sync; time
per call = wall time / (queue x calls), median of --runs. With --device_times each program is
also traced once by jax's profiler: "dev us" is the device's busy time per call, and its
fraction is taken against the ceilings timed the same way.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged_attention

from ops.ragged_attention import ragged_config, ragged_paged_attention
from ops.tpu_chips import generation_of_device_kind
from ops.tpu_ragged_attention import tpu_ragged_paged_attention
from scripts.bench.common import (calibrate, error_text, published_floor, run_info,
                                  time_per_call, write_json)
from scripts.bench.profile import device_time_per_call

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["calib", "decode", "prefill"], "calib, decode, prefill")
flags.DEFINE_list("batches", ["1", "8", "32", "128"], "decode batch sizes")
flags.DEFINE_list("contexts", ["512", "2048", "4096", "8192", "32768"], "decode contexts")
flags.DEFINE_list("chunks", ["512", "1024", "2048", "4096", "8192"], "prefill prompt lengths")
flags.DEFINE_integer("num_heads", 32, "query heads")
flags.DEFINE_integer("num_kv_heads", 8, "kv heads")
flags.DEFINE_integer("head_dim", 128, "head dim")
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16"], "q / page dtype")
flags.DEFINE_enum("kv_dtype", "", ["", "int8", "float8_e4m3fn"], "quantized pages (decode)")
flags.DEFINE_integer("calls", 8, "attention calls (distinct inputs) per jitted program")
flags.DEFINE_integer("queue", 5, "programs queued before one sync")
flags.DEFINE_integer("runs", 3, "timed repetitions (median)")
flags.DEFINE_integer("peer_max_tokens", 1 << 19, "skip the XLA peer above batch x context")
flags.DEFINE_list("decode_tiles", [], "decode: more tiles of the kernel, each "
                  "block_k/splits/warps/stages (block_m stays ragged_config's), e.g. 64/2/4/3")
flags.DEFINE_list("prefill_tiles", [], "prefill: more tiles of the kernel, each "
                  "block_m/block_k/warps/stages, e.g. 128/32/4/3")
flags.DEFINE_integer("mixed_context", 4096, "prefill: context of the mixed step's decodes and "
                     "verifications")
flags.DEFINE_bool("device_times", False, "Also trace each program with jax's profiler: device "
                  "busy time per call (see the module docstring).")
flags.DEFINE_enum("impl", "pallas", ["pallas", "pallas_interpret", "tpu_interpret"],
                  "interpret: CPU smoke test (tpu_interpret: the TPU kernel, as on a TPU)")
flags.DEFINE_string("json_out", "", "write all rows as JSON here")

L2_BYTES = 256 << 20  # distinct KV per program, several times the 60 MB L2
DECODE_FIELDS = ("block_k", "num_splits", "num_warps", "num_stages")
PREFILL_FIELDS = ("block_m", "block_k", "num_warps", "num_stages")


def parse_tiles(flag: str, fields: tuple[str, ...]) -> list[dict]:
    """Each entry of --<flag> as the RaggedConfig fields it sets; a malformed entry is a usage
    error (main parses them before anything is timed)."""
    out = []
    for text in FLAGS[flag].value:
        try:
            values = [int(v) for v in text.split("/")]
        except ValueError:
            values = []
        if len(values) != len(fields):
            raise app.UsageError(f"--{flag}: {text!r} is not {'/'.join(fields)} "
                                 f"({len(fields)} integers)")
        out.append(dict(zip(fields, values)))
    return out


def measure(row: dict, fn, args, calls: int, work: float, unit: str, ceiling: str,
            calib: dict) -> None:
    """Times fn(*args) (`calls` calls) into row: us and work / time in `unit` (TBps for bytes,
    TFLOPs for FLOPs) with its fraction of calib[ceiling]; with --device_times the same from
    the device's busy time (dev_us, dev_<unit>, dev_frac), or dev_error."""
    t = time_per_call(fn, args, calls, FLAGS.runs, FLAGS.queue)
    row.update({"us": t * 1e6, unit: work / t / 1e12})
    row["frac"] = row[unit] / calib[ceiling] if ceiling in calib else None
    if FLAGS.device_times:
        dev = device_time_per_call(fn, args, calls, FLAGS.queue)
        row.update(dev)
        if "dev_us" in dev:
            row["dev_" + unit] = work / (dev["dev_us"] * 1e-6) / 1e12
            top = calib.get("dev_" + ceiling)  # device time against device time only
            row["dev_frac"] = row["dev_" + unit] / top if top else None


def random_inputs(key, calls: int, shape: tuple, dtype) -> tuple:
    """`calls` separate random arrays of `shape`, one per call of a benchmark program (not
    slices of one array: XLA copies a slice before a custom call)."""
    return tuple(jax.random.normal(jax.random.fold_in(key, c), shape, dtype)
                 for c in range(calls))


def make_cache(num_seqs: int, pages_per_seq: int, calls: int, quantized: bool):
    """Pages for `calls` input sets; sets share page groups only when a group exceeds L2."""
    h, d, s = FLAGS.num_kv_heads, FLAGS.head_dim, FLAGS.page_size
    dtype = jnp.dtype(FLAGS.kv_dtype or FLAGS.dtype) if quantized else jnp.dtype(FLAGS.dtype)
    set_pages = num_seqs * pages_per_seq
    set_bytes = 2 * set_pages * s * h * d * dtype.itemsize
    groups = max(1, min(calls, math.ceil(L2_BYTES / set_bytes)))
    num_pages = groups * set_pages
    keys = jax.random.split(jax.random.key(7), 4)
    shape = (h, num_pages, s, d)
    if quantized:
        k = jax.random.randint(keys[0], shape, -127, 128, jnp.int32).astype(jnp.int8)
        v = jax.random.randint(keys[1], shape, -127, 128, jnp.int32).astype(jnp.int8)
        if dtype != jnp.int8:
            k = (k.astype(jnp.float32) * (448 / 127)).astype(dtype)
            v = (v.astype(jnp.float32) * (448 / 127)).astype(dtype)
        ks = jax.random.uniform(keys[2], shape[:3], jnp.float32, 0.001, 0.01)
        vs = jax.random.uniform(keys[3], shape[:3], jnp.float32, 0.001, 0.01)
    else:
        k = jax.random.normal(keys[0], shape, dtype)
        v = jax.random.normal(keys[1], shape, dtype)
        ks = vs = None
    rng = np.random.default_rng(0)
    tables = tuple(jnp.asarray(
        (c % groups) * set_pages + rng.permutation(set_pages).reshape(num_seqs, pages_per_seq),
        jnp.int32) for c in range(calls))  # calls x [num_seqs, W]
    return k, v, ks, vs, tables


def on_tpu() -> bool:
    """The engine's attention is the TPU kernel (ops/tpu_ragged_attention.py): on a TPU, or
    interpreted with --impl=tpu_interpret."""
    return jax.default_backend() == "tpu" or FLAGS.impl == "tpu_interpret"


def tpu_attention(qs, k, v, ks, vs, tables, starts, lengths, max_q_len: int, calls: int):
    """The TPU kernel over `calls` input sets, with the device's block sizes."""
    generation = generation_of_device_kind(jax.devices()[0].device_kind)
    return tuple(tpu_ragged_paged_attention(
        qs[c], k, v, tables[c], starts, lengths, max_q_len=max_q_len, k_scales=ks, v_scales=vs,
        generation=generation, interpret=FLAGS.impl == "tpu_interpret") for c in range(calls))


def xla_decode(q, k_pages, v_pages, tables, lengths):
    """XLA peer: gather the pages, bf16 einsums with float32 accumulation, masked softmax."""
    b, h, d = q.shape
    kvh, _, s, _ = k_pages.shape
    w = tables.shape[1]
    k = k_pages[:, tables].reshape(kvh, b, w * s, d)
    v = v_pages[:, tables].reshape(kvh, b, w * s, d)
    qg = q.reshape(b, kvh, h // kvh, d)
    logits = jnp.einsum("bngd,nbkd->bngk", qg, k, preferred_element_type=jnp.float32)
    logits = logits * d ** -0.5
    visible = jnp.arange(w * s)[None, :] < lengths[:, None]
    logits = jnp.where(visible[:, None, None], logits, -1e30)
    p = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    out = jnp.einsum("bngk,nbkd->bngd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, h, d).astype(q.dtype)


def builtin_decode(q, k_pages, v_pages, tables, lengths):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation of the Triton backend
        return jax_paged_attention.paged_attention(q, k_pages, v_pages, tables, lengths)


def decode_bytes(batch: int, context: int, itemsize: int, quantized: bool) -> int:
    """K and V bytes a decode call reads (and their float32 scales on quantized pages)."""
    tokens = batch * context * FLAGS.num_kv_heads
    return 2 * tokens * FLAGS.head_dim * itemsize + (2 * tokens * 4 if quantized else 0)


def bench_decode(batch: int, context: int, calib: dict, tiles: list[dict]) -> list[dict]:
    """The engine's decode kernel (one query token per sequence) with ragged_config's tiles
    (`dispatch` True) and each of `tiles`, then the peers (bf16 pages only)."""
    calls = FLAGS.calls
    h, kvh, d, page = FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim, FLAGS.page_size
    quantized = bool(FLAGS.kv_dtype)
    pages_per_seq = context // page
    k, v, ks, vs, tables = make_cache(batch, pages_per_seq, calls, quantized)
    qs = random_inputs(jax.random.key(3), calls, (batch, h, d), jnp.dtype(FLAGS.dtype))
    starts = jnp.arange(batch + 1, dtype=jnp.int32)  # one token per sequence
    lengths = jnp.full((batch,), context, jnp.int32)
    kv_bytes = decode_bytes(batch, context, k.dtype.itemsize, quantized)
    base = ragged_config(batch, kvh, h // kvh, 1, pages_per_seq * page, d)
    impls = []
    if on_tpu():  # the TPU kernel with its generation's blocks; no GPU tiles or peer
        impls.append(("pallasite_tpu", lambda qs, k, v, ks, vs, tables: tpu_attention(
            qs, k, v, ks, vs, tables, starts, lengths, 1, calls), "tpu blocks", True))
        tiles = None
    for cfg in [] if tiles is None else [base, *(dataclasses.replace(base, **tile)
                                                 for tile in tiles)]:
        def ours(qs, k, v, ks, vs, tables, cfg=cfg):
            return tuple(ragged_paged_attention(qs[c], k, v, tables[c], starts, lengths,
                                                max_q_len=1, k_scales=ks, v_scales=vs,
                                                impl=FLAGS.impl, config=cfg)
                         for c in range(calls))
        impls.append(("pallasite", ours, str(cfg), cfg == base))
    if not quantized:
        if not on_tpu():
            impls.append(("jax_builtin", lambda qs, k, v, ks, vs, tables: tuple(
                builtin_decode(qs[c], k, v, tables[c], lengths) for c in range(calls)), "",
                False))
        if batch * context <= FLAGS.peer_max_tokens:
            impls.append(("xla", lambda qs, k, v, ks, vs, tables: tuple(
                xla_decode(qs[c], k, v, tables[c], lengths) for c in range(calls)), "", False))
    rows = []
    for name, fn, config, dispatch in impls:
        row = {"kind": "decode", "impl": name, "batch": batch, "context": context,
               "kv_dtype": str(k.dtype), "config": config, "dispatch": dispatch}
        try:
            measure(row, fn, (qs, k, v, ks, vs, tables), calls, kv_bytes, "TBps",
                    "published_TBps" if "published_TBps" in calib else "copy_TBps", calib)
        except Exception as e:  # a tile or peer that cannot run this shape is a result
            row["error"] = error_text(e)
        rows.append(row)
    return rows


def xla_prefill(q, k_pages, v_pages, tables, kv_lens):
    """XLA peer for one sequence: gather its pages, causal masked softmax, bf16 einsums."""
    t, h, d = q.shape
    kvh, _, s, _ = k_pages.shape
    w = tables.shape[1]
    k = k_pages[:, tables[0]].reshape(kvh, w * s, d)
    v = v_pages[:, tables[0]].reshape(kvh, w * s, d)
    qg = q.reshape(t, kvh, h // kvh, d)
    logits = jnp.einsum("tngd,nkd->ngtk", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    pos = kv_lens[0] - t + jnp.arange(t)
    visible = jnp.arange(w * s)[None, :] <= pos[:, None]
    logits = jnp.where(visible[None, None], logits, -1e30)
    p = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    out = jnp.einsum("ngtk,nkd->tngd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(t, h, d).astype(q.dtype)


def bench_prefill(chunk: int, calib: dict, tiles: list[dict], mixed: bool = False) -> list[dict]:
    """One sequence prefilling `chunk` tokens, or (mixed) a ragged step of several kinds: the
    kernel with ragged_config's tiles and each of `tiles`, then (not mixed) the peers."""
    calls = max(2, FLAGS.calls // 2)
    h, kvh, d, page = FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim, FLAGS.page_size
    if mixed:  # 2 chunks of chunk/2 after chunk cached tokens, 4 verifications, 58 decodes
        context = FLAGS.mixed_context
        seqs = [(2 * (chunk // 2) + chunk, chunk // 2)] * 2 + [(context, 5)] * 4 + [
            (context, 1)] * 58
    else:
        seqs = [(chunk, chunk)]
    pages_per_seq = -(-max(n for n, _ in seqs) // page)
    k, v, _, _, tables = make_cache(len(seqs), pages_per_seq, calls, False)
    num_tokens = sum(t for _, t in seqs)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum([t for _, t in seqs])]), jnp.int32)
    kv_lens = jnp.asarray([n for n, _ in seqs], jnp.int32)
    max_q_len = max(t for _, t in seqs)
    qs = random_inputs(jax.random.key(5), calls, (num_tokens, h, d), jnp.dtype(FLAGS.dtype))
    pairs = sum(t * (n - t) + t * (t + 1) // 2 for n, t in seqs)  # causal query-key pairs
    flops = 4 * h * d * pairs
    base = ragged_config(len(seqs), kvh, h // kvh, max_q_len, pages_per_seq * page, d)
    args = (qs, k, v, tables)
    impls = []
    if on_tpu():  # the TPU kernel with its generation's blocks; no GPU tiles or cuDNN
        impls.append(("pallasite_tpu", lambda qs, k, v, tables: tpu_attention(
            qs, k, v, None, None, tables, starts, kv_lens, max_q_len, calls), args,
            "tpu blocks", True))
        tiles = None
    for cfg in [] if tiles is None else [base, *(dataclasses.replace(base, **tile)
                                                 for tile in tiles)]:
        def ours(qs, k, v, tables, cfg=cfg):
            return tuple(ragged_paged_attention(qs[c], k, v, tables[c], starts, kv_lens,
                                                max_q_len=max_q_len, impl=FLAGS.impl,
                                                config=cfg) for c in range(calls))
        impls.append(("pallasite", ours, args, str(cfg), cfg == base))
    if not mixed:
        impls.append(("xla", lambda qs, k, v, tables: tuple(
            xla_prefill(qs[c], k, v, tables[c], kv_lens) for c in range(calls)), args, "",
            False))
        # cuDNN flash attention over the same K/V made contiguous ([1, T, KVH, D]) beforehand
        kc = tuple(k[:, tables[c][0]].reshape(kvh, -1, d)[:, :chunk].swapaxes(0, 1)[None]
                   for c in range(calls))
        vc = tuple(v[:, tables[c][0]].reshape(kvh, -1, d)[:, :chunk].swapaxes(0, 1)[None]
                   for c in range(calls))

        def cudnn(qs, kc, vc):
            return tuple(jax.nn.dot_product_attention(qs[c][None], kc[c], vc[c], is_causal=True,
                                                      implementation="cudnn")
                         for c in range(calls))
        if not on_tpu():
            impls.append(("cudnn_contiguous", cudnn, (qs, kc, vc), "", False))
    rows = []
    for name, fn, fn_args, config, dispatch in impls:
        row = {"kind": "prefill_mixed" if mixed else "prefill", "impl": name, "chunk": chunk,
               "tokens": num_tokens, "config": config, "dispatch": dispatch}
        try:
            measure(row, fn, fn_args, calls, flops, "TFLOPs", "matmul_TFLOPs", calib)
        except Exception as e:  # e.g. cuDNN off a GPU: a result
            row["error"] = error_text(e)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'kind':14s} {'impl':17s} {'shape':>14s} {'us':>9s} {'TB/s':>6s} {'TFLOP/s':>8s} "
          f"{'floor':>6s}  config")
    for r in rows:
        shape = (f"B{r['batch']} ctx{r['context']}" if r["kind"] == "decode"
                 else f"T{r['tokens']}")
        if "error" in r:
            print(f"{r['kind']:14s} {r['impl']:17s} {shape:>14s}  error: {r['error'][:90]}")
            continue
        tb = f"{r['TBps']:6.2f}" if "TBps" in r else " " * 6
        tf = f"{r['TFLOPs']:8.1f}" if "TFLOPs" in r else " " * 8
        frac = f"{r['frac']:6.0%}" if r.get("frac") is not None else " " * 6
        dev = ""
        if "dev_us" in r:
            rate = r.get("dev_TBps") or r.get("dev_TFLOPs")
            dev_frac = f" {r['dev_frac']:4.0%}" if r.get("dev_frac") else ""
            dev = f" | dev {r['dev_us']:8.1f} us {rate:7.2f}{dev_frac}"
        print(f"{r['kind']:14s} {r['impl']:17s} {shape:>14s} {r['us']:9.1f} {tb} {tf} {frac}"
              f"{dev}  {r['config']}")


def save_rows(calib: dict, rows: list[dict]) -> None:
    """--json_out: every row so far, rewritten whole after each shape."""
    if FLAGS.json_out:
        write_json(FLAGS.json_out, run_info() | {
            "calib": calib, "flags": {k: FLAGS[k].value for k in (
                "calls", "queue", "runs", "num_heads", "num_kv_heads", "head_dim", "page_size",
                "dtype", "kv_dtype")}, "rows": rows})


def main(argv):
    del argv
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    decode_tiles = parse_tiles("decode_tiles", DECODE_FIELDS)  # a bad entry fails at once
    prefill_tiles = parse_tiles("prefill_tiles", PREFILL_FIELDS)
    unknown = sorted(set(FLAGS.modes) - {"calib", "decode", "prefill"})
    if unknown:
        raise app.UsageError(f"--modes: unknown {', '.join(unknown)} (calib, decode, prefill)")
    calib = calibrate(device_times=FLAGS.device_times) if "calib" in FLAGS.modes else {}
    calib |= published_floor()  # on a TPU: decode rows' fraction of the published bandwidth
    rows = []
    if "decode" in FLAGS.modes:
        for batch in map(int, FLAGS.batches):
            for context in map(int, FLAGS.contexts):
                new = bench_decode(batch, context, calib, decode_tiles)
                rows += new
                print_table(new)
                save_rows(calib, rows)
    if "prefill" in FLAGS.modes:
        chunks = list(map(int, FLAGS.chunks))
        for chunk in chunks:
            new = bench_prefill(chunk, calib, prefill_tiles)
            rows += new
            print_table(new)
            save_rows(calib, rows)
        rows += bench_prefill(min(chunks + [2048]), calib, [], mixed=True)
    print()
    print_table(rows)
    save_rows(calib, rows)


if __name__ == "__main__":
    app.run(main)
