"""Decode at the memory roofline: tokens/s, step time and bandwidth utilization, with an HF peer.

    python -m scripts.bench.decode --model=llama3.2-1b,llama3.1-8b --batch=1,8,32,128 \
        --context=512,4096 --variants=base,fused --json_out=decode.json

For each model (random weights of the preset's real shapes, made on the device; with --quant
the linears are random codes of the same spread, made as codes, or RTN-quantized on a mesh)
and each variant (`base`; `fused`: q/k/v and gate/up fused,
models.llama.fuse_projections; `gemv`: fused, and the layers transposed for ops/gemv.py's
kernel, models.llama.transpose_for_gemv; `mesh`: the sharded runner over a --tp / --ep mesh;
`scan`, `unrolled`: base with that layer loop, models/layer_scan.py, for a same-run A/B), one
ModelRunner holds a paged KV cache of random values for the largest batch and context. Rows:
- decode (batch B, context C): the runner's jitted step as the engine issues it (host padding
  + dispatch) queued --steps times with one sync, median of --runs; tokens/s = B / step. The
  floor is the bytes a step must read (the weights it multiplies by + K/V of B x C tokens) over
  the copy bandwidth measured in the same run (on a TPU: the chip's published HBM bandwidth,
  ops/tpu_chips.py; on the CPU a matrix-vector product's read where faster:
  scripts.bench.common.floor_TBps); MBU = floor / step. A mixture of experts counts only the
  experts the step's B tokens are expected to touch (uniform routing, as random weights give a
  decode step: scripts.bench.moe_routing): its touched-bytes floor. `loop`: the engine's loop
  without its scheduler (batch built on the host, step and argmax, tokens back every step).
  --multi_step: rounds of that many steps in one program (the engine's multi-step rounds).
- prefill: one sequence's prompt of T tokens; tokens/s and FLOP utilization against the bf16
  matrix rate measured in the same run.
- greedy: --greedy_steps greedy tokens, which every variant (and --greedy_reference's run)
  must reproduce.
- hf: HF transformers `generate` on the same shapes (scripts/bench/hf_peer.py in subprocesses,
  run before jax takes the GPU), eager and for --hf_static_compile models compiled; skipped
  when torch or transformers is missing.
- profile: for each --profile model:batch:context (a decode row) or model:prefill:tokens (a
  prefill row), jax's profiler over a few steps: device busy time per step and where it goes.
JSON is rewritten after every row; a failing row (out of memory, say) records its error.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
from absl import app, flags

from configs.model import get_preset
from engine.mesh import make_mesh
from engine.sampling import SamplingArrays
from models import moe
from ops import moe_matmul
from ops.backends import device_kernels
from scripts.bench import decode_model as dm
from scripts.bench import profile
from scripts.bench.common import (calibrate, error_text, floor_TBps, markdown_table,
                                  published_floor, run_info, write_json)
from scripts.common import fail, kernels_line, resolve_dtype, setup_jax

flags.DEFINE_list("model", ["llama3.2-1b"], "Presets.")
flags.DEFINE_list("batch", ["1", "8", "32", "128"], "Decode batch sizes.")
flags.DEFINE_list("context", ["512", "4096"], "Decode contexts (tokens attended per sequence).")
flags.DEFINE_integer("max_model_len", None, "Block tables as wide as an engine of this context "
                     "holds (a runner keeping its tables on the device reads rows this wide); "
                     "default: the longest --context.")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float16", "float32"],
                  "Weights and KV (default: float32 on the CPU, whose XLA products would convert "
                  "bfloat16 weights every step; bfloat16 elsewhere).")
flags.DEFINE_enum("matmul_precision", "default", ["default", "high", "highest"],
                  "jax's default matmul precision: on a GPU 'default' lets float32 products "
                  "use TF32; 'highest' keeps them float32 (for float32 greedy checks).")
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "bf16", "int8", "fp8"],
                  "KV-cache storage: auto (--dtype), bf16, or int8 / fp8 pages with a float32 "
                  "scale per token and head (the floor counts the scales' bytes).")
flags.DEFINE_enum("quant", "none", ["none", "int8", "int4"],
                  "Weight-only quantized linears, random codes (int4: group 128).")
flags.DEFINE_bool("quant_lm_head", False, "With --quant: the untied output head quantized too.")
VARIANTS = ("base", "fused", "gemv", "mesh", "scan", "unrolled")
flags.DEFINE_list("variants", ["base"], "base, fused, gemv, mesh, scan, unrolled (see the "
                  "module docstring).")
flags.DEFINE_integer("tp", None, "Tensor-parallel devices of the `mesh` variant (implies it).")
flags.DEFINE_integer("ep", None, "Expert-parallel devices of the `mesh` variant (implies it): "
                     "a mixture of experts' experts split over them.")
flags.DEFINE_enum("moe_large_form", "tiles", ["tiles", "ragged"],
                  "Mixtures of experts: the XLA form of expert products of more rows than experts "
                  "(ops/moe_matmul.py; 'ragged' with XLA_FLAGS=--xla_gpu_experimental_use_ragged"
                  "_dot_fusion=true tries XLA's grouped GEMM).")
flags.DEFINE_integer("moe_all_to_all_min_tokens", None, "Mixtures of experts on an --ep mesh: "
                     "steps of more tokens per data shard dispatch by all-to-all (default: "
                     "models.moe.ALL_TO_ALL_MIN_TOKENS; 0: always, to compare the forms).")
flags.DEFINE_integer("steps", 32, "Decode steps queued per timing.")
flags.DEFINE_integer("runs", 3, "Timings per row (median).")
flags.DEFINE_integer("loop_steps", 8, "Steps of the synced engine-style loop per row (0: off).")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("multi_step", 0, "Also time rounds of this many decode steps in one "
                     "program, per model step, and check their greedy tokens (0: off).")
flags.DEFINE_list("prefill", ["512", "4096"], "Prompt lengths of the prefill rows.")
flags.DEFINE_integer("greedy_steps", 16, "Greedy tokens of the variants' check (0: off).")
flags.DEFINE_integer("greedy_batch", 4, "Sequences of the greedy check.")
flags.DEFINE_integer("greedy_context", 512, "Context of the greedy check.")
flags.DEFINE_string("greedy_reference", None, "A JSON of an earlier run: compare greedy tokens.")
flags.DEFINE_bool("hf", True, "Measure the HF transformers peer when torch is importable.")
flags.DEFINE_list("hf_batch", ["1", "8", "32", "128"], "Batches of the HF peer.")
flags.DEFINE_list("hf_context", ["512", "4096"], "Contexts of the HF peer.")
flags.DEFINE_integer("hf_max_tokens", 131072, "HF rows: skip batch x context above this.")
flags.DEFINE_integer("hf_new_tokens", 16, "Tokens per HF generate.")
flags.DEFINE_list("hf_static_compile", [], "Models also run with static cache + torch.compile "
                  "(batch 1, the first --hf_context).")
flags.DEFINE_integer("hf_timeout", 240, "Seconds per HF subprocess.")
flags.DEFINE_list("profile", [], "Rows to profile (jax profiler): model:batch:context for a "
                  "decode row, model:prefill:tokens for a prefill row.")
flags.DEFINE_integer("profile_steps", 5, "Steps traced per profile.")
flags.DEFINE_string("profile_dir", "/tmp/bench_decode_profile", "Profiler output directory.")
flags.DEFINE_bool("calibrate", True, "Measure copy bandwidth and matmul rate (else use "
                  "--copy_tbs / --matmul_tflops).")
flags.DEFINE_float("copy_tbs", 4.1, "Copy bandwidth, TB/s, when not calibrating.")
flags.DEFINE_float("matmul_tflops", 750.0, "bf16 matmul rate, TFLOP/s, when not calibrating.")
flags.DEFINE_string("label", "", "A name for this run (e.g. the XLA flags it ran with).")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
flags.DEFINE_integer("seed", 0, "Seed of weights, cache values and tokens.")
FLAGS = flags.FLAGS
# The decode step is what this benchmark measures, and it compiles few programs: XLA's
# exhaustive GEMM tiling search is worth its compile time here (scripts/common.py).
FLAGS.set_default("exhaustive_gemm_search", True)


def save(results: dict) -> None:
    if FLAGS.json_out:
        write_json(FLAGS.json_out, results)


def run_hf_peer(results: dict) -> None:
    """HF rows from scripts/bench/hf_peer.py subprocesses (each with a time limit)."""
    if not FLAGS.hf:
        return
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        results["hf_skipped"] = f"not importable: {', '.join(missing)}"
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(os.path.dirname(os.path.abspath(FLAGS.json_out or "x")), "hf_peer.json")
    jobs = [(m, FLAGS.hf_batch, FLAGS.hf_context, []) for m in FLAGS.model]
    jobs += [(m, ["1"], FLAGS.hf_context[:1], ["--static_compile"])
             for m in FLAGS.hf_static_compile]
    for model, batches, contexts, extra in jobs:
        cmd = [sys.executable, "-m", "scripts.bench.hf_peer", f"--model={model}",
               f"--batch={','.join(batches)}", f"--context={','.join(contexts)}",
               f"--new_tokens={FLAGS.hf_new_tokens}", f"--max_tokens={FLAGS.hf_max_tokens}",
               f"--json_out={out}", *extra]
        start = time.perf_counter()
        if os.path.exists(out):
            os.remove(out)
        try:
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                                  timeout=FLAGS.hf_timeout)
            status = f"exit {proc.returncode}" + (
                "" if proc.returncode == 0 else f": {proc.stderr.strip()[-400:]}")
        except subprocess.TimeoutExpired:
            status = f"timeout after {FLAGS.hf_timeout} s"
        part = json.load(open(out)) if os.path.exists(out) else {"rows": []}
        results.setdefault("hf", []).extend(part["rows"])
        results.setdefault("hf_runs", []).append(
            {"cmd": " ".join(cmd[1:]), "status": status, "wall_s": time.perf_counter() - start,
             **{k: part[k] for k in ("torch", "transformers", "device", "init_s") if k in part}})
        print(f"hf peer {model} {' '.join(extra)}: {status}; {len(part['rows'])} rows", flush=True)
        save(results)


def pages(tokens: int) -> int:
    return -(-tokens // FLAGS.page_size)


def row_shapes() -> list[tuple[int, int]]:
    """(sequences, tokens each) of every row the flags ask for: the decode rows (with room for
    a multi-step round), the prefills and the greedy check. The cache holds the largest one's
    pages, not max(sequences) x max(tokens): 64 sequences of 512 tokens and one prompt of
    4096 need 2,048 + 1 pages, not 16,384."""
    shapes = [(int(b), int(c) + FLAGS.multi_step) for b in FLAGS.batch for c in FLAGS.context]
    shapes += [(1, int(t)) for t in FLAGS.prefill]
    if FLAGS.greedy_steps:
        shapes.append((FLAGS.greedy_batch, FLAGS.greedy_context + FLAGS.multi_step))
    return shapes


def row_tables(batch: int, tokens: int) -> np.ndarray:
    """int32 [batch, pages of `tokens`]: distinct pages of the cache, shuffled, for one row."""
    return dm.page_tables(batch, pages(tokens), FLAGS.seed)


def variant_setup(name: str, variant: str, dtype, mesh):
    """(cfg, model, runner) of one model variant, with a random cache sized for every row."""
    cfg, model = dm.build_model(get_preset(name), dtype, FLAGS.seed, FLAGS.quant,
                                fused=variant in ("fused", "gemv"),
                                mesh=mesh if variant == "mesh" else None,
                                quant_lm_head=FLAGS.quant_lm_head, gemv=variant == "gemv")
    shapes = row_shapes()
    kernels = None  # this device's choice; scan / unrolled: its layer loop forced
    if variant in ("scan", "unrolled"):
        kernels = dataclasses.replace(device_kernels(), layer_loop=variant)
    runner = dm.make_runner(cfg, model, max(b for b, _ in shapes),
                            max([t for _, t in shapes] + [FLAGS.max_model_len or 0]),
                            FLAGS.page_size, mesh if variant == "mesh" else None,
                            FLAGS.kv_cache_dtype, kernels,
                            max_pages=max(b * pages(t) for b, t in shapes))
    dm.fill_cache_random(runner, FLAGS.seed + 1)
    return cfg, model, runner


def decode_row(row: dict, name: str, variant: str, cfg, model, runner, rng, calib,
               devices: int) -> dict:
    """One decode row (batch row['batch'], context row['context']): step time, floor and MBU,
    multi-step rounds and the loop when asked, a profile when --profile names it."""
    b, c = row["batch"], row["context"]
    room = row_tables(b, c + FLAGS.multi_step)  # [B, pages of C tokens and a round]
    table = room[:, :pages(c)]  # [B, pages of C tokens]
    batch = dm.decode_batch(rng.integers(0, cfg.vocab_size, b), np.full(b, c - 1), table,
                            FLAGS.page_size)
    row |= dm.time_queued(runner, batch, FLAGS.steps, FLAGS.runs)
    if FLAGS.multi_step:
        rounds = dm.decode_batch(batch.token_ids, np.full(b, c - 1), room, FLAGS.page_size)
        row |= dm.time_multi_step(runner, rounds, FLAGS.multi_step,
                                  max(FLAGS.steps // FLAGS.multi_step, 2), FLAGS.runs)
    row["programs"] = dm.compile_count(runner)
    w = dm.weight_bytes_per_step(cfg, model, b)
    kv = dm.kv_bytes_per_step(cfg, runner.cache.k_pages[0].dtype, b, c)
    # a mesh reads its bytes with every device: the floor is the bytes over all of them
    # on a TPU the chip's published bandwidth, on the CPU its matrix-vector read (floor_TBps)
    floor = (w + kv) / (floor_TBps(calib) * 1e12) / devices
    row |= {"weight_bytes": w, "kv_bytes": kv, "floor_s": floor,
            "tokens_per_s": b / row["step_s"], "mbu": floor / row["step_s"],
            "roofline_tokens_per_s": b / floor}
    if FLAGS.loop_steps:
        _, loop_s = dm.greedy_loop(runner, batch.token_ids, c - FLAGS.loop_steps - 1, table,
                                   FLAGS.loop_steps)
        row |= {"loop_step_s": loop_s, "loop_tokens_per_s": b / loop_s,
                "loop_mbu": floor / loop_s}
    if f"{name}:{b}:{c}" in FLAGS.profile:
        row["profile"] = profiled(runner, batch, f"{name}_{variant}_{b}_{c}")
    return row


def profiled(runner, batch, label: str) -> dict:
    """jax's profile of --profile_steps steps of `batch` (profile.profile_steps), its summary
    printed; the trace goes under --profile_dir/label."""
    prof = profile.profile_steps(runner, batch, FLAGS.profile_steps,
                                 os.path.join(FLAGS.profile_dir, label))
    print(profile.format_summary(prof), flush=True)
    return prof


def measure_model(name: str, variant: str, results: dict, calib: dict, mesh) -> None:
    """Greedy check, decode rows and prefill rows of one model variant."""
    dtype = resolve_dtype(FLAGS.dtype)
    head = {"model": name, "variant": variant, "quant": FLAGS.quant, "dtype": dtype.name,
            "kv_cache_dtype": FLAGS.kv_cache_dtype, "label": FLAGS.label}
    start = time.perf_counter()
    cfg, model, runner = variant_setup(name, variant, dtype, mesh)
    rng = np.random.default_rng(FLAGS.seed)
    devices = mesh.devices.size if variant == "mesh" else 1
    results["setup"].append(head | {"devices": devices, "setup_s": time.perf_counter() - start,
                                    "cache_bytes": runner.cache.nbytes()})
    if FLAGS.greedy_steps:
        b, c, n = FLAGS.greedy_batch, FLAGS.greedy_context, FLAGS.greedy_steps
        first = rng.integers(0, cfg.vocab_size, b)
        table = row_tables(b, c + FLAGS.multi_step)[:, :pages(c)]
        tokens, _, gaps = dm.greedy_loop(runner, first, c - n - 1, table, n, margins=True)
        results["greedy"].append(head | {"batch": b, "context": c, "tokens": tokens.tolist(),
                                         "margins": gaps.tolist()})
        if FLAGS.multi_step:  # the same tokens from rounds of the loop
            results["greedy"].append(head | {
                "variant": f"{variant}+multi_step", "batch": b, "context": c,
                "tokens": multi_step_tokens(runner, first, c - n - 1, table, n)})
        save(results)
    for b in map(int, FLAGS.batch):
        for c in map(int, FLAGS.context):
            row = head | {"batch": b, "context": c}
            try:
                decode_row(row, name, variant, cfg, model, runner, rng, calib, devices)
            except Exception as e:  # noqa: BLE001 - a failing row is a result
                row["error"] = error_text(e)
            results["decode"].append(row)
            print(format_row(row), flush=True)
            save(results)
    for t in map(int, FLAGS.prefill):
        row = head | {"prompt_tokens": t}
        try:
            batch = dm.prefill_batch(rng.integers(0, cfg.vocab_size, t),
                                     row_tables(1, t)[0], FLAGS.page_size)
            row |= dm.time_queued(runner, batch, max(FLAGS.steps // 8, 2), FLAGS.runs)
            flops = dm.prefill_flops(cfg, t)
            row |= {"tokens_per_s": t / row["step_s"], "flops": flops,
                    "mfu": flops / row["step_s"] / (calib["matmul_TFLOPs"] * 1e12) / devices}
            if f"{name}:prefill:{t}" in FLAGS.profile:
                row["profile"] = profiled(runner, batch, f"{name}_{variant}_prefill_{t}")
        except Exception as e:  # noqa: BLE001
            row["error"] = error_text(e)
        results["prefill"].append(row)
        print(f"prefill {name} {variant} T={t}: " + (
            row.get("error") or f"{row['step_s'] * 1e3:.2f} ms, {row['tokens_per_s']:.0f} tok/s,"
            f" MFU {row['mfu']:.1%}"), flush=True)
        save(results)
    del runner, model
    gc.collect()
    jax.clear_caches()


def multi_step_tokens(runner, first: np.ndarray, position: int, table: np.ndarray,
                      steps: int) -> list:
    """Greedy tokens [batch, steps] of the greedy check's loop run as rounds of --multi_step
    steps (ModelRunner.execute_multi_step) from the same first tokens and position."""
    tokens, out = np.asarray(first), []
    while len(out) < steps + 1:  # the loop's untimed first step included
        k = min(FLAGS.multi_step, steps + 1 - len(out))
        batch = dm.decode_batch(tokens, np.full(len(tokens), position + len(out)), table,
                                FLAGS.page_size)
        rounds = np.asarray(runner.execute_multi_step(
            batch, SamplingArrays.defaults(len(tokens)), k)[0])[:, : len(tokens)]  # [k, B]
        out += list(rounds)
        tokens = rounds[-1]
    return np.stack(out[1:], axis=1).tolist()


def format_row(row: dict) -> str:
    head = f"{row['model']:<12} {row['variant']:<6} B={row['batch']:<4} C={row['context']:<6}"
    if "error" in row:
        return f"{head} error: {row['error']}"
    loop = f"  loop {row['loop_step_s'] * 1e3:7.3f} ms" if "loop_step_s" in row else ""
    if "multi_step_s" in row:
        loop += (f"  {row['multi_steps']}-step rounds {row['multi_step_s'] * 1e3:7.3f} ms/step "
                 f"(dispatch holds the host {row['multi_step_dispatch_s'] * 1e3:.3f} ms)")
    return (f"{head} {row['step_s'] * 1e3:8.3f} ms (dispatch {row['dispatch_s'] * 1e3:.3f} ms) "
            f"{row['tokens_per_s']:9.1f} tok/s  floor {row['floor_s'] * 1e3:7.3f} ms  "
            f"MBU {row['mbu']:6.1%}{loop}  first call {row['first_call_s']:.1f} s  compiles "
            f"during timing: {row['compiles_during_timing']}")


def greedy_check(results: dict) -> dict:
    """Equal greedy tokens across this run's variants and the reference run's, per model: the
    first differing step and how near a tie the first variant's choice was there."""
    entries = list(results["greedy"])
    if FLAGS.greedy_reference:
        with open(FLAGS.greedy_reference) as f:
            ref = json.load(f)
        entries += [e | {"variant": f"{e['variant']} (reference {e.get('label', '')})"}
                    for e in ref.get("greedy", [])]
    out = {}
    for name in sorted({e["model"] for e in entries}):
        mine = [e for e in entries if e["model"] == name and e["quant"] == FLAGS.quant]
        if len(mine) < 2:
            continue
        base = np.asarray(mine[0]["tokens"])
        cmp = {}
        for e in mine[1:]:
            other = np.asarray(e["tokens"])
            equal = other.shape == base.shape and bool((other == base).all())
            first_diff = margin = None
            if not equal and other.shape == base.shape:
                first_diff = int(np.argmax((other != base).any(axis=0)))
                if "margins" in mine[0]:
                    rows = (other != base)[:, first_diff]
                    margin = float(np.asarray(mine[0]["margins"])[rows, first_diff].min())
            cmp[e["variant"]] = {"equal": equal, "first_differing_step": first_diff,
                                 "margin_at_first_difference": margin}
        out[name] = {"against": mine[0]["variant"], "results": cmp}
    return out


def decode_table(results: dict) -> str:
    """Markdown: per decode row the step, tokens/s, bytes, floor, MBU, loop and the HF peer."""
    hf = {(r["model"], r["mode"], r["batch"], r["context"]): r for r in results.get("hf", [])}
    rows = []
    for r in results["decode"]:
        if "error" in r:
            rows.append([r["model"], r["variant"], r["batch"], r["context"],
                         f"error: {r['error'][:60]}"] + [None] * 7)
            continue
        peers = []
        for mode in ("eager", "static cache + torch.compile"):
            p = hf.get((r["model"], mode, r["batch"], r["context"]))
            peers.append(f"{p['tokens_per_s']:.1f}" if p and "tokens_per_s" in p else None)
        loop = f"{r['loop_step_s'] * 1e3:.2f}" if "loop_step_s" in r else None
        rows.append([r["model"], r["variant"], r["batch"], r["context"],
                     f"{r['step_s'] * 1e3:.2f}", f"{r['tokens_per_s']:.1f}",
                     f"{(r['weight_bytes'] + r['kv_bytes']) / 1e9:.2f}",
                     f"{r['floor_s'] * 1e3:.2f}", f"{r['mbu']:.1%}", loop, *peers])
    return markdown_table(["model", "variant", "B", "context", "step ms", "tok/s", "GB/step",
                           "floor ms", "MBU", "loop ms", "HF eager tok/s",
                           "HF compiled tok/s"], rows)


def main(argv):
    del argv
    setup_jax()  # XLA flags and the compilation cache, before jax's backend starts
    moe_matmul.LARGE_FORM = FLAGS.moe_large_form
    if FLAGS.moe_all_to_all_min_tokens is not None:
        moe.ALL_TO_ALL_MIN_TOKENS = FLAGS.moe_all_to_all_min_tokens
    variants = list(FLAGS.variants)
    if (FLAGS.tp or FLAGS.ep) and variants == ["base"]:
        variants = ["mesh"]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        fail(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    if FLAGS.greedy_reference and not os.path.exists(FLAGS.greedy_reference):
        fail(f"--greedy_reference: no file {FLAGS.greedy_reference}")
    results = {"models": FLAGS.model, "variants": variants, "label": FLAGS.label,
               "moe_large_form": FLAGS.moe_large_form,
               "moe_all_to_all_min_tokens": moe.ALL_TO_ALL_MIN_TOKENS,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "setup": [], "decode": [],
               "prefill": [], "greedy": []}
    run_hf_peer(results)  # before jax takes the GPU's memory
    results |= run_info()
    mesh = make_mesh(FLAGS.tp or 1, 1, ep=FLAGS.ep or 1) if "mesh" in variants else None
    results["kernels"] = kernels_line(device_kernels())  # what a one-device runner chooses
    print(results["kernels"], flush=True)
    results["calibration"] = (calibrate() if FLAGS.calibrate else
                              {"copy_TBps": FLAGS.copy_tbs, "read_TBps": FLAGS.copy_tbs,
                               "matmul_TFLOPs": FLAGS.matmul_tflops})
    results["calibration"] |= published_floor()
    save(results)
    precision = None if FLAGS.matmul_precision == "default" else FLAGS.matmul_precision
    results["matmul_precision"] = FLAGS.matmul_precision
    for name in FLAGS.model:
        for variant in variants:
            try:
                with jax.default_matmul_precision(precision):
                    measure_model(name, variant, results, results["calibration"], mesh)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory building the model
                results["setup"].append({"model": name, "variant": variant,
                                         "error": error_text(e)})
                print(f"{name} {variant}: {results['setup'][-1]['error']}", flush=True)
                gc.collect()
            save(results)
    results["greedy_check"] = greedy_check(results)
    save(results)
    calib = results["calibration"]
    print(f"\ncopy {calib['copy_TBps']:.2f} TB/s, read {calib['read_TBps']:.2f} TB/s, bf16 "
          f"matmul {calib['matmul_TFLOPs']:.0f} TFLOP/s; floors at {floor_TBps(calib):.3f} TB/s")
    print(decode_table(results))
    print("greedy check:", json.dumps(results["greedy_check"]))


if __name__ == "__main__":
    app.run(main)
