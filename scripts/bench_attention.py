"""Benchmark of the paged attention kernels against JAX's built-in Pallas kernel and XLA.

    python -m scripts.bench_attention --json_out=attention.json
    python -m scripts.bench_attention --modes=sweep     # tuning sweep of the kernels' tiles
    python -m scripts.bench_attention --modes=calib,softmax --chunks=4096   # softmax variants
    # an engine decode step's tiles:
    python -m scripts.bench_attention --modes=calib,step_decode --batches=64 --contexts=512 \
        --step_decode_tiles=64/1/4/3,64/2/4/3,128/2/4/2 --device_times

Shapes: 32 query heads, 8 kv heads, head_dim 128, page size 16, bf16 (flags change them).
- calib: the card's two ceilings, measured in the same run: a large bf16 elementwise copy
  (bytes read + written over time) and an 8192^3 bf16 matrix product (random data).
- decode: batch x context, every sequence at full context; achieved TB/s = K+V bytes read
  over time (the floor for decode), against ops.decode_attention.paged_attention, JAX's
  jax.experimental.pallas.ops.gpu.paged_attention (defaults) and an XLA jnp attention (gather
  the pages, bf16 einsums with float32 accumulation) on identical arrays.
- step_decode: the kernel an engine decode step actually runs (`step_attention`: the ragged
  kernel, one query token per sequence) at batch x context, with `ragged_config`'s tiles and
  each of --step_decode_tiles (block_k/splits/warps/stages); TB/s as in decode.
- prefill: one sequence's prompt chunk of T tokens attending causally to itself (plus a mixed
  ragged batch); TFLOP/s = 4 * H * D * (causal query-key pairs) over time, against the XLA jnp
  attention and cuDNN flash attention (jax.nn.dot_product_attention, contiguous K/V: a peer
  that does no paging).

Timing: each jitted program runs `--calls` calls on distinct input sets (distinct queries and
block tables over page groups that together exceed the L2 cache; each call's queries and table
a separate array, so that no slice is copied before the kernel); the program is queued
`--queue` times and synchronized once; time per call = wall time / (queue x calls), median of
`--runs`. The ~30 us dispatch of a jitted call is thus spread over many calls, as it is in a
decode step that runs attention once per layer. With `--device_times` each program is also
traced once by jax's profiler (`--queue` runs): "dev us" is the device's busy time per call
(the union of its kernels' intervals: the attention kernel and the small XLA kernels of the
call, such as the split merge, without the launch gaps between kernels), and the TB/s or
TFLOP/s from it, as a fraction of the ceiling measured the same way (calib's copy and matmul
programs traced too; issue 4 allows either measure).
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags


from ops.decode_attention import DecodeConfig, decode_config, paged_attention
from ops.ragged_attention import RaggedConfig, ragged_config, ragged_paged_attention
from scripts import decode_profile, timing
from scripts.common import write_json

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["calib", "decode", "prefill"],
                  "calib, decode, prefill, sweep, merge (key splits merged in the decode kernel "
                  "against the merge kernel after it), softmax (the ragged kernel's softmax "
                  "variants at --chunks), step_decode (the engine's ragged kernel on decode "
                  "steps at --batches x --contexts, with ragged_config's tiles and "
                  "--step_decode_tiles)")
flags.DEFINE_list("batches", ["1", "8", "32", "128"], "decode batch sizes")
flags.DEFINE_list("contexts", ["512", "2048", "4096", "8192", "32768"], "decode contexts")
flags.DEFINE_list("chunks", ["512", "1024", "2048", "4096", "8192"], "prefill chunk sizes")
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
flags.DEFINE_string("json_out", "", "write all rows as JSON here")
flags.DEFINE_list("ragged_config", [], "override: block_m,block_k,num_warps,num_stages")
flags.DEFINE_list("decode_config", [], "override: block_k,num_splits,num_warps,num_stages"
                  "[,merge_in_kernel (0 or 1)]")
flags.DEFINE_list("step_decode_tiles", [], "step_decode: more tiles of the ragged kernel, each "
                  "block_k/splits/warps/stages (block_m stays ragged_config's), e.g. 64/2/4/3")
flags.DEFINE_bool("device_times", False, "Also trace each program with jax's profiler: device "
                  "busy time per call (see the module docstring).")
flags.DEFINE_enum("impl", "pallas", ["pallas", "pallas_interpret"], "interpret: CPU smoke test")

L2_BYTES = 256 << 20  # distinct KV per program, several times the 60 MB L2


def time_per_call(fn, args, calls: int) -> float:
    """Seconds per attention call: `fn(*args)` runs `calls` of them (see the module docstring)."""
    return timing.time_per_call(fn, args, calls, FLAGS.runs, FLAGS.queue)


def measure(row: dict, fn, args, calls: int, work: float, unit: str, ceiling: str,
            calib: dict) -> None:
    """Times fn(*args) (`calls` calls) into row: us and work / time as `unit` (TBps for bytes,
    TFLOPs for FLOPs) with its fraction of calib[ceiling]; with --device_times the same from
    the device's busy time (dev_us, dev_<unit>, dev_frac), or dev_error."""
    frac = "frac_copy" if unit == "TBps" else "frac_matmul"
    t = time_per_call(fn, args, calls)
    row.update({"us": t * 1e6, unit: work / t / 1e12})
    row[frac] = row[unit] / calib[ceiling] if calib else None
    if FLAGS.device_times:
        dev = decode_profile.device_time_per_call(fn, args, calls, FLAGS.queue)
        row.update(dev)
        if "dev_us" in dev:
            row["dev_" + unit] = work / (dev["dev_us"] * 1e-6) / 1e12
            top = calib.get("dev_" + ceiling)  # device time against device time only
            row["dev_frac"] = row["dev_" + unit] / top if top else None


def calibrate() -> dict:
    """The card's ceilings: copy (read + write) and read-only bandwidth, bf16 matmul rate; with
    --device_times also the copy and matmul rates from device time (dev_copy_TBps,
    dev_matmul_TFLOPs), which the rows' device-time fractions are taken against."""
    key = jax.random.key(0)
    x = jax.random.bits(key, (1 << 30,), jnp.uint32)  # 4 GiB
    n = 8192
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    calib = {}
    for name, fn, args, work in (("copy_TBps", lambda x: x ^ jnp.uint32(1), (x,), 2 * x.nbytes),
                                 ("read_TBps", jnp.max, (x,), x.nbytes),
                                 ("matmul_TFLOPs", lambda a, b: a @ b, (a, b), 2 * n ** 3)):
        calib[name] = work / time_per_call(fn, args, 1) / 1e12
        if FLAGS.device_times and name != "read_TBps":
            dev = decode_profile.device_time_per_call(fn, args, 1, FLAGS.queue)
            if "dev_us" in dev:
                calib["dev_" + name] = work / (dev["dev_us"] * 1e-6) / 1e12
    print(f"calib: copy {calib['copy_TBps']:.2f} TB/s (read + write), read "
          f"{calib['read_TBps']:.2f} TB/s, bf16 matmul {calib['matmul_TFLOPs']:.0f} TFLOP/s"
          + (f"; device time: copy {calib['dev_copy_TBps']:.2f} TB/s, matmul "
             f"{calib['dev_matmul_TFLOPs']:.0f} TFLOP/s" if "dev_copy_TBps" in calib else ""))
    return calib


def random_inputs(key, calls: int, shape: tuple, dtype) -> tuple:
    """`calls` separate random arrays of `shape`: one per call of a benchmark program. Separate
    arrays, not slices of one stacked array: XLA copies a slice before a custom call (on the
    H200 such copies took 2.7 us per decode call and 16.7 us per 4k-token prefill call)."""
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
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention as builtin
    return builtin.paged_attention(q, k_pages, v_pages, tables, lengths)


def decode_bytes(batch: int, context: int, itemsize: int, quantized: bool) -> int:
    """K and V bytes a decode call reads (and their float32 scales on quantized pages): the
    floor's work."""
    tokens = batch * context * FLAGS.num_kv_heads
    return 2 * tokens * FLAGS.head_dim * itemsize + (2 * tokens * 4 if quantized else 0)


def parse_step_tiles() -> list[dict]:
    """--step_decode_tiles as the RaggedConfig fields each entry changes (block_k, num_splits,
    num_warps, num_stages); a malformed entry is a usage error (main parses them before
    anything is timed)."""
    out = []
    for text in FLAGS.step_decode_tiles:
        try:
            block_k, splits, warps, stages = (int(v) for v in text.split("/"))
        except ValueError:
            raise app.UsageError(f"--step_decode_tiles: {text!r} is not "
                                 "block_k/splits/warps/stages (four integers)")
        out.append(dict(block_k=block_k, num_splits=splits, num_warps=warps, num_stages=stages))
    return out


def bench_step_decode(batch: int, context: int, calib: dict, tiles: list[dict]) -> list[dict]:
    """The kernel an engine decode step runs (ops/paged_attention.py's `step_attention`): the
    ragged kernel over `batch` sequences of one query token each, every one at `context` cached
    tokens, with ragged_config's tiles (`dispatch` True) and with each of `tiles` (fields
    changed, `parse_step_tiles`); the work is the K and V bytes read, as in `bench_decode`."""
    calls = FLAGS.calls
    h, kvh, d, page = FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim, FLAGS.page_size
    quantized = bool(FLAGS.kv_dtype)
    pages_per_seq = context // page
    k, v, ks, vs, tables = make_cache(batch, pages_per_seq, calls, quantized)
    qs = random_inputs(jax.random.key(3), calls, (batch, h, d), jnp.dtype(FLAGS.dtype))
    starts = jnp.arange(batch + 1, dtype=jnp.int32)  # one token per sequence
    kv_lens = jnp.full((batch,), context, jnp.int32)
    kv_bytes = decode_bytes(batch, context, k.dtype.itemsize, quantized)
    base = ragged_config(batch, kvh, h // kvh, 1, pages_per_seq * page, d)
    rows = []
    for cfg in [base, *(dataclasses.replace(base, **tile) for tile in tiles)]:
        def ours(qs, k, v, ks, vs, tables, cfg=cfg):
            return tuple(ragged_paged_attention(qs[c], k, v, tables[c], starts, kv_lens,
                                                max_q_len=1, k_scales=ks, v_scales=vs,
                                                impl=FLAGS.impl, config=cfg)
                         for c in range(calls))
        row = {"kind": "decode", "impl": "ragged_step", "batch": batch, "context": context,
               "kv_dtype": str(k.dtype), "config": str(cfg), "dispatch": cfg == base}
        try:
            measure(row, ours, (qs, k, v, ks, vs, tables), calls, kv_bytes, "TBps",
                    "copy_TBps", calib)
        except Exception as e:  # a tile the shape does not take is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def bench_decode(batch: int, context: int, calib: dict, config=None, peers=True) -> list[dict]:
    calls = FLAGS.calls
    quantized = bool(FLAGS.kv_dtype)
    pages_per_seq = context // FLAGS.page_size
    k, v, ks, vs, tables = make_cache(batch, pages_per_seq, calls, quantized)
    qs = random_inputs(jax.random.key(3), calls, (batch, FLAGS.num_heads, FLAGS.head_dim),
                       jnp.dtype(FLAGS.dtype))
    lengths = jnp.full((batch,), context, jnp.int32)
    kv_bytes = decode_bytes(batch, context, k.dtype.itemsize, quantized)
    if config is None and FLAGS.decode_config:
        block_k, splits, warps, stages, *merge = map(int, FLAGS.decode_config)
        config = DecodeConfig(block_k, splits, warps, stages, merge_in_kernel=any(merge))
    cfg = config or decode_config(batch, FLAGS.num_kv_heads, pages_per_seq * FLAGS.page_size,
                                  FLAGS.head_dim)

    def ours(qs, k, v, ks, vs, tables):
        return tuple(paged_attention(qs[c], k, v, tables[c], lengths, k_scales=ks, v_scales=vs,
                                     impl=FLAGS.impl, config=cfg) for c in range(calls))

    impls = [("pallasite", ours)]
    if peers and not quantized:
        impls.append(("jax_builtin", lambda qs, k, v, ks, vs, tables: tuple(
            builtin_decode(qs[c], k, v, tables[c], lengths) for c in range(calls))))
        if batch * context <= FLAGS.peer_max_tokens:
            impls.append(("xla", lambda qs, k, v, ks, vs, tables: tuple(
                xla_decode(qs[c], k, v, tables[c], lengths) for c in range(calls))))
    rows = []
    for name, fn in impls:
        row = {"kind": "decode", "impl": name, "batch": batch, "context": context,
               "kv_dtype": str(k.dtype), "config": str(cfg) if name == "pallasite" else ""}
        try:
            measure(row, fn, (qs, k, v, ks, vs, tables), calls, kv_bytes, "TBps", "copy_TBps",
                    calib)
        except Exception as e:  # a peer that cannot run this shape is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def xla_prefill(q, k_pages, v_pages, tables, starts, kv_lens):
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


def bench_prefill(chunk: int, calib: dict, config=None, peers=True, mixed=False) -> list[dict]:
    """One sequence prefilling `chunk` tokens, or (mixed) a ragged step of several kinds."""
    calls = max(2, FLAGS.calls // 2)
    h, kvh, d, page = FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim, FLAGS.page_size
    if mixed:  # 2 chunks of chunk/2 after chunk cached tokens, 4 verifications, 58 decodes
        seqs = [(2 * (chunk // 2) + chunk, chunk // 2)] * 2 + [(4096, 5)] * 4 + [(4096, 1)] * 58
    else:
        seqs = [(chunk, chunk)]
    kv_max = max(n for n, _ in seqs)
    pages_per_seq = -(-kv_max // page)
    k, v, _, _, tables = make_cache(len(seqs), pages_per_seq, calls, False)
    num_tokens = sum(t for _, t in seqs)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum([t for _, t in seqs])]), jnp.int32)
    kv_lens = jnp.asarray([n for n, _ in seqs], jnp.int32)
    max_q_len = max(t for _, t in seqs)
    qs = random_inputs(jax.random.key(5), calls, (num_tokens, h, d), jnp.dtype(FLAGS.dtype))
    pairs = sum(t * (n - t) + t * (t + 1) // 2 for n, t in seqs)  # causal query-key pairs
    flops = 4 * h * d * pairs
    if config is None and FLAGS.ragged_config:
        bm, bk, warps, stages = map(int, FLAGS.ragged_config)
        config = RaggedConfig(bm, bk, 1, warps, stages)
    cfg = config or ragged_config(len(seqs), kvh, h // kvh, max_q_len, pages_per_seq * page, d)

    def ours(qs, k, v, tables):
        return tuple(ragged_paged_attention(qs[c], k, v, tables[c], starts, kv_lens,
                                            max_q_len=max_q_len, impl=FLAGS.impl, config=cfg)
                     for c in range(calls))

    args = (qs, k, v, tables)
    impls = [("pallasite", ours, args)]
    if peers and not mixed:
        impls.append(("xla", lambda qs, k, v, tables: tuple(
            xla_prefill(qs[c], k, v, tables[c], starts, kv_lens) for c in range(calls)), args))

        # cuDNN flash attention over the same K/V made contiguous ([1, T, KVH, D]) beforehand.
        kc = tuple(k[:, tables[c][0]].reshape(kvh, -1, d)[:, :chunk].swapaxes(0, 1)[None]
                   for c in range(calls))
        vc = tuple(v[:, tables[c][0]].reshape(kvh, -1, d)[:, :chunk].swapaxes(0, 1)[None]
                   for c in range(calls))

        def cudnn(qs, kc, vc, tables):
            del tables
            return tuple(jax.nn.dot_product_attention(qs[c][None], kc[c], vc[c], is_causal=True,
                                                      implementation="cudnn")
                         for c in range(calls))
        impls.append(("cudnn_contiguous", cudnn, (qs, kc, vc, tables)))
    rows = []
    for name, fn, fn_args in impls:
        row = {"kind": "prefill_mixed" if mixed else "prefill", "impl": name, "chunk": chunk,
               "tokens": num_tokens, "config": str(cfg) if name == "pallasite" else ""}
        try:
            measure(row, fn, fn_args, calls, flops, "TFLOPs", "matmul_TFLOPs", calib)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def sweep(calib: dict) -> list[dict]:
    """Tile / warp / stage / split variants of both kernels at the target shapes."""
    rows = []
    decode = [(8, 4096, c) for c in [(128, 2, 4, 3), (128, 3, 4, 3), (128, 4, 4, 3),
                                     (128, 5, 4, 3), (128, 4, 4, 4), (128, 4, 8, 3),
                                     (64, 4, 4, 3), (64, 6, 4, 3), (64, 4, 4, 5),
                                     (64, 8, 4, 4), (64, 4, 2, 3), (256, 2, 8, 2)]]
    decode += [(8, 8192, c) for c in [(128, 2, 4, 3), (128, 4, 4, 3), (128, 6, 4, 3),
                                      (64, 4, 4, 4)]]
    decode += [(32, 4096, c) for c in [(128, 1, 4, 3), (128, 2, 4, 3), (64, 2, 4, 4)]]
    decode = [(b, c, cfg, False) for b, c, cfg in decode]
    # The next tile's block-table entries read a step ahead (DecodeConfig.prefetch_slots).
    decode += [(1, 4096, c, True) for c in [(128, 16, 4, 3)]]
    decode += [(8, 4096, c, True) for c in [(128, 4, 4, 3), (128, 2, 4, 3), (64, 4, 4, 3)]]
    decode += [(8, 8192, c, True) for c in [(128, 4, 4, 3), (128, 6, 4, 3)]]
    for batch, context, (block_k, splits, warps, stages), prefetch in decode:
        rows += bench_decode(batch, context, calib, peers=False,
                             config=DecodeConfig(block_k, splits, warps, stages, prefetch))
        print(rows[-1])
    for block_m, block_k, warps, stages in [(128, 32, 4, 3), (128, 32, 4, 4), (128, 64, 4, 4),
                                            (128, 64, 4, 2), (128, 16, 4, 4), (256, 32, 8, 3),
                                            (256, 64, 8, 3), (256, 32, 8, 4), (64, 32, 4, 4),
                                            (128, 32, 4, 5)]:
        for prefetch in (False, True) if (block_m, block_k) == (128, 32) else (False,):
            cfg = RaggedConfig(block_m, block_k, 1, warps, stages, prefetch)
            rows += bench_prefill(4096, calib, config=cfg, peers=False)
            print(rows[-1])
    return rows


SOFTMAX_TILES = ((128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 2), (128, 32, 4, 5),
                 (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4))


def softmax_sweep(calib: dict) -> list[dict]:
    """The decode kernel at a few shapes, then ragged prefill at each --chunks size over prefill
    tiles, each with the softmax's exponent in PTX (ptx_softmax) and in jnp; the two variants
    run one after the other, so they share the machine's state."""
    rows = []
    for batch, context in ((1, 512), (1, 4096), (8, 4096), (8, 8192), (32, 4096)):
        cfg = decode_config(batch, FLAGS.num_kv_heads, context, FLAGS.head_dim)
        for ptx in (False, True):  # the decode kernel's heuristic tiles
            rows += bench_decode(batch, context, calib, peers=False,
                                 config=dataclasses.replace(cfg, ptx_softmax=ptx))
            print(rows[-1], flush=True)
    for chunk in map(int, FLAGS.chunks):
        for block_m, block_k, warps, stages in SOFTMAX_TILES:
            for ptx in (False, True):
                cfg = RaggedConfig(block_m, block_k, 1, warps, stages, ptx_softmax=ptx)
                rows += bench_prefill(chunk, calib, config=cfg, peers=False)
                print(rows[-1], flush=True)
    return rows


def merge_sweep(calib: dict) -> list[dict]:
    """Decode with its key splits merged inside the kernel (DecodeConfig.merge_in_kernel) against
    the same tiles merged by a kernel after it, alternating, at several split counts."""
    rows = []
    for batch, context, split_counts in [(1, 512, (2, 4)), (1, 4096, (8, 16)),
                                         (8, 4096, (4, 6, 9, 12)), (8, 8192, (4, 6, 9)),
                                         (16, 4096, (2, 3, 4))]:
        for splits in split_counts:
            for merge in (False, True):
                cfg = DecodeConfig(128, splits, 4, 3, merge_in_kernel=merge)
                rows += bench_decode(batch, context, calib, config=cfg, peers=False)
                print(rows[-1], flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'kind':14s} {'impl':17s} {'shape':>14s} {'us':>9s} {'TB/s':>6s} {'%copy':>6s} "
          f"{'TFLOP/s':>8s} {'%mm':>5s}  config")
    for r in rows:
        shape = (f"B{r['batch']} ctx{r['context']}" if r["kind"] == "decode"
                 else f"T{r['tokens']}")
        if "error" in r:
            print(f"{r['kind']:14s} {r['impl']:17s} {shape:>14s}  error: {r['error'][:90]}")
            continue
        tb = f"{r['TBps']:6.2f}" if "TBps" in r else " " * 6
        fc = f"{100 * r['frac_copy']:5.0f}%" if r.get("frac_copy") else " " * 6
        tf = f"{r['TFLOPs']:8.0f}" if "TFLOPs" in r else " " * 8
        fm = f"{100 * r['frac_matmul']:4.0f}%" if r.get("frac_matmul") else " " * 5
        dev = ""
        if "dev_us" in r:
            rate = r.get("dev_TBps") or r.get("dev_TFLOPs")
            frac = f" {100 * r['dev_frac']:4.0f}%" if r.get("dev_frac") else ""
            dev = f" | dev {r['dev_us']:8.1f} us {rate:7.2f}{frac}"
        print(f"{r['kind']:14s} {r['impl']:17s} {shape:>14s} {r['us']:9.1f} {tb} {fc} {tf} {fm}"
              f"{dev}  {r['config']}")


def save_rows(calib: dict, rows: list[dict]) -> None:
    """--json_out: every row so far, rewritten whole after each shape (scripts.common.write_json:
    a run cut short keeps the last complete file)."""
    if not FLAGS.json_out:
        return
    write_json(FLAGS.json_out, {
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "calib": calib,
        "timing": "jitted program of --calls calls on distinct inputs, queued --queue times, "
                  "one sync; median of --runs",
        "flags": {k: FLAGS[k].value for k in ("calls", "queue", "runs", "num_heads",
                                               "num_kv_heads", "head_dim", "page_size", "dtype",
                                               "kv_dtype")},
        "rows": rows})


def main(argv):
    del argv
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    step_tiles = parse_step_tiles()  # before the calibration: a bad entry fails at once
    calib = calibrate() if "calib" in FLAGS.modes else {}
    rows = []
    if "sweep" in FLAGS.modes:
        rows += sweep(calib)
        save_rows(calib, rows)
    if "merge" in FLAGS.modes:
        rows += merge_sweep(calib)
        save_rows(calib, rows)
    if "softmax" in FLAGS.modes:
        rows += softmax_sweep(calib)
        save_rows(calib, rows)
    if "decode" in FLAGS.modes:
        for batch in map(int, FLAGS.batches):
            for context in map(int, FLAGS.contexts):
                rows += bench_decode(batch, context, calib)
                print_table(rows[-3:])
                save_rows(calib, rows)
    if "step_decode" in FLAGS.modes:
        for batch in map(int, FLAGS.batches):
            for context in map(int, FLAGS.contexts):
                step_rows = bench_step_decode(batch, context, calib, step_tiles)
                rows += step_rows
                print_table(step_rows)
                save_rows(calib, rows)
    if "prefill" in FLAGS.modes:
        for chunk in map(int, FLAGS.chunks):
            rows += bench_prefill(chunk, calib)
            print_table(rows[-3:])
            save_rows(calib, rows)
        rows += bench_prefill(2048, calib, mixed=True)
    print()
    print_table(rows)
    save_rows(calib, rows)


if __name__ == "__main__":
    app.run(main)
