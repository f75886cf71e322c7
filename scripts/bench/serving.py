"""Serving benchmark: continuous batching on a synthetic workload, against static batching.

    python -m scripts.bench.serving --model=llama3.1-8b --random_weights --num_requests=1000 \
        --input_len=1024 --output_len=128 --len_sigma=0 --json_out=serving.json
    python -m scripts.bench.serving ... --compare='max_num_batched_tokens=4096;num_decode_steps=4'
    python -m scripts.bench.serving --model=qwen3-30b-a3b --random_weights --quant=int4 ...
    python -m scripts.bench.serving --url=http://127.0.0.1:8000 --num_requests=100   # a server
    python -m scripts.bench.serving --model=tiny-llama --random_weights --stub_device \
        --max_num_seqs=256 --host_phases                                  # host work only
    python -m scripts.bench.serving --model=llama3.1-8b --random_weights --startup_only \
        --compilation_cache_dir=/tmp/cc --json_out=cold.json   # again: warm (start-up only)

A seeded workload of random-token prompts: input and output lengths log-normal (long-tailed,
like ShareGPT conversations; --len_sigma=0: fixed), arrivals Poisson at --request_rate requests/s
(inf: all at once). Requests ignore EOS and stop at their drawn length, so every run does the
same useful work. Modes:
- in process (default): the engine with the engine flags, then in the same run the peers: a
  static-batching baseline (wait for a full batch, run it until its longest output is done) and
  each --compare configuration (EngineConfig fields changed), on the same requests and model.
- --url: the same workload against a running server over HTTP (scripts/bench/serving_http.py).
- --stub_device: the engine's runner returns tokens at once, so the run times only the host's
  work per step (scheduling, batches, appending tokens): what the engine's Python costs.
- --startup_only: process start to the first token, as scripts.serve starts
  (scripts/bench/startup.py); twice on one --compilation_cache_dir for cold and warm.
Prints a table and writes JSON.
"""
from __future__ import annotations

import cProfile
import dataclasses
import gc
import io
import math
import pstats
import sys
import time

import jax
import numpy as np
from absl import app, flags

from engine.llm_engine import LLMEngine
from engine.mesh import is_main_process
from engine.request import SamplingParams
from configs.model import get_preset
from quant.loader import EMBEDDED_PRESETS, LoadedModel, load_model
from scripts import common, parallel
from scripts.bench import decode_model, host_phases, serving_http
from scripts.bench.startup import measure_startup, startup_table
from scripts.bench.stub_device import forget_run, reached_programs, stub_device
from scripts.bench.common import markdown_table, run_info, write_json
from scripts.bench.workload import (WorkloadSpec, describe, make_workload,
                                   serving_table, summarize)

common.define_model_flags()
common.define_engine_flags()
common.define_fusion_flags()
flags.DEFINE_enum("quant", "none", list(decode_model.QUANT_METHODS), "With --random_weights of "
                  "a preset: the decoder's linears as random INT8 / INT4 codes (groups of 128), "
                  "made as codes, so a model too large for the device in bf16 still runs.")
flags.DEFINE_integer("num_requests", 200, "Requests in the workload.")
flags.DEFINE_float("request_rate", math.inf, "Poisson arrival rate, requests/s (inf: all at once).")
flags.DEFINE_integer("input_len", 200, "Median prompt length (tokens).")
flags.DEFINE_integer("output_len", 150, "Median output length (tokens).")
flags.DEFINE_float("len_sigma", 0.8, "Sigma of the log-normal lengths (0: every request the "
                   "median lengths).")
flags.DEFINE_integer("max_input_len", 1024, "Longest prompt drawn.")
flags.DEFINE_integer("max_output_len", 1024, "Longest output drawn.")
flags.DEFINE_integer("shared_prefix_len", 0, "Tokens of a system prompt shared by all requests.")
flags.DEFINE_float("penalized_fraction", 0.0, "Fraction of the requests (evenly spread) that "
                   "send repetition (1.1), presence (0.5) and frequency (0.5) penalties, as chat "
                   "clients often do.")
flags.DEFINE_float("temperature", 0.0, "Every request's sampling temperature, seeded by the "
                   "request's index (0: greedy).")
flags.DEFINE_integer("static_batch_size", None, "Static baseline batch (default: max_num_seqs).")
flags.DEFINE_bool("static_baseline", True, "Also measure static batching.")
flags.DEFINE_bool("compile_in_background", True, "With --startup_only: as scripts.serve's flag.")
flags.DEFINE_bool("startup_only", False, "Measure only the start-up, as scripts.serve starts: "
                  "process start to the first token of one request, with the weights' time "
                  "apart and the programs compiled and loaded from --compilation_cache_dir "
                  "(run twice on one directory: cold, then warm).")
flags.DEFINE_bool("startup_background", False, "With --startup_only: then also wait for the "
                  "programs compiled in the background and time them (on a GPU with default "
                  "flags, dozens of programs).")
flags.DEFINE_string("compare", "", "Engine configurations also run on the same workload, "
                    "';'-separated, each comma-separated EngineConfig fields, e.g. "
                    "'max_num_batched_tokens=4096;num_decode_steps=4,async_scheduling=true'; "
                    "the table gives each one's output tokens/s over the engine flags' own.")
flags.DEFINE_enum("warmup", "dry_run", ["dry_run", "shapes", "rerun"],
                  "dry_run: run the workload once on a stub device, then compile the programs "
                  "it reached side by side (exact with --request_rate=inf, where the schedule "
                  "does not depend on time; a program it missed compiles while timed, and the "
                  "JSON counts those); shapes: compile every program a run can reach "
                  "(LLMEngine.warmup); rerun: run the workload once untimed first (the only "
                  "warm-up of a --url server).")
flags.DEFINE_bool("host_phases", False, "Time the engine's host phases (schedule, batch, "
                  "dispatch, append; and the wait for tokens) in the continuous run; ms per step.")
flags.DEFINE_string("host_profile", None, "Profile the continuous run's Python with cProfile "
                    "and write the functions with the most own time here (text); the JSON gets "
                    "the top ones.")
flags.DEFINE_bool("stub_device", False, "Replace the runner's device work by tokens returned "
                  "at once: time the engine's host work alone (no warm-up, no static baseline).")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
flags.DEFINE_string("url", None, "Drive a running server (scripts.serve) at this address "
                    "over HTTP instead of an in-process engine.")
flags.DEFINE_string("api_key", None, "With --url: the server's API key.")
FLAGS = flags.FLAGS


def workload_spec() -> WorkloadSpec:
    return WorkloadSpec(FLAGS.num_requests, FLAGS.request_rate, FLAGS.input_len,
                        FLAGS.output_len, FLAGS.len_sigma, FLAGS.max_input_len,
                        FLAGS.max_output_len, FLAGS.shared_prefix_len,
                        FLAGS.penalized_fraction, FLAGS.temperature)


def load_served_model(FLAGS, mesh) -> LoadedModel:
    """The model of --model (random weights of a preset, with --quant as random codes)."""
    random = FLAGS.random_weights or FLAGS.model not in EMBEDDED_PRESETS
    dtype = common.resolve_dtype(FLAGS.dtype)
    if FLAGS.quant == "none":
        return load_model(FLAGS.model, dtype, random, FLAGS.seed, mesh=mesh)
    if not random:
        raise ValueError("--quant makes random codes of a preset's shapes (with "
                         "--random_weights); quantize a checkpoint with scripts.quantize")
    cfg, model = decode_model.build_model(get_preset(FLAGS.model), dtype, FLAGS.seed,
                                          FLAGS.quant, mesh=mesh)
    return LoadedModel(cfg, model, None, f"random:{FLAGS.model}:{FLAGS.quant}")


def parse_compare(text: str, base) -> list[tuple[str, object]]:
    """(label, EngineConfig) of each --compare entry: `base` with the named fields changed
    (values parsed as the field's type). ValueError naming an unknown field or a bad value."""
    fields = {f.name: f for f in dataclasses.fields(base)}
    out = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        changes = {}
        for item in entry.split(","):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in fields:
                raise ValueError(f"--compare: {item!r} is not field=value of an EngineConfig "
                                 f"field ({', '.join(sorted(fields))})")
            current = getattr(base, name)
            value = value.strip()
            try:
                if isinstance(current, bool):
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(value)
                    changes[name] = value.lower() in ("true", "1")
                elif isinstance(current, (int, float)):
                    changes[name] = type(current)(value)
                elif isinstance(current, str):  # e.g. kv_cache_dtype: checked by the engine
                    changes[name] = value
                elif value.lower() == "none":
                    changes[name] = None
                else:  # a field that is None in `base`: a number
                    changes[name] = float(value) if "." in value else int(value)
            except ValueError:
                raise ValueError(f"--compare: bad value in {item!r}") from None
        out.append((entry, dataclasses.replace(base, **changes)))
    return out


def run_continuous(engine, work) -> dict:
    """Feeds requests at their arrival times into one engine stepping continuously."""
    ttft, tpot, latency, useful = [], [], [], 0
    start = time.perf_counter()
    next_i = 0
    compiled_before = len(engine.runner.compiled_shapes)
    while next_i < len(work.prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_i < len(work.prompts) and work.arrivals[next_i] <= now:
            engine.add_request(work.prompts[next_i], SamplingParams(
                max_tokens=work.output_lens[next_i], ignore_eos=True, **work.sampling(next_i)))
            next_i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, work.arrivals[next_i] - now))
            continue
        engine.step()
        for request_id in engine.finished_request_ids():
            out = engine.output_of(request_id)
            n = len(out.output_ids)
            useful += n
            ttft.append(out.ttft_s)
            latency.append(out.total_s)
            if n > 1:
                tpot.append((out.total_s - out.ttft_s) / (n - 1))
    duration = time.perf_counter() - start
    return summarize(duration, useful, ttft, tpot, latency) | {
        "prefix_hit_rate": engine.pool.prefix_hit_rate,
        "preemptions": engine.scheduler.num_preemptions,
        "programs_compiled_during_run": len(engine.runner.compiled_shapes) - compiled_before,
    }


def run_static(engine, work, batch_size: int) -> dict:
    """Waits for a full batch (in arrival order), runs it until its longest output is done."""
    ttft, tpot, latency, useful = [], [], [], 0
    start = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        idx = list(range(first, min(first + batch_size, len(work.prompts))))
        wait = work.arrivals[idx[-1]] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        longest = max(work.output_lens[i] for i in idx)
        batch_start = time.perf_counter() - start
        outs = engine.generate([work.prompts[i] for i in idx],
                               [SamplingParams(max_tokens=longest, ignore_eos=True,
                                               **work.sampling(i)) for i in idx])
        done = time.perf_counter() - start
        for i, out in zip(idx, outs):
            n = work.output_lens[i]  # useful tokens; the rest is padding work
            useful += n
            ttft.append(batch_start - work.arrivals[i] + out.ttft_s)
            latency.append(done - work.arrivals[i])
            if n > 1:
                tpot.append((out.total_s - out.ttft_s) / (longest - 1))
    return summarize(time.perf_counter() - start, useful, ttft, tpot, latency)


def host_share(engine) -> dict:
    """Host time as a share of step time: all of it, and the part during which the device had
    nothing queued (exposed); over all rounds and over each of host_phases.round_sets. A
    multi-step round counts as its model steps."""
    steps = np.asarray(engine.stats.steps, float).reshape(-1, 6)

    def share(s, column):
        return float(s[:, column].sum() / s[:, 2].sum()) if len(s) and s[:, 2].sum() else None

    out = {"host_share_all_steps": share(steps, 1),
           "exposed_host_share_all_steps": share(steps, 3),
           "host_s_per_step_all": (float(steps[:, 1].sum() / steps[:, 4].sum())
                                   if len(steps) else None),
           "max_running": int(steps[:, 0].max()) if len(steps) else 0,
           "async_scheduling": engine.engine_cfg.async_scheduling,
           "num_decode_steps": engine.engine_cfg.num_decode_steps}
    for name, mask in host_phases.round_sets(steps).items():
        out |= {f"host_share_{name}": share(steps[mask], 1),
                f"exposed_host_share_{name}": share(steps[mask], 3)}
        out |= host_phases.round_set_figures(steps, mask, name)
    return out


def phase_figures(stats, phases: dict, per_step: list) -> dict:
    """The host phases in ms per model step over all steps and over each of
    host_phases.round_sets, with the engine's Python (all but the dispatch) as a share of the
    step there; printed."""
    phases["other host"] = stats.host_time_s - sum(phases.values())
    phases["wait for tokens"] = stats.step_time_s - stats.host_time_s
    out = {"host_phase_ms_per_step": {
        name: 1e3 * total / max(stats.num_model_steps, 1) for name, total in phases.items()}}
    print("host phases, ms per model step: " + ", ".join(
        f"{name} {ms:.3f}" for name, ms in out["host_phase_ms_per_step"].items()), flush=True)
    if len(per_step) != len(stats.steps):
        raise RuntimeError(f"{len(per_step)} timed rounds for {len(stats.steps)} recorded ones")
    for name, mask in host_phases.round_sets(stats.steps).items():
        chosen = [(s, d) for s, d, m in zip(stats.steps, per_step, mask) if m]
        model_steps = sum(s[4] for s, _ in chosen)
        if not model_steps:
            continue
        ms = {phase: 1e3 * sum(d[phase] for _, d in chosen) / model_steps
              for phase in chosen[0][1]}
        host_ms = 1e3 * sum(s[1] for s, _ in chosen) / model_steps
        ms["other host"] = host_ms - sum(ms.values())
        step_ms = 1e3 * sum(s[2] for s, _ in chosen) / model_steps
        python_ms = host_ms - sum(v for phase, v in ms.items() if phase.startswith("dispatch"))
        out |= {f"host_phase_ms_per_step_{name}": ms,
                f"engine_python_share_{name}": python_ms / step_ms}
    return out


def release(engine) -> None:
    """Frees an engine's device memory now (its KV cache deleted, the objects frozen at start-up
    unfrozen and collected), so that the next engine can take it."""
    for page in jax.tree.leaves(engine.runner.cache):
        page.delete()
    gc.unfreeze()
    gc.collect()


def warm_up(engine, longest: int, run) -> int:
    """Compiles per --warmup before run() is timed; returns the number of programs compiled."""
    before = len(engine.runner.compiled_shapes)
    # the samplers (and rounds) of sampled rows where --temperature asks for them, and those of
    # penalized rows where --penalized_fraction does
    progress = common.print_progress("compiling", engine.warmup_threads)
    samplers, penalties = FLAGS.temperature > 0, FLAGS.penalized_fraction > 0
    if FLAGS.warmup == "shapes":
        engine.warmup(max_total_len=longest, progress=progress, samplers=samplers,
                      penalties=penalties)
    elif FLAGS.warmup == "dry_run":
        engine.warmup(programs=reached_programs(engine, run), progress=progress,
                      samplers=samplers, penalties=penalties)
    else:
        run()
        forget_run(engine)
    return len(engine.runner.compiled_shapes) - before


def profiled(run, path: str, top: int = 40):
    """(run(), [[function, calls, own s, cumulative s] of the `top` functions by own time]),
    with cProfile on during run(); the whole table (by own time) is written to `path`."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        out = run()
    finally:
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats()
    with open(path, "w") as f:
        f.write(text.getvalue())
    top_rows = [(func, stats.stats[func]) for func in stats.fcn_list[:top]]
    return out, [[f"{file}:{line}({name})", calls, own, cum]
                 for (file, line, name), (_, calls, own, cum, _) in top_rows]


def timed_run(engine, work, longest: int) -> tuple[dict, int]:
    """The continuous run of one engine (warmed up first unless the device is a stub): its
    figures and host shares (phases and profile per --host_phases / --host_profile)."""
    compiled = 0 if FLAGS.stub_device else warm_up(engine, longest,
                                                   lambda: run_continuous(engine, work))
    common.freeze_startup_objects()
    engine.stats = type(engine.stats)(record_steps=True)
    per_step: list = []
    phases = host_phases.time_engine_phases(engine, per_step) if FLAGS.host_phases else None
    top = None
    if FLAGS.host_profile:
        out, top = profiled(lambda: run_continuous(engine, work), FLAGS.host_profile)
    else:
        out = run_continuous(engine, work)
    out |= host_share(engine)
    if phases is not None:
        out |= phase_figures(engine.stats, phases, per_step)
    if top is not None:
        out["host_profile_top"] = top
    return out, compiled


def compare_table(results: dict) -> str:
    base = results["continuous"]["output_tokens_per_s"]
    rows = [["engine flags", f"{base:.1f}", "1.00"]]
    for label, r in results["compare"].items():
        rate = r.get("output_tokens_per_s")
        rows.append([label, r.get("error") or f"{rate:.1f}",
                     None if rate is None else f"{rate / base:.2f}"])
    return markdown_table(["configuration", "output tokens/s", "x engine flags"], rows)


def save_results(results: dict) -> None:
    """Write --json_out (main process): after each phase, so a run cut short keeps what it
    measured."""
    if FLAGS.json_out and is_main_process():
        write_json(FLAGS.json_out, results)


def main(argv):
    del argv
    try:
        spec = workload_spec()
    except ValueError as e:
        common.fail(str(e))
    if FLAGS.url:
        try:
            results = serving_http.run_http(FLAGS.url, FLAGS.api_key, spec, FLAGS.seed,
                                            FLAGS.warmup == "rerun")
        except ValueError as e:
            common.fail(str(e))
        print(serving_table(results))
        save_results(results)
        return
    common.setup_jax()
    try:
        mesh = parallel.setup_parallel()  # --tp / --dp / multi-process; None: one device
        common.check_fusion(mesh)
        if FLAGS.startup_only:
            info = run_info() | {"mode": "startup", "model": FLAGS.model, "quant": FLAGS.quant}

            def save(figures):  # at the first token, and again after the background compiles
                save_results(info | figures)

            results = info | measure_startup(
                FLAGS, lambda: common.prepare_model(load_served_model(FLAGS, mesh), mesh), mesh,
                on_ready=save)
            save(results)
            print(startup_table(results))
            return
        if jax.process_count() > 1 and not math.isinf(FLAGS.request_rate):
            raise ValueError("with several processes --request_rate must be inf: arrivals timed "
                             "by each process's clock would give the processes different steps")
        loaded = load_served_model(FLAGS, mesh)
        loaded = common.prepare_model(loaded, mesh)  # --fuse_projections
        engine_cfg = common.engine_config_from_flags(FLAGS, loaded.cfg)
        compare = parse_compare(FLAGS.compare, engine_cfg)
        if engine_cfg.max_model_len is not None and spec.longest > engine_cfg.max_model_len:
            raise ValueError(f"shared_prefix_len + max_input_len + max_output_len = "
                             f"{spec.longest} exceeds max_model_len {engine_cfg.max_model_len}")
        work = make_workload(spec, FLAGS.seed, loaded.cfg.vocab_size)
    except common.USER_ERRORS as e:
        common.fail(str(e))
    results = run_info() | {"mode": "stub_device" if FLAGS.stub_device else "engine",
                            "model": FLAGS.model, "quant": FLAGS.quant} | describe(spec, work) | {
        "engine": dataclasses.asdict(engine_cfg),
        "mesh": None if mesh is None else dict(mesh.shape),
        "fused_projections": loaded.cfg.fused_projections}

    engine = LLMEngine(loaded.cfg, loaded.model, None, engine_cfg, mesh=mesh)
    if FLAGS.stub_device:
        stub_device(engine)
    if mesh is not None:
        print(f"{parallel.describe(mesh)}; {engine.runner.plan.describe()}")
    print(engine.kv_summary)
    common.print_kernels(engine.runner.kernels, engine.cfg.head_dim, file=sys.stdout)
    start = time.perf_counter()
    results["continuous"], results["programs_compiled_at_start"] = timed_run(
        engine, work, spec.longest)
    results["warmup_and_run_s"] = time.perf_counter() - start
    save_results(results)
    print(f"continuous: {results['continuous']['output_tokens_per_s']:.1f} output tokens/s "
          f"({results['warmup_and_run_s']:.1f} s with its warm-up)")
    release(engine)
    del engine
    if FLAGS.static_baseline and not FLAGS.stub_device:
        batch = FLAGS.static_batch_size or engine_cfg.max_num_seqs
        static_cfg = dataclasses.replace(engine_cfg, max_num_seqs=batch,
                                         enable_prefix_caching=False)
        engine = LLMEngine(loaded.cfg, loaded.model, None, static_cfg, mesh=mesh)
        warm_up(engine, spec.longest, lambda: run_static(engine, work, batch))
        results["static"] = run_static(engine, work, batch) | {"batch_size": batch}
        results["continuous_over_static"] = (results["continuous"]["output_tokens_per_s"]
                                             / results["static"]["output_tokens_per_s"])
        save_results(results)
        release(engine)
        del engine
    results["compare"] = {}
    for label, cfg in compare:
        try:
            engine = LLMEngine(loaded.cfg, loaded.model, None, cfg, mesh=mesh)
            if FLAGS.stub_device:
                stub_device(engine)
            results["compare"][label] = timed_run(engine, work, spec.longest)[0] | {
                "engine": dataclasses.asdict(cfg)}
            release(engine)
            del engine
        except Exception as e:  # noqa: BLE001 - out of memory, say: a result
            results["compare"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            gc.collect()
        save_results(results)
    print(serving_table(results))
    if results["compare"]:
        print(compare_table(results))
    save_results(results)


if __name__ == "__main__":
    app.run(main)
