"""Decode at the memory roofline: tokens/s, step time and bandwidth utilization, with an HF peer.

    python -m scripts.bench_decode --model=llama3.2-1b,llama3.1-8b --batch=1,8,32,128 \
        --context=512,4096 --json_out=decode.json --plot_out=decode.png
    python -m scripts.bench_decode --plot_from=decode.json --plot_out=decode.png   # plot only

For each model (random weights of the preset's real shapes, made on the device; `--quant`
RTN-quantizes them there) and each variant (`base`; `fused`: q/k/v and gate/up fused after
loading, models.llama.fuse_projections; `folded`: fused, and each RMSNorm folded into the
product after it, ModelConfig.fold_norm_scale; `merged`: folded, with the attention kernel's key
splits merged inside it, PALLASITE_SPLIT_MERGE=kernel; `gemv`: fused, and the layers' weights
transposed for ops/gemv.py's kernel with the norms, SiLU x up and residuals inside the products,
models.llama.transpose_for_gemv; `mesh`: the sharded runner over a --tp mesh), one
ModelRunner holds a paged KV cache of random values for the largest batch and context. Rows:
- decode (batch B, context C: every sequence attends to C tokens): the runner's jitted step as
  the engine issues it (execute_padded: host padding + dispatch) queued --steps times with one
  sync, median of --runs; tokens/s = B / step; the bytes a step must read (weights it multiplies
  by + K/V of B x C tokens; scripts/decode_steps.py) over the copy bandwidth measured in the same
  run is the floor, and MBU = floor / step. `loop` is the engine's loop without its scheduler:
  StepBatch built on the host, the engine's program for a greedy batch (the step and its argmax,
  `execute_and_sample`), tokens back to the host every step.
  Compilations of the step are counted before and after the timed steps (must not change).
- prefill: one sequence's prompt of T tokens from an empty cache; tokens/s and FLOP utilization
  against the bf16 matrix rate measured in the same run.
- greedy: --greedy_steps greedy tokens of --greedy_batch sequences at --greedy_context, taken
  before any timed step writes the cache; variants (and runs given by --greedy_reference) must
  produce the same tokens.
- hf: HF transformers `generate` on the same shapes (scripts/decode_hf_peer.py, subprocesses
  run before jax takes the GPU), eager and, for --hf_static_compile models, with a static cache
  and torch.compile; skipped when torch or transformers is missing.
- profile: for each --profile model:batch:context, jax's profiler over a few steps
  (scripts/decode_profile.py): device busy time per step and where it goes.
JSON is rewritten after every row, so a run cut short keeps what it measured; a failing row
(out of memory, say) is recorded with its error and the run goes on.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from unittest import mock

import numpy as np
from absl import app, flags

from configs.model import get_preset
from scripts.common import fail, set_xla_flags, write_json

flags.DEFINE_list("model", ["llama3.2-1b"], "Presets.")
flags.DEFINE_list("batch", ["1", "8", "32", "128"], "Decode batch sizes.")
flags.DEFINE_list("context", ["512", "4096"], "Decode contexts (tokens attended per sequence).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Weights and KV.")
flags.DEFINE_enum("matmul_precision", "default", ["default", "high", "highest"],
                  "jax's default matmul precision for the run: on a GPU 'default' lets float32 "
                  "products use TF32; 'highest' keeps them float32 (for float32 greedy checks).")
flags.DEFINE_enum("quant", "none", ["none", "int8", "int4"],
                  "RTN weight quantization (int4: group 128) through ops.matmul.linear.")
flags.DEFINE_bool("quant_lm_head", False, "With --quant: the untied output head quantized too "
                  "(quant.model.QuantConfig.lm_head).")
VARIANTS = ("base", "fused", "folded", "merged", "gemv", "mesh")
# Environment a variant runs under while it is built, traced and timed (its runner is its own,
# so its programs are traced under it).
VARIANT_ENV = {"merged": {"PALLASITE_SPLIT_MERGE": "kernel"}}
flags.DEFINE_list("variants", ["base"], "base, fused, folded, merged, gemv, mesh (see the module "
                  "docstring).")
flags.DEFINE_integer("tp", None, "Tensor-parallel devices of the `mesh` variant (implies it).")
flags.DEFINE_integer("steps", 32, "Decode steps queued per timing.")
flags.DEFINE_integer("runs", 3, "Timings per row (median).")
flags.DEFINE_integer("loop_steps", 8, "Steps of the synced engine-style loop per row (0: off).")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("multi_step", 0, "Also time rounds of this many decode steps in one "
                     "program (ModelRunner.execute_multi_step: a device loop, and the steps "
                     "unrolled), per model step, and check their greedy tokens (0: off).")
flags.DEFINE_bool("multi_step_unrolled", True, "With --multi_step: also the unrolled rounds "
                  "(the longest compilations of a row: --nomulti_step_unrolled skips them).")
flags.DEFINE_list("prefill", ["512", "4096"], "Prompt lengths of the prefill rows.")
flags.DEFINE_integer("greedy_steps", 16, "Greedy tokens of the on/off check (0: off).")
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
flags.DEFINE_list("profile", [], "model:batch:context rows to profile (jax profiler).")
flags.DEFINE_integer("profile_steps", 5, "Steps traced per profile.")
flags.DEFINE_string("profile_dir", "/tmp/bench_decode_profile", "Profiler output directory.")
flags.DEFINE_bool("keep_traces", False, "Copy each profile's trace next to --json_out.")
flags.DEFINE_bool("calibrate", True, "Measure copy bandwidth and matmul rate (else use "
                  "--copy_tbs / --matmul_tflops).")
flags.DEFINE_float("copy_tbs", 4.1, "Copy bandwidth, TB/s, when not calibrating.")
flags.DEFINE_float("matmul_tflops", 750.0, "bf16 matmul rate, TFLOP/s, when not calibrating.")
flags.DEFINE_string("label", "", "A name for this run (e.g. the XLA flags it ran with).")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
flags.DEFINE_string("plot_out", None, "Write a PNG plot here (needs matplotlib).")
flags.DEFINE_string("plot_from", None, "Only plot this JSON of an earlier run (--plot_out).")
flags.DEFINE_integer("seed", 0, "Seed of weights, cache values and tokens.")
FLAGS = flags.FLAGS
# The decode step is what this benchmark measures, and it compiles few programs: XLA's
# exhaustive GEMM tiling search is worth its compile time here (scripts/common.py).
FLAGS.set_default("exhaustive_gemm_search", True)


def save(results: dict) -> None:
    if FLAGS.json_out:
        write_json(FLAGS.json_out, results)


def run_hf_peer(results: dict) -> None:
    """HF rows from scripts/decode_hf_peer.py subprocesses (each with a time limit)."""
    if not FLAGS.hf:
        return
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        results["hf_skipped"] = f"not importable: {', '.join(missing)}"
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(os.path.dirname(os.path.abspath(FLAGS.json_out or "x")), "hf_peer.json")
    jobs = [(m, FLAGS.hf_batch, FLAGS.hf_context, []) for m in FLAGS.model]
    jobs += [(m, ["1"], FLAGS.hf_context[:1], ["--static_compile"])
             for m in FLAGS.hf_static_compile]
    for model, batches, contexts, extra in jobs:
        cmd = [sys.executable, "-m", "scripts.decode_hf_peer", f"--model={model}",
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


def variant_setup(name: str, variant: str, dtype, mesh):
    """(cfg, runner) of one model variant, with a random cache sized for every row."""
    from scripts import decode_steps as ds
    cfg, model = ds.build_model(get_preset(name), dtype, FLAGS.seed, FLAGS.quant,
                                fused=variant in ("fused", "folded", "merged", "gemv"),
                                mesh=mesh if variant == "mesh" else None,
                                quant_lm_head=FLAGS.quant_lm_head, gemv=variant == "gemv")
    if variant in ("folded", "merged"):
        cfg = cfg.replace(fold_norm_scale=True)
    batches = [int(b) for b in FLAGS.batch]
    contexts = [int(c) + FLAGS.multi_step for c in FLAGS.context] + [
        int(c) for c in FLAGS.prefill]
    if FLAGS.greedy_steps:
        batches.append(FLAGS.greedy_batch)
        contexts.append(FLAGS.greedy_context + FLAGS.multi_step)
    runner = ds.make_runner(cfg, model, max(batches), max(contexts), FLAGS.page_size,
                            mesh if variant == "mesh" else None)
    ds.fill_cache_random(runner, FLAGS.seed + 1)
    return cfg, model, runner


def measure_model(name: str, variant: str, results: dict, calib: dict, mesh) -> None:
    """Greedy check, decode rows, prefill rows and profiles of one model variant."""
    import jax
    import jax.numpy as jnp

    from scripts import decode_profile
    from scripts import decode_steps as ds

    dtype = jnp.dtype(FLAGS.dtype)
    common = {"model": name, "variant": variant, "quant": FLAGS.quant, "dtype": FLAGS.dtype,
              "quant_lm_head": FLAGS.quant_lm_head,
              "label": FLAGS.label}
    start = time.perf_counter()
    cfg, model, runner = variant_setup(name, variant, dtype, mesh)
    kv_dtype = runner.cache.k_pages[0].dtype
    width = runner.max_width
    tables = ds.page_tables(runner.max_seqs, width, FLAGS.seed)
    rng = np.random.default_rng(FLAGS.seed)
    # The mesh variant reads its bytes with every device of the mesh: its floor is the bytes
    # over the bandwidth of all of them.
    devices = mesh.devices.size if variant == "mesh" else 1
    common["devices"] = devices
    results["setup"].append(common | {"setup_s": time.perf_counter() - start,
                                      "cache_bytes": runner.cache.nbytes()})
    if FLAGS.greedy_steps:
        b, c, n = FLAGS.greedy_batch, FLAGS.greedy_context, FLAGS.greedy_steps
        first = rng.integers(0, cfg.vocab_size, b)
        table = tables[:b, :-(-c // FLAGS.page_size)]
        tokens, _, gaps = ds.greedy_loop(runner, first, c - n - 1, table, n, margins=True)
        results["greedy"].append(common | {"batch": b, "context": c, "tokens": tokens.tolist(),
                                           "margins": gaps.tolist()})
        if FLAGS.multi_step and variant != "mesh":  # the same tokens from rounds of the loop
            for unroll in multi_step_forms():
                results["greedy"].append(common | {
                    "variant": f"{variant}+multi_step" + ("_unrolled" if unroll else ""),
                    "batch": b, "context": c,
                    "tokens": multi_step_tokens(runner, first, c - n - 1, table, n, unroll)})
        save(results)
    for b in map(int, FLAGS.batch):
        for c in map(int, FLAGS.context):
            row = common | {"batch": b, "context": c}
            try:
                table = tables[:b, :-(-c // FLAGS.page_size)]  # [B, pages of C tokens]
                batch = ds.decode_batch(rng.integers(0, cfg.vocab_size, b),
                                        np.full(b, c - 1), table, FLAGS.page_size)
                row |= ds.time_queued(runner, batch, FLAGS.steps, FLAGS.runs)
                if FLAGS.multi_step and variant != "mesh":
                    room = tables[:b, :-(-(c + FLAGS.multi_step) // FLAGS.page_size)]
                    rounds = ds.decode_batch(batch.token_ids, np.full(b, c - 1), room,
                                             FLAGS.page_size)
                    for unroll in multi_step_forms():  # a device loop; the steps in a row
                        row |= ds.time_multi_step(
                            runner, rounds, FLAGS.multi_step,
                            max(FLAGS.steps // FLAGS.multi_step, 2), FLAGS.runs, unroll)
                row["programs"] = ds.compile_count(runner)
                w = ds.weight_bytes_per_step(cfg, model, b)
                kv = ds.kv_bytes_per_step(cfg, kv_dtype, b, c)
                floor = (w + kv) / calib["copy_bytes_per_s"] / devices
                row |= {"weight_bytes": w, "kv_bytes": kv, "floor_s": floor,
                        "tokens_per_s": b / row["step_s"], "mbu": floor / row["step_s"],
                        "mbu_read": (w + kv) / calib["read_bytes_per_s"] / devices
                        / row["step_s"],
                        "roofline_tokens_per_s": b / floor}
                if FLAGS.loop_steps:
                    _, loop_s = ds.greedy_loop(runner, batch.token_ids, c - FLAGS.loop_steps - 1,
                                               table, FLAGS.loop_steps)
                    row |= {"loop_step_s": loop_s, "loop_tokens_per_s": b / loop_s,
                            "loop_mbu": floor / loop_s}
                if f"{name}:{b}:{c}" in FLAGS.profile:
                    prof = decode_profile.profile_steps(
                        runner, batch, FLAGS.profile_steps,
                        os.path.join(FLAGS.profile_dir, f"{name}_{variant}_{b}_{c}"))
                    keep_trace(prof, f"{name}_{variant}_b{b}_c{c}")
                    results["profiles"].append(common | {"batch": b, "context": c} | prof)
                    print(decode_profile.format_summary(prof), flush=True)
            except Exception as e:  # noqa: BLE001 - a failing row is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results["decode"].append(row)
            print(format_row(row), flush=True)
            save(results)
    for t in map(int, FLAGS.prefill):
        row = common | {"prompt_tokens": t}
        try:
            pages = -(-t // FLAGS.page_size)
            batch = ds.prefill_batch(rng.integers(0, cfg.vocab_size, t), tables[0][:pages],
                                     FLAGS.page_size)
            row |= ds.time_queued(runner, batch, max(FLAGS.steps // 8, 2), FLAGS.runs)
            flops = ds.prefill_flops(cfg, t)
            row |= {"tokens_per_s": t / row["step_s"], "flops": flops,
                    "mfu": flops / row["step_s"] / calib["matmul_flops_per_s"] / devices}
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results["prefill"].append(row)
        print(f"prefill {name} {variant} T={t}: " + (
            row.get("error") or f"{row['step_s'] * 1e3:.2f} ms, {row['tokens_per_s']:.0f} tok/s,"
            f" MFU {row['mfu']:.1%}"), flush=True)
        save(results)
    del runner, model
    gc.collect()
    jax.clear_caches()


def multi_step_tokens(runner, first: np.ndarray, position: int, table: np.ndarray,
                      steps: int, unroll: bool) -> list:
    """Greedy tokens [batch, steps] of the greedy check's loop run as rounds of --multi_step
    steps (ModelRunner.execute_multi_step) from the same first tokens and position."""
    from engine.sampling import SamplingArrays
    from scripts import decode_steps as ds
    tokens, out = np.asarray(first), []
    while len(out) < steps + 1:  # the loop's untimed first step included
        k = min(FLAGS.multi_step, steps + 1 - len(out))
        batch = ds.decode_batch(tokens, np.full(len(tokens), position + len(out)), table,
                                FLAGS.page_size)
        rounds = np.asarray(runner.execute_multi_step(
            batch, SamplingArrays.defaults(len(tokens)), k, unroll)[0])[:, : len(tokens)]  # [k, B]
        out += list(rounds)
        tokens = rounds[-1]
    return np.stack(out[1:], axis=1).tolist()


def keep_trace(prof: dict, stem: str) -> None:
    path = prof.get("trace_path")
    if FLAGS.keep_traces and FLAGS.json_out and path and os.path.getsize(path) < 15 << 20:
        import shutil
        dest = os.path.join(os.path.dirname(os.path.abspath(FLAGS.json_out)),
                            f"trace_{stem}.json.gz")
        shutil.copy(path, dest)
        prof["trace_copy"] = dest


def multi_step_forms() -> tuple[bool, ...]:
    """The `unroll` values of the multi-step rounds timed: the device loop, and unless
    --nomulti_step_unrolled the steps traced one after another."""
    return (False, True) if FLAGS.multi_step_unrolled else (False,)


def format_row(row: dict) -> str:
    head = f"{row['model']:<12} {row['variant']:<6} B={row['batch']:<4} C={row['context']:<6}"
    if "error" in row:
        return f"{head} error: {row['error']}"
    loop = f"  loop {row['loop_step_s'] * 1e3:7.3f} ms" if "loop_step_s" in row else ""
    if "multi_step_s" in row:
        loop += (f"  {row['multi_steps']}-step rounds {row['multi_step_s'] * 1e3:7.3f} ms/step "
                 f"(dispatch holds the host {row['multi_step_dispatch_s'] * 1e3:.3f} ms)")
    if "multi_step_unrolled_s" in row:
        loop += (f", unrolled {row['multi_step_unrolled_s'] * 1e3:7.3f} ms/step "
                 f"({row['multi_step_unrolled_dispatch_s'] * 1e3:.3f} ms)")
    hold = f" (dispatch {row['dispatch_s'] * 1e3:.3f} ms)" if "dispatch_s" in row else ""
    return (f"{head} {row['step_s'] * 1e3:8.3f} ms{hold} {row['tokens_per_s']:9.1f} tok/s  "
            f"floor {row['floor_s'] * 1e3:7.3f} ms  MBU {row['mbu']:6.1%}{loop}  "
            f"compiles during timing: {row['compiles_during_timing']}")


def greedy_check(results: dict) -> dict:
    """Equal greedy tokens across this run's variants and the reference run's, per model."""
    entries = list(results["greedy"])
    if FLAGS.greedy_reference and os.path.exists(FLAGS.greedy_reference):
        ref = json.load(open(FLAGS.greedy_reference))
        entries += [e | {"variant": f"{e['variant']} (reference {e.get('label', '')})"}
                    for e in ref.get("greedy", [])]
    out = {}
    for name in {e["model"] for e in entries}:
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
                if "margins" in mine[0]:  # how near a tie the first variant's choice was there
                    rows = (other != base)[:, first_diff]
                    margin = float(np.asarray(mine[0]["margins"])[rows, first_diff].min())
            cmp[e["variant"]] = {"equal": equal, "first_differing_step": first_diff,
                                 "margin_at_first_difference": margin}
        out[name] = {"against": mine[0]["variant"], "results": cmp}
    return out


def print_table(results: dict) -> None:
    hf = {(r["model"], r["mode"], r["batch"], r["context"]): r for r in results.get("hf", [])}
    print(f"\ncopy {results['calibration']['copy_bytes_per_s'] / 1e12:.2f} TB/s, read "
          f"{results['calibration']['read_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{results['calibration']['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    print("| model | variant | B | context | step ms | tok/s | GB/step | floor ms | MBU "
          "| loop ms | HF eager tok/s | HF compiled tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["decode"]:
        if "error" in r:
            print(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['context']} | "
                  f"error: {r['error'][:60]} |")
            continue
        peers = []
        for mode in ("eager", "static cache + torch.compile"):
            p = hf.get((r["model"], mode, r["batch"], r["context"]))
            peers.append(f"{p['tokens_per_s']:.1f}" if p and "tokens_per_s" in p else "-")
        loop = f"{r['loop_step_s'] * 1e3:.2f}" if "loop_step_s" in r else "-"
        print(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['context']} | "
              f"{r['step_s'] * 1e3:.2f} | {r['tokens_per_s']:.1f} | "
              f"{(r['weight_bytes'] + r['kv_bytes']) / 1e9:.2f} | {r['floor_s'] * 1e3:.2f} | "
              f"{r['mbu']:.1%} | {loop} | {peers[0]} | {peers[1]} |")


def plot(results: dict, path: str) -> None:
    """tokens/s against batch per (model, variant, context), the roofline dashed, HF as marks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    rows = [r for r in results["decode"] if "error" not in r]
    for key in sorted({(r["model"], r["variant"], r["context"]) for r in rows}):
        mine = sorted((r for r in rows if (r["model"], r["variant"], r["context"]) == key),
                      key=lambda r: r["batch"])
        b = [r["batch"] for r in mine]
        line, = ax.plot(b, [r["tokens_per_s"] for r in mine], "o-",
                        label=f"{key[0]} {key[1]} ctx {key[2]}")
        ax.plot(b, [r["roofline_tokens_per_s"] for r in mine], "--", color=line.get_color(),
                alpha=0.6)
        if key[1] != "base":
            continue  # the peer is drawn once per model and context
        for mode, mark in (("eager", "x:"), ("static cache + torch.compile", "+")):
            peers = sorted((p for p in results.get("hf", []) if "tokens_per_s" in p and
                            (p["model"], p["mode"], p["context"]) == (key[0], mode, key[2])),
                           key=lambda p: p["batch"])
            if peers:
                ax.plot([p["batch"] for p in peers], [p["tokens_per_s"] for p in peers], mark,
                        color=line.get_color(), alpha=0.8, markersize=9)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode tokens/s (solid), memory roofline (dashed), HF eager (x), compiled (+)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    set_xla_flags()  # before jax's backend starts
    if FLAGS.plot_from:
        plot(json.load(open(FLAGS.plot_from)), FLAGS.plot_out or "decode.png")
        return
    variants = list(FLAGS.variants)
    if FLAGS.tp and variants == ["base"]:
        variants = ["mesh"]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        fail(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    results = {"models": FLAGS.model, "variants": variants, "label": FLAGS.label,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "date": time.strftime("%Y-%m-%d"),
               "argv": sys.argv[1:], "setup": [], "decode": [], "prefill": [], "greedy": [],
               "profiles": []}
    run_hf_peer(results)  # before jax takes the GPU's memory
    import jax

    from scripts import decode_steps as ds
    results["device"] = jax.devices()[0].device_kind
    results["jax"] = jax.__version__
    mesh = None
    if "mesh" in variants:
        from engine.mesh import make_mesh
        mesh = make_mesh(FLAGS.tp or 1, 1)
    results["calibration"] = (ds.calibrate() if FLAGS.calibrate else
                              {"copy_bytes_per_s": FLAGS.copy_tbs * 1e12,
                               "read_bytes_per_s": FLAGS.copy_tbs * 1e12,
                               "matmul_flops_per_s": FLAGS.matmul_tflops * 1e12})
    save(results)
    precision = None if FLAGS.matmul_precision == "default" else FLAGS.matmul_precision
    results["matmul_precision"] = FLAGS.matmul_precision
    for name in FLAGS.model:
        for variant in variants:
            try:
                env = VARIANT_ENV.get(variant, {})
                with jax.default_matmul_precision(precision), mock.patch.dict(os.environ, env):
                    measure_model(name, variant, results, results["calibration"], mesh)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory building the model
                results["setup"].append({"model": name, "variant": variant,
                                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{name} {variant}: {results['setup'][-1]['error']}", flush=True)
                gc.collect()
            save(results)
    results["greedy_check"] = greedy_check(results)
    save(results)
    print_table(results)
    print("greedy check:", json.dumps(results["greedy_check"]))
    if FLAGS.plot_out:
        try:
            plot(results, FLAGS.plot_out)
        except ImportError as e:
            print(f"no plot: {e}")


if __name__ == "__main__":
    app.run(main)
