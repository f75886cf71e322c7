"""How evenly a mixture of experts routes one step: per layer, the experts its pairs touch and
the busiest expert's share of the tokens.

    python -m scripts.bench.moe_routing --model=qwen3-30b-a3b --quant=int4 --tokens=2048

Random weights (normal 0.02, as every benchmark's) and random tokens; one prefill step of a
prompt, or with --batch one decode step over a random cache, its group sizes recorded by
models.moe.record_routing. A trained router spreads a prompt over
many experts; random weights may not, and a benchmark's prefill and serving figures for a
mixture depend on it (the grouped kernel's work per expert, ops/expert_gemm.py).
--hidden_size narrows the model (heads of 64, experts 1/8 as wide as hidden, the layers,
experts and top-k kept) so that a model too large for the machine runs, e.g. on the CPU.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs.model import get_preset
from models import moe
from scripts.bench import decode_model as dm
from scripts.bench.common import markdown_table, run_info, write_json
from scripts.common import fail, resolve_dtype, setup_jax

flags.DEFINE_string("model", "qwen3-30b-a3b", "A mixture-of-experts preset.")
flags.DEFINE_integer("tokens", 2048, "Prompt tokens (a prefill step).")
flags.DEFINE_integer("batch", 0, "Instead of a prefill: one decode step of this many sequences "
                     "at --context tokens each, over a cache of random K/V (as "
                     "scripts.bench.decode times them).")
flags.DEFINE_integer("context", 1024, "Tokens each decoding sequence attends to (--batch).")
flags.DEFINE_enum("quant", "none", ["none", "int8", "int4"], "Expert and layer weights.")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"],
                  "Weights (default: float32 on the CPU, bfloat16 elsewhere).")
flags.DEFINE_integer("hidden_size", 0, "Narrow the model to this hidden size (0: the preset's).")
flags.DEFINE_integer("page_size", 16, "KV-cache page size.")
flags.DEFINE_integer("seed", 0, "Seed for the weights and the prompt.")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS


def narrowed(cfg, hidden: int):
    """cfg at hidden size `hidden`: heads of 64 (at most cfg's KV heads), experts hidden / 8
    wide, the dense MLP 3/8; layers, experts and top-k as they are."""
    if hidden % 64:
        raise ValueError(f"--hidden_size={hidden}: not a multiple of 64")
    heads = hidden // 64
    return dataclasses.replace(
        cfg, name=f"{cfg.name}@{hidden}", hidden_size=hidden, num_heads=heads, head_dim=64,
        num_kv_heads=min(cfg.num_kv_heads, heads), intermediate_size=3 * hidden // 8,
        moe_intermediate_size=max(hidden // 8, 8), vocab_size=min(cfg.vocab_size, 8192))


def layer_rows(sizes: list[np.ndarray], top_k: int) -> list[dict]:
    """Per recorded layer: experts touched, the busiest expert's pairs and their share of the
    step's tokens (1.0: every token chose it; the step's tokens are the prompt's padded to
    its program's size, and padding tokens route too)."""
    return [{"layer": i, "experts_touched": int((s > 0).sum()), "busiest": int(s.max()),
             "busiest_share": float(s.max()) * top_k / float(s.sum())}
            for i, s in enumerate(sizes)]


def main(argv):
    del argv
    setup_jax()
    cfg = get_preset(FLAGS.model)
    if not cfg.is_moe:
        fail(f"--model={FLAGS.model} is not a mixture of experts")
    if FLAGS.hidden_size:
        cfg = narrowed(cfg, FLAGS.hidden_size)
    dtype = resolve_dtype(FLAGS.dtype)
    cfg, model = dm.build_model(cfg, dtype, FLAGS.seed, FLAGS.quant, fused=True)
    rng = np.random.default_rng(FLAGS.seed)
    if FLAGS.batch:
        b, c = FLAGS.batch, FLAGS.context
        runner = dm.make_runner(cfg, model, b, c, FLAGS.page_size)
        dm.fill_cache_random(runner, FLAGS.seed + 1)
        batch = dm.decode_batch(rng.integers(0, cfg.vocab_size, b), np.full(b, c - 1),
                                dm.page_tables(b, -(-c // FLAGS.page_size), FLAGS.seed),
                                FLAGS.page_size)
    else:
        runner = dm.make_runner(cfg, model, 1, FLAGS.tokens, FLAGS.page_size)
        batch = dm.prefill_batch(rng.integers(0, cfg.vocab_size, FLAGS.tokens),
                                 dm.page_tables(1, -(-FLAGS.tokens // FLAGS.page_size),
                                                FLAGS.seed)[0], FLAGS.page_size)
    with moe.record_routing() as sizes:
        np.asarray(runner.execute_padded(batch).astype(jnp.float32))
    rows = layer_rows(sizes, cfg.num_experts_per_tok)
    if len(rows) != cfg.num_layers:
        fail(f"recorded {len(rows)} layers of {cfg.num_layers}: the step's pairs were not "
             f"sorted (a decode step of at most {cfg.num_experts} pairs keeps them in token "
             "order; use a larger --batch)")
    header = ["layer", "experts touched", "busiest expert's pairs", "of the step's tokens"]
    print(markdown_table(header, [[r["layer"], r["experts_touched"], r["busiest"],
                                   f"{r['busiest_share']:.0%}"] for r in rows]))
    if FLAGS.json_out:
        write_json(FLAGS.json_out, {**run_info(), "model": cfg.name, "quant": FLAGS.quant,
                                    "tokens": FLAGS.tokens, "batch": FLAGS.batch,
                                    "context": FLAGS.context,
                                    "step_tokens": int(sizes[0].sum()) // cfg.num_experts_per_tok,
                                    "layers": rows})


if __name__ == "__main__":
    app.run(main)
