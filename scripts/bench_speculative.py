"""Speculative decoding speed-up on input-grounded prompts (repeat / lightly edit a text).

    python -m scripts.bench_speculative --model=smollm2-135m --methods=none,ngram,draft \
        --draft_model=/tmp/smollm2-draft

Each method generates greedily from the same chat prompts (a warm-up run first, so compilation is
not timed), checks that the tokens equal plain decoding's, and reports decode tokens/s, the
speed-up over plain decoding, and the acceptance figures. Prints a table and writes JSON.
--tp / --dp run the target over a device mesh (scripts/parallel.py; the draft model stays on one
device); --fuse_projections fuses q/k/v and gate/up (default: on a GPU without a mesh).
"""
from __future__ import annotations

import dataclasses
import json
import time

from absl import app, flags

from scripts import common, parallel

common.define_model_flags()
common.define_engine_flags()
common.define_speculative_flags()
common.define_fusion_flags()
flags.DEFINE_list("methods", ["none", "ngram"], "Methods to compare: none, ngram, draft.")
flags.DEFINE_integer("max_tokens", 128, "Tokens generated per prompt.")
flags.DEFINE_integer("repeats", 2, "Timed runs per method (the best is kept).")
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
    f"Rewrite this code, renaming the variable `values` to `xs`, and change nothing else:\n\n{CODE}",
)


def run(engine, prompt_ids, params) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of one generate() call (first tokens excluded) and its outputs."""
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    ttft = max(o.ttft_s for o in outs)
    generated = sum(len(o.output_ids) - 1 for o in outs)
    return generated / max(elapsed - ttft, 1e-9), [o.output_ids for o in outs]


def main(argv):
    del argv
    common.setup_jax()
    try:
        from engine.llm_engine import LLMEngine
        from engine.mesh import is_main_process
        from engine.request import SamplingParams
        from quant.loader import load_model

        mesh = parallel.setup_parallel()  # --tp / --dp / multi-process; None: one device
        common.check_fusion(mesh)
        dtype = common.resolve_dtype(FLAGS.dtype)
        loaded = load_model(FLAGS.model, dtype, FLAGS.random_weights, FLAGS.seed, mesh=mesh)
        loaded = common.prepare_model(loaded, mesh)  # --fuse_projections
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
            if mesh is not None and not results:
                print(f"{parallel.describe(mesh)}; {engine.runner.plan.describe()}")
            run(engine, prompt_ids, params)  # warm-up: compiles
            engine.spec_stats = type(engine.spec_stats)()
            best, outputs = 0.0, None
            for _ in range(FLAGS.repeats):
                rate, outputs = run(engine, prompt_ids, params)
                best = max(best, rate)
            reference = outputs if reference is None else reference
            results[method] = {"decode_tokens_per_s": best, "same_tokens_as_first_method":
                               outputs == reference} | engine.spec_stats.as_dict()
    except common.USER_ERRORS as e:
        common.fail(str(e))
    base = results[FLAGS.methods[0]]["decode_tokens_per_s"]
    print(f"{'method':<8} {'tokens/s':>9} {'speed-up':>9} {'accept':>7} {'mean len':>9} same")
    for method, r in results.items():
        r["speedup"] = r["decode_tokens_per_s"] / base
        print(f"{method:<8} {r['decode_tokens_per_s']:>9.1f} {r['speedup']:>8.2f}x "
              f"{r['acceptance_rate']:>7.0%} {r['mean_acceptance_length']:>9.2f} "
              f"{r['same_tokens_as_first_method']}")
    if FLAGS.json_out and is_main_process():
        with open(FLAGS.json_out, "w") as f:
            json.dump({"model": FLAGS.model, "max_tokens": FLAGS.max_tokens,
                       "mesh": None if mesh is None else dict(mesh.shape),
                       "fused_projections": loaded.cfg.fused_projections,
                       "num_speculative_tokens": FLAGS.num_speculative_tokens,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
