"""Start-up time of the serving engine (`scripts.bench.serving --startup_only`): from process
start to the first token of a request, as scripts.serve starts (weights loaded and prepared, the
KV cache sized, every reachable program compiled or loaded from the compilation cache).

Run it twice on one --compilation_cache_dir: the first start, on an empty directory, is the
cold figure, the second the warm one. Weight loading (or random weights' creation) is reported
apart, since a benchmark may make random weights.
"""
from __future__ import annotations

import os
import sys
import time

import jax
from flax import nnx

from engine.compile_stats import compile_stats
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from scripts import common


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc, 10 ms resolution); elsewhere
    since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
SLOWEST = 8  # step programs listed by their compile time (a compile order's evidence)


def measure_startup(FLAGS, load, mesh=None, on_ready=None) -> dict:
    """One start as scripts.serve makes it (the engine flags in FLAGS), from `load()`, which
    returns the LoadedModel prepared for the device (random codes of --quant need no float
    copy that may not fit), then
    one request of 8 prompt tokens and 1 output token, then, with --startup_background, the
    programs a server compiles in the background once listening (--compile_in_background).
    Returns main_at_s (when the benchmark's main began, since process start), the durations
    of the phases (weights loaded and prepared, engine built with its KV cache, compiling,
    first token, background), the programs compiled and loaded from the compilation cache by
    the first token, ready_s (process start to first token), ready_without_weights_s (less
    the weights') and slowest_programs (the step programs that took longest on their compile
    threads, with their seconds).
    on_ready(figures so far) is called at the first token, before the background compiles."""
    out = {"main_at_s": process_age()}
    start = time.perf_counter()
    loaded = load()
    out["weights_s"] = time.perf_counter() - start
    out["weights_bytes"] = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(loaded.model)))
    start = time.perf_counter()
    engine = LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer,
                       common.engine_config_from_flags(FLAGS, loaded.cfg), mesh=mesh)
    out["engine_s"] = time.perf_counter() - start
    print(engine.kv_summary, file=sys.stderr, flush=True)
    common.print_kernels(engine.runner.kernels, engine.cfg.head_dim)
    start = time.perf_counter()
    later = common.warmup_for_serving(engine, FLAGS.compile_in_background)
    out["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    engine.add_request(list(range(3, 11)), SamplingParams(max_tokens=1, ignore_eos=True))
    while not any(delta.token_ids for delta in engine.step()):
        pass
    out["first_token_s"] = time.perf_counter() - start
    out["ready_s"] = process_age()
    out["ready_without_weights_s"] = out["ready_s"] - out["weights_s"]
    stats = compile_stats()
    out |= {"programs": stats.programs, "programs_compiled": stats.compiled,
            "programs_loaded": stats.loaded, "program_seconds": stats.seconds,
            "slowest_programs": sorted(engine.compile_seconds, key=lambda p: -p[1])[:SLOWEST],
            "compilation_cache_dir": FLAGS.compilation_cache_dir,
            "num_layers": loaded.cfg.num_layers,
            "layer_loop": engine.runner.layer_loop,
            "engine": {k: getattr(engine.engine_cfg, k) for k in (
                "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_decode_steps",
                "async_scheduling")}}
    if on_ready is not None:
        on_ready(out)
    if not FLAGS.startup_background:
        return out  # nothing started: no thread left inside XLA's compiler at exit
    start = time.perf_counter()
    engine.compile_in_background(later, log=common.log_line).join()
    out["background_s"] = time.perf_counter() - start
    out["background_programs"] = (compile_stats() - stats).programs
    return out


def startup_table(r: dict) -> str:
    """A few lines of the figures of `measure_startup`."""
    return (f"ready in {r['ready_s']:.1f}s from process start ({r['ready_without_weights_s']:.1f}s "
            f"without the weights' {r['weights_s']:.1f}s): main at {r['main_at_s']:.1f}s, engine "
            f"{r['engine_s']:.1f}s, compile {r['compile_s']:.1f}s, first token "
            f"{r['first_token_s']:.2f}s\n{r['programs']} programs: {r['programs_compiled']} "
            f"compiled, {r['programs_loaded']} loaded from the compilation cache; "
            + (f"then {r['background_programs']} in the background in "
               f"{r['background_s']:.1f}s; " if "background_s" in r else "")
            + f"layer loop {r['layer_loop']}"
            + ("\nslowest to compile: " + "; ".join(f"{label} {s:.1f}s" for label, s in
                                                  r["slowest_programs"][:3])
               if r["slowest_programs"] else ""))
