"""The figures of docs/QUANTIZATION.md: perplexity, weight size and greedy chat answers per row.

    python -m scripts.quant_report --ckpt_dir=/tmp/smollm2-quant --report_json=/tmp/report.json

Each row is a model as `scripts.eval_ppl` evaluates it (engine/perplexity.py: same function, same
default text, same token count): the float model, or a checkpoint written by `scripts.quantize`
into --ckpt_dir (rows whose checkpoint is missing are skipped), optionally with a quantized KV
cache. The greedy
answers come from the engine's ModelRunner (one prefill, then one decode step per token through
the paged cache), the same numerics `scripts.generate` runs.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from engine.perplexity import default_text, perplexity_of_ids
from engine.runner import ModelRunner
from engine.step_batch import make_step_batch
from quant.loader import load_model
from quant.model import model_nbytes
from scripts.common import setup_jax

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "How many legs does a spider have?")
# (row label, checkpoint name under --ckpt_dir or None for the float model, dtype, KV dtype)
ROWS = (
    ("float32", None, "float32", None),
    ("bf16", None, "bfloat16", None),
    ("INT8", "int8", "float32", None),
    ("INT8 asym", "int8_asym", "float32", None),
    ("INT4-RTN g128", "int4_rtn_g128", "float32", None),
    ("INT4-GPTQ g128", "int4_gptq_g128", "float32", None),
    ("INT4-GPTQ g128 act-order", "int4_gptq_g128_act_order", "float32", None),
    ("INT4-AWQ g128", "int4_awq_g128", "float32", None),
    ("INT4-RTN g32 (GGUF's own grid)", "int4_rtn_g32", "float32", None),
    ("KV cache int8", None, "float32", "int8"),
    ("KV cache fp8 (e4m3)", None, "float32", "float8_e4m3fn"),
)

flags.DEFINE_string("ckpt_dir", "/tmp/smollm2-quant", "Directory of the quantized checkpoints.")
flags.DEFINE_string("report_json", None, "Write the rows as JSON here.")
flags.DEFINE_integer("max_tokens", 48, "Greedy tokens per chat answer.")
flags.DEFINE_multi_string("only", None, "Only the rows with these labels.")
FLAGS = flags.FLAGS


def bf16_bytes(model) -> int:
    """Weight bytes with every float array in 2 bytes (integer codes as stored)."""
    total = 0
    for a in jax.tree.leaves(nnx.state(model)):
        itemsize = 2 if jnp.issubdtype(a.dtype, jnp.floating) else jnp.dtype(a.dtype).itemsize
        total += int(np.prod(a.shape)) * itemsize
    return total


def greedy_answers(cfg, model, tokenizer, prompts, max_tokens: int, kv_dtype=None,
                   page_size: int = 16) -> list[str]:
    """Greedy chat answers through the engine's runner and paged cache, one prompt at a time."""
    pages = list(range(-(-(256 + max_tokens) // page_size)))
    runner = ModelRunner(cfg, model, len(pages), page_size, kv_dtype)
    answers = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text)
        out: list[int] = []
        step = make_step_batch([(ids, 0, pages)], page_size)  # prefill (a fresh cache each time)
        for _ in range(max_tokens):
            token = int(np.asarray(runner.execute(step))[0].argmax())
            if token in cfg.eos_token_ids:
                break
            out.append(token)
            step = make_step_batch([([token], len(ids) + len(out) - 1, pages)], page_size)
        answers.append(tokenizer.decode(out))
    return answers


def evaluate_row(label, ckpt, dtype, kv_dtype, eval_ids_text: str) -> dict | None:
    spec = "smollm2-135m" if ckpt is None else os.path.join(FLAGS.ckpt_dir, ckpt)
    if not os.path.exists(spec) and ckpt is not None:
        print(f"skipping {label}: {spec} is missing")
        return None
    loaded = load_model(spec, jnp.dtype(dtype))
    ids = loaded.tokenizer.encode(eval_ids_text)[:2048]
    start = time.perf_counter()
    ppl, nll = perplexity_of_ids(loaded.cfg, loaded.model, ids, 16, kv_dtype)
    answers = greedy_answers(loaded.cfg, loaded.model, loaded.tokenizer, PROMPTS,
                             FLAGS.max_tokens, kv_dtype)
    row = {"label": label, "model": spec, "dtype": dtype, "kv_cache_dtype": kv_dtype,
           "perplexity": ppl, "mean_nll": nll, "num_tokens": len(ids),
           "weight_bytes": model_nbytes(loaded.model), "weight_bytes_bf16": bf16_bytes(
               loaded.model), "answers": dict(zip(PROMPTS, answers)),
           "seconds": time.perf_counter() - start}
    print(json.dumps(row, indent=1), flush=True)
    return row


def main(argv):
    del argv
    setup_jax()
    text = default_text()
    rows = [r for r in ROWS if not FLAGS.only or r[0] in FLAGS.only]
    results = [row for row in (evaluate_row(*r, text) for r in rows) if row is not None]
    if FLAGS.report_json:
        with open(FLAGS.report_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
