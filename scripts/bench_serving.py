"""Serving benchmark: continuous batching against static batching on a synthetic workload.

    python -m scripts.bench_serving --model=llama3.2-1b --num_requests=500 --max_num_seqs=256

A seeded workload of random-token prompts: input and output lengths drawn from log-normal
distributions (long-tailed, like ShareGPT conversations), arrivals Poisson at --request_rate
requests/s (inf: all at once). Requests ignore EOS and stop at their drawn output length, so both
runs do the same useful work. The engine runs in process. In the same run a static-batching
baseline (wait for a full batch, run it until its longest output is done) serves the same
requests on the same model. Prints a table and writes JSON. With --url the same workload
drives a running server over HTTP instead (scripts/bench_http.py).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import time

import numpy as np
from absl import app, flags

from scripts import common, parallel, timing

common.define_model_flags()
common.define_engine_flags()
common.define_fusion_flags()
flags.DEFINE_integer("num_requests", 200, "Requests in the workload.")
flags.DEFINE_float("request_rate", math.inf, "Poisson arrival rate, requests/s (inf: all at once).")
flags.DEFINE_integer("input_len", 200, "Median prompt length (tokens).")
flags.DEFINE_integer("output_len", 150, "Median output length (tokens).")
flags.DEFINE_float("len_sigma", 0.8, "Sigma of the log-normal length distributions.")
flags.DEFINE_integer("max_input_len", 1024, "Longest prompt drawn.")
flags.DEFINE_integer("max_output_len", 1024, "Longest output drawn.")
flags.DEFINE_integer("shared_prefix_len", 0, "Tokens of a system prompt shared by all requests.")
flags.DEFINE_integer("static_batch_size", None, "Static baseline batch (default: max_num_seqs).")
flags.DEFINE_bool("static_baseline", True, "Also measure static batching.")
flags.DEFINE_enum("warmup", "shapes", ["shapes", "rerun"],
                  "shapes: compile every program a run can reach at start (LLMEngine.warmup); "
                  "rerun: run the same workload once untimed first (fewer programs compiled; "
                  "exact with --request_rate=inf, where the schedule is deterministic).")
flags.DEFINE_bool("host_phases", False, "Time the engine's host phases (schedule, batch, "
                  "dispatch, append; and the wait for tokens) in the continuous run; ms per step.")
flags.DEFINE_string("host_profile", None, "Profile the continuous run's Python with cProfile "
                    "and write the functions with the most own time here (text); the JSON gets "
                    "the top ones (where a device host's engine Python goes).")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
flags.DEFINE_string("url", None, "Drive a running server (scripts.serve) at this address "
                    "over HTTP instead of an in-process engine (scripts/bench_http.py).")
flags.DEFINE_string("api_key", None, "With --url: the server's API key.")
FLAGS = flags.FLAGS


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds from the start


def make_workload(seed: int, num: int, vocab: int, rate: float) -> Workload:
    """Seeded long-tailed lengths, random token prompts, Poisson (or simultaneous) arrivals."""
    rng = np.random.default_rng(seed)

    def lengths(median, longest, shortest):
        drawn = rng.lognormal(math.log(median), FLAGS.len_sigma, num)
        return np.clip(np.round(drawn), shortest, longest).astype(int).tolist()

    prefix = rng.integers(0, vocab, FLAGS.shared_prefix_len).tolist()
    prompts = [prefix + rng.integers(0, vocab, n).tolist()
               for n in lengths(FLAGS.input_len, FLAGS.max_input_len, 4)]
    outputs = lengths(FLAGS.output_len, FLAGS.max_output_len, 1)
    gaps = np.zeros(num) if math.isinf(rate) else rng.exponential(1.0 / rate, num)
    return Workload(prompts, outputs, np.cumsum(gaps).tolist())


def percentiles(values) -> dict:
    values = np.asarray(values, float)
    if not len(values):
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def run_continuous(engine, work: Workload) -> dict:
    """Feeds requests at their arrival times into one engine stepping continuously."""
    from engine.request import SamplingParams
    order = list(range(len(work.prompts)))
    ttft, tpot, latency, useful = [], [], [], 0
    start = time.perf_counter()
    next_i = 0
    compiled_before = len(engine.runner.compiled_shapes)
    while next_i < len(order) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_i < len(order) and work.arrivals[next_i] <= now:
            engine.add_request(work.prompts[next_i], SamplingParams(
                max_tokens=work.output_lens[next_i], ignore_eos=True))
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


def run_static(engine, work: Workload, batch_size: int) -> dict:
    """Waits for a full batch (in arrival order), runs it until its longest output is done."""
    from engine.request import SamplingParams
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
                               SamplingParams(max_tokens=longest, ignore_eos=True))
        done = time.perf_counter() - start
        for i, out in zip(idx, outs):
            queued = batch_start - work.arrivals[i]  # time spent waiting for the batch
            n = work.output_lens[i]  # useful tokens; the rest is padding work
            useful += n
            ttft.append(queued + out.ttft_s)
            latency.append(done - work.arrivals[i])
            if n > 1:
                tpot.append((out.total_s - out.ttft_s) / (longest - 1))
    duration = time.perf_counter() - start
    return summarize(duration, useful, ttft, tpot, latency)


def summarize(duration, useful, ttft, tpot, latency) -> dict:
    return {"duration_s": duration, "requests_per_s": len(ttft) / duration,
            "output_tokens_per_s": useful / duration, "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot), "latency_s": percentiles(latency)}


def host_share(engine) -> dict:
    """Host time (scheduling, batch building, detokenization) as a share of step time: all of
    it, and the part during which the device had nothing queued (exposed; with asynchronous
    scheduling the rest overlaps device work); over all rounds and over each of
    timing.round_sets (at the most sequences running; saturated). A multi-step round counts as
    its model steps: its host time and wall time are shared among them."""
    steps = np.asarray(engine.stats.steps, float).reshape(-1, 6)

    def share(s, column):
        return float(s[:, column].sum() / s[:, 2].sum()) if len(s) else None

    out = {"host_share_all_steps": share(steps, 1),
           "exposed_host_share_all_steps": share(steps, 3),
           "max_running": int(steps[:, 0].max()) if len(steps) else 0,
           "async_scheduling": engine.engine_cfg.async_scheduling,
           "num_decode_steps": engine.engine_cfg.num_decode_steps}
    for name, mask in timing.round_sets(steps).items():
        out |= {f"host_share_{name}": share(steps[mask], 1),
                f"exposed_host_share_{name}": share(steps[mask], 3)}
        out |= timing.round_set_figures(steps, mask, name)
    return out


def phase_figures(stats, phases: dict, per_step: list) -> dict:
    """The host phases in ms per model step over all steps, and over each of
    timing.round_sets (at the most sequences running; saturated); printed. Over those the
    engine's Python is also given as a share of the step: the issue's host time (scheduling,
    batch building, bookkeeping, appending tokens and detokenization), without the dispatch of
    the jitted program."""
    # The engine's host time not in a timed phase: its step loop, stop checks, output
    # assembly, detokenization, the timers themselves.
    on_host = {name: t for name, t in phases.items() if not name.startswith(timing.WORKER)}
    phases["other host"] = stats.host_time_s - sum(on_host.values())
    phases["wait for tokens"] = stats.step_time_s - stats.host_time_s
    out = {"host_phase_ms_per_step": {
        name: 1e3 * total / max(stats.num_model_steps, 1) for name, total in phases.items()}}
    print("host phases, ms per model step: " + ", ".join(
        f"{name} {ms:.3f}" for name, ms in out["host_phase_ms_per_step"].items()), flush=True)
    # per_step[i] is the phases of the round stats.steps[i] (running, host, wall, exposed,
    # model steps, waiting) records; both started empty with the timed run.
    if len(per_step) != len(stats.steps):
        raise RuntimeError(f"{len(per_step)} timed rounds for {len(stats.steps)} recorded ones")
    for name, mask in timing.round_sets(stats.steps).items():
        chosen = [(s, d) for s, d, m in zip(stats.steps, per_step, mask) if m]
        model_steps = sum(s[4] for s, _ in chosen)
        if not model_steps:
            continue
        ms = {phase: 1e3 * sum(d[phase] for _, d in chosen) / model_steps
              for phase in chosen[0][1]}
        host_ms = 1e3 * sum(s[1] for s, _ in chosen) / model_steps
        ms["other host"] = host_ms - sum(v for phase, v in ms.items()
                                         if not phase.startswith(timing.WORKER))
        step_ms = 1e3 * sum(s[2] for s, _ in chosen) / model_steps
        python_ms = host_ms - sum(v for phase, v in ms.items() if phase.startswith("dispatch"))
        out |= {f"host_phase_ms_per_step_{name}": ms,
                f"engine_python_share_{name}": python_ms / step_ms}
        rounds = len(chosen)
        label = {"at_max_running": f"at {max(s[0] for s in stats.steps)} running",
                 "saturated": "while saturated"}[name]
        print(f"host phases {label} ({rounds} rounds, {int(model_steps)} model steps, "
              f"{sum(s[4] > 1 for s, _ in chosen)} of the rounds multi-step), ms per model "
              "step: " + ", ".join(f"{phase} {v:.3f}" for phase, v in ms.items())
              + f"; the engine's Python (all but the dispatch) {python_ms:.3f} ms of a "
              f"{step_ms:.3f} ms step ({python_ms / step_ms:.1%})", flush=True)
    return out


def release(engine) -> None:
    """Frees an engine's device memory now: its KV cache is deleted and the objects frozen at
    start-up (freeze_startup_objects) are unfrozen and collected, so the next engine can take
    the memory (the frozen engine's reference cycles would otherwise keep it alive)."""
    import jax
    for page in jax.tree.leaves(engine.runner.cache):
        page.delete()
    gc.unfreeze()
    gc.collect()


def print_table(results: dict) -> None:
    rows = [("", "continuous", "static")]
    c, s = results["continuous"], results.get("static") or {}

    def fmt(x, digits=3):
        return "-" if x is None else f"{x:.{digits}f}"

    rows.append(("requests/s", fmt(c["requests_per_s"]), fmt(s.get("requests_per_s"))))
    rows.append(("output tokens/s", fmt(c["output_tokens_per_s"], 1),
                 fmt(s.get("output_tokens_per_s"), 1)))
    for metric in ("ttft_s", "tpot_s", "latency_s"):
        for q in ("p50", "p90", "p99"):
            rows.append((f"{metric[:-2]} {q} (s)", fmt(c[metric][q], 4),
                         fmt((s.get(metric) or {}).get(q), 4)))
    rows.append(("prefix hit rate", fmt(c["prefix_hit_rate"]), "-"))
    rows.append(("preemptions", str(c["preemptions"]), "-"))
    running = c.get("max_running")
    for name, key in (("host share", "host_share"), ("exposed host share", "exposed_host_share")):
        rows.append((f"{name} of step", fmt(c.get(f"{key}_all_steps")), "-"))
        rows.append((f"{name} at {running} running", fmt(c.get(f"{key}_at_max_running")), "-"))
        rows.append((f"{name} while saturated", fmt(c.get(f"{key}_saturated")), "-"))
    width = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:>12}  {r[2]:>12}")
    if s:
        print(f"continuous / static throughput: "
              f"{c['output_tokens_per_s'] / s['output_tokens_per_s']:.2f}x")


def warm_up(engine, longest: int, rerun) -> int:
    """Compiles per --warmup; returns the number of programs compiled."""
    before = len(engine.runner.compiled_shapes)
    if FLAGS.warmup == "shapes":
        engine.warmup(max_total_len=longest, progress=common.print_progress("compiling"))
    else:
        rerun()
        engine.pool = type(engine.pool)(engine.pool.num_pages, engine.pool.page_size,
                                        engine.pool.enable_prefix_caching)  # forget the cache
        engine.scheduler.pool = engine.pool
        engine.scheduler.num_preemptions = 0
    return len(engine.runner.compiled_shapes) - before


def profiled(run, path: str, top: int = 40):
    """(run(), [[function, calls, own s, cumulative s] of the `top` functions by own time]),
    with cProfile on during run(); the whole table (by own time) is written to `path`."""
    import cProfile
    import io
    import pstats
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
    top_rows = [(func, stats.stats[func]) for func in stats.fcn_list[:top]]  # by own time
    return out, [[f"{file}:{line}({name})", calls, own, cum]
                 for (file, line, name), (_, calls, own, cum, _) in top_rows]


def main(argv):
    del argv
    if FLAGS.url:
        from scripts import bench_http
        return bench_http.main(FLAGS, make_workload, summarize, print_table)
    common.setup_jax()
    try:
        import jax

        from engine.llm_engine import LLMEngine
        from engine.mesh import is_main_process
        from models.loader import EMBEDDED_PRESETS, load_model

        mesh = parallel.setup_parallel()  # --tp / --dp / multi-process; None: one device
        common.check_fusion(mesh)
        if jax.process_count() > 1 and not math.isinf(FLAGS.request_rate):
            raise ValueError("with several processes --request_rate must be inf: arrivals timed "
                             "by each process's clock would give the processes different steps")
        random = FLAGS.random_weights or FLAGS.model not in EMBEDDED_PRESETS
        loaded = load_model(FLAGS.model, common.resolve_dtype(FLAGS.dtype), random, FLAGS.seed,
                            mesh=mesh)
        loaded = common.prepare_model(loaded, mesh)  # --fuse_projections
        engine_cfg = common.engine_config_from_flags(FLAGS, loaded.cfg)
        longest = FLAGS.shared_prefix_len + FLAGS.max_input_len + FLAGS.max_output_len
        if engine_cfg.max_model_len is not None and longest > engine_cfg.max_model_len:
            raise ValueError(f"shared_prefix_len + max_input_len + max_output_len = {longest} "
                             f"exceeds max_model_len {engine_cfg.max_model_len}")
        work = make_workload(FLAGS.seed, FLAGS.num_requests, loaded.cfg.vocab_size,
                             FLAGS.request_rate)
    except common.USER_ERRORS as e:
        common.fail(str(e))
    results = {"model": FLAGS.model, "device": str(jax.devices()[0].device_kind),
               "num_requests": FLAGS.num_requests, "request_rate": FLAGS.request_rate,
               "input_len_median": FLAGS.input_len, "output_len_median": FLAGS.output_len,
               "mean_input_len": float(np.mean([len(p) for p in work.prompts])),
               "mean_output_len": float(np.mean(work.output_lens)),
               "engine": dataclasses.asdict(engine_cfg),
               "mesh": None if mesh is None else dict(mesh.shape),
               "fused_projections": loaded.cfg.fused_projections}

    engine = LLMEngine(loaded.cfg, loaded.model, None, engine_cfg, mesh=mesh)
    if mesh is not None:
        print(f"{parallel.describe(mesh)}; {engine.runner.plan.describe()}")
    print(engine.kv_summary)
    start = time.perf_counter()
    results["programs_compiled_at_start"] = warm_up(engine, longest, lambda: run_continuous(
        engine, work))
    results["warmup_s"] = time.perf_counter() - start
    common.freeze_startup_objects()
    engine.stats = type(engine.stats)(record_steps=True)
    per_step: list = []
    phases = timing.time_engine_phases(engine, per_step) if FLAGS.host_phases else None
    if FLAGS.host_profile:
        continuous, results["host_profile_top"] = profiled(lambda: run_continuous(engine, work),
                                                           FLAGS.host_profile)
    else:
        continuous = run_continuous(engine, work)
    results["continuous"] = continuous | host_share(engine)
    if phases is not None:
        results["continuous"] |= phase_figures(engine.stats, phases, per_step)
    release(engine)
    del engine
    if FLAGS.static_baseline:
        batch = FLAGS.static_batch_size or engine_cfg.max_num_seqs
        static_cfg = dataclasses.replace(engine_cfg, max_num_seqs=batch,
                                         enable_prefix_caching=False)
        engine = LLMEngine(loaded.cfg, loaded.model, None, static_cfg, mesh=mesh)
        warm_up(engine, longest, lambda: run_static(engine, work, batch))
        results["static"] = run_static(engine, work, batch) | {"batch_size": batch}
        results["continuous_over_static"] = (results["continuous"]["output_tokens_per_s"]
                                             / results["static"]["output_tokens_per_s"])
    print_table(results)
    if FLAGS.json_out and is_main_process():
        with open(FLAGS.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
