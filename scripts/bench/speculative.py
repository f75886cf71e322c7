"""Speculative decoding: the speed-up of each method end to end, what verification costs on the
device, and the speed-up a proposer that always agrees reaches.

    python -m scripts.bench.speculative --model=smollm2-135m --methods=none,ngram,draft \
        --draft_model=/tmp/smollm2-draft
    python -m scripts.bench.speculative --model=llama3.1-8b --random_weights \
        --modes=costs,oracle --batches=1,8,64 --max_k=8 --context=1024

Modes:
- methods: each of --methods generates greedily from the same input-grounded chat prompts
  (repeat or lightly edit a text; a warm-up run first, so compilation is not timed); decode
  tokens/s, the speed-up over the first method (the peer, plain decoding by default), the
  acceptance figures, and whether the tokens equal the first method's. Needs a tokenizer.
- costs: decode and verification step times per --batches (speculative_costs.py) and the
  speed-up they predict per acceptance rate --alphas (best k).
- oracle: the engine with a proposer that always agrees with the target, at k = --oracle_k,
  against plain decoding of the same prompts, end to end: the upper bound.
--tp / --dp run the target over a device mesh (the draft model stays on one device).
Prints tables and writes JSON.
"""
from __future__ import annotations

import dataclasses
import sys
import time

from absl import app, flags

from engine.llm_engine import LLMEngine
from engine.mesh import is_main_process
from engine.request import SamplingParams
from ops.backends import device_kernels
from quant.loader import EMBEDDED_PRESETS, load_model
from scripts import common, parallel
from scripts.bench.common import markdown_table, run_info, write_json
from scripts.bench.speculative_costs import oracle_run, predicted_speedups, step_costs

common.define_model_flags()
common.define_engine_flags()
common.define_speculative_flags()
common.define_fusion_flags()
MODES = ("methods", "costs", "oracle")
flags.DEFINE_list("modes", ["methods"], "methods, costs, oracle (see the module docstring).")
flags.DEFINE_list("methods", ["none", "ngram"], "methods: compared methods (none, ngram, draft); "
                  "the first is the peer.")
flags.DEFINE_integer("max_tokens", 128, "methods: tokens generated per prompt.")
flags.DEFINE_integer("repeats", 2, "methods: timed runs per method (the best is kept).")
flags.DEFINE_list("batches", ["1", "8", "64"], "costs, oracle: sequences per step.")
flags.DEFINE_integer("max_k", 8, "costs: most proposals verified per sequence.")
flags.DEFINE_integer("context", 1024, "costs: tokens already cached per sequence.")
flags.DEFINE_integer("calls", 20, "costs: steps queued before one sync.")
flags.DEFINE_integer("runs", 3, "costs: timed repetitions (median).")
flags.DEFINE_list("alphas", ["0.5", "0.6", "0.7", "0.8", "0.9"],
                  "costs: acceptance rates to predict.")
flags.DEFINE_float("draft_cost", 0.0, "costs: a draft step's cost in target decode steps "
                   "(0: n-gram).")
flags.DEFINE_integer("oracle_k", 4, "oracle: proposals per step.")
flags.DEFINE_integer("oracle_prompt_len", 32, "oracle: prompt tokens.")
flags.DEFINE_integer("oracle_tokens", 64, "oracle: tokens generated per sequence.")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS

PARAGRAPH = (
    "The Python standard library is very extensive, offering a wide range of facilities. The "
    "library contains built-in modules, written in C, that provide access to system functionality "
    "such as file input and output that would otherwise be inaccessible to Python programmers, "
    "as well as modules written in Python that provide standardized solutions for many problems "
    "that occur in everyday programming.")
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
    "    return total / len(values)\n")
PROMPTS = (
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "Rewrite this code, renaming the variable `values` to `xs`, and change nothing else:\n\n"
    + CODE,
)


def check_flags() -> tuple[list[int], list[float]]:
    """(batches, alphas) parsed; ValueError naming a bad flag."""
    unknown = sorted(set(FLAGS.modes) - set(MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    batches = [int(b) for b in FLAGS.batches]
    alphas = [float(a) for a in FLAGS.alphas]
    if min(batches) < 1 or FLAGS.max_k < 1 or FLAGS.context < 1:
        raise ValueError(f"--batches ({FLAGS.batches}), --max_k ({FLAGS.max_k}) and "
                         f"--context ({FLAGS.context}) must be >= 1")
    if not all(0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"--alphas must lie in [0, 1], got {FLAGS.alphas}")
    return batches, alphas


def timed_generate(engine, prompt_ids, params) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of one generate() call (first tokens excluded) and its outputs."""
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    ttft = max(o.ttft_s for o in outs)
    generated = sum(len(o.output_ids) - 1 for o in outs)
    return generated / max(elapsed - ttft, 1e-9), [o.output_ids for o in outs]


def compare_methods(loaded, dtype, mesh) -> dict:
    """The methods mode: {method: figures}, each with its speed-up over the first method."""
    if loaded.tokenizer is None:
        raise ValueError(f"--modes=methods needs a model with a tokenizer (its chat prompts); "
                         f"{FLAGS.model} has none")
    # Without the prefix cache every run repeats the warm-up's steps (and programs) exactly.
    engine_cfg = dataclasses.replace(common.engine_config_from_flags(FLAGS, loaded.cfg),
                                     enable_prefix_caching=False)
    prompt_ids = [loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": p}])) for p in PROMPTS]
    params = SamplingParams(max_tokens=FLAGS.max_tokens, ignore_eos=True)
    results, reference = {}, None
    for method in FLAGS.methods:
        FLAGS.speculative = method
        spec, draft = common.speculation_from_flags(FLAGS, dtype)
        engine = LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer, engine_cfg, spec, draft,
                           mesh=mesh)
        timed_generate(engine, prompt_ids, params)  # warm-up: compiles
        engine.spec_stats = type(engine.spec_stats)()
        best, outputs = 0.0, None
        for _ in range(FLAGS.repeats):
            rate, outputs = timed_generate(engine, prompt_ids, params)
            best = max(best, rate)
        reference = outputs if reference is None else reference
        results[method] = {"decode_tokens_per_s": best, "same_tokens_as_first_method":
                           outputs == reference} | engine.spec_stats.as_dict()
    base = results[FLAGS.methods[0]]["decode_tokens_per_s"]
    for r in results.values():
        r["speedup"] = r["decode_tokens_per_s"] / base
    return results


def methods_table(results: dict) -> str:
    return markdown_table(["method", "tokens/s", "speed-up", "acceptance", "mean length",
                           "same tokens"], [
        [m, f"{r['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
         f"{r['acceptance_rate']:.0%}", f"{r['mean_acceptance_length']:.2f}",
         r["same_tokens_as_first_method"]] for m, r in results.items()])


def costs_tables(rows: list[dict], predicted: list[dict], alphas: list[float]) -> str:
    ks = [v["k"] for v in rows[0]["verify"]]
    costs = markdown_table(["batch", "decode ms"] + [f"verify k={k} (decode steps)" for k in ks], [
        [r["batch"], f"{r['decode_step_s'] * 1e3:.2f}"] + [f"{v['over_decode']:.2f}"
                                                           for v in r["verify"]] for r in rows])
    best = markdown_table(["batch"] + [f"alpha={a}" for a in alphas], [
        [r["batch"]] + [f"{p['best'][a][1]:.2f}x k={p['best'][a][0]}" for a in alphas]
        for r, p in zip(rows, predicted)])
    return (f"verification step cost, in decode steps\n{costs}\n\npredicted speed-up, best k "
            f"(draft cost {FLAGS.draft_cost} decode steps per proposal)\n{best}")


def oracle_table(oracle: list[dict]) -> str:
    return "always-agreeing proposer, end to end\n" + markdown_table(
        ["batch", "k", "speculative tok/s", "plain tok/s", "speed-up", "acceptance",
         "same tokens"], [
            [o["batch"], o["k"], f"{o['speculative_tokens_per_s']:.1f}",
             f"{o['plain_tokens_per_s']:.1f}", f"{o['speedup']:.2f}x",
             f"{o['acceptance_rate']:.2f}", o["same_tokens"]] for o in oracle])


def main(argv):
    del argv
    common.setup_jax()
    try:
        batches, alphas = check_flags()
        mesh = parallel.setup_parallel()  # --tp / --dp / multi-process; None: one device
        common.check_fusion(mesh)
        dtype = common.resolve_dtype(FLAGS.dtype)
        random = FLAGS.random_weights or FLAGS.model not in EMBEDDED_PRESETS
        loaded = load_model(FLAGS.model, dtype, random, FLAGS.seed, mesh=mesh)
        loaded = common.prepare_model(loaded, mesh)  # --fuse_projections
        if mesh is not None:
            print(parallel.describe(mesh))
        # what every runner of this run chooses (engine/runner.py, engine/sharded_runner.py)
        common.print_kernels(device_kernels(mesh_axes=() if mesh is None else
                                            tuple(mesh.shape.items())), file=sys.stdout)
        report = run_info() | {"model": FLAGS.model, "modes": FLAGS.modes,
                               "mesh": None if mesh is None else dict(mesh.shape),
                               "fused_projections": loaded.cfg.fused_projections}
        tables = []
        if "methods" in FLAGS.modes:
            report["num_speculative_tokens"] = FLAGS.num_speculative_tokens
            report["methods"] = compare_methods(loaded, dtype, mesh)
            tables.append(methods_table(report["methods"]))
    except common.USER_ERRORS as e:
        common.fail(str(e))
    cfg, model = loaded.cfg, loaded.model
    if "costs" in FLAGS.modes:
        rows = step_costs(cfg, model, batches, FLAGS.max_k, FLAGS.context, FLAGS.page_size,
                          FLAGS.calls, FLAGS.runs, mesh)
        predicted = [predicted_speedups(r, alphas, FLAGS.draft_cost) for r in rows]
        report |= {"context": FLAGS.context, "draft_cost": FLAGS.draft_cost,
                   "step_costs": rows, "predicted": predicted}
        tables.append(costs_tables(rows, predicted, alphas))
    if "oracle" in FLAGS.modes:
        report["oracle"] = [oracle_run(cfg, model, s, FLAGS.oracle_k, FLAGS.oracle_prompt_len,
                                       FLAGS.oracle_tokens, FLAGS.page_size, mesh)
                            for s in batches]
        tables.append(oracle_table(report["oracle"]))
    print("\n\n".join(tables))
    if FLAGS.json_out and is_main_process():
        write_json(FLAGS.json_out, report)


if __name__ == "__main__":
    app.run(main)
