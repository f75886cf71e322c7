"""Distill a small draft model for speculative decoding from a target's logits.

    python -m scripts.distill_draft --model=smollm2-135m --num_layers=4 --steps=200 \
        --output=/tmp/smollm2-draft
    python -m scripts.generate --speculative=draft --draft_model=/tmp/smollm2-draft --prompt=...

The draft has the target's config with --num_layers decoder layers. It starts as a copy of the
target's token embedding (and output head, tied or not), final norm, and --num_layers of its
layers: with --init_layers=spaced (default) evenly spaced over the depth, first and last included
(0, 10, 19, 29 of SmolLM2's 30 for 4); with --init_layers=first the first ones.

Training minimizes KL(target || draft) per token on a text, with the target's full distribution as
soft labels: each step runs the target (no gradient) and the draft over --batch_size rows of
--seq_len tokens taken at random offsets of the training text, both through the engine's own
`models.llama.forward` over a fresh paged KV cache (which is differentiable), in one jitted step;
adamw with warm-up and cosine decay, gradient clipping at norm 1. The token embedding stays
frozen unless --train_embedding (it is most of a small draft's weights, and keeping it keeps the
draft's output space the target's). The last --eval_rows rows of the text are held out: the KL,
the top-1 agreement (how often the draft's argmax is the target's: the greedy acceptance rate
per position) and the overlap sum(min(p, q)) (the acceptance rate of sampling at temperature 1)
are printed before and after training.

Default text: the Debian license texts in /usr/share/common-licenses (files in name order, each
once, symlinks skipped: Apache-2.0, Artistic, BSD, CC0-1.0, GFDL-1.2/1.3, GPL-1/2/3, LGPL-2/2.1/3,
MPL-1.1/2.0), joined by blank lines; not the pydoc topics that eval_ppl measures perplexity on.
Where that directory is missing, the docstrings of a fixed list of standard-library modules are
used instead, and the script says so.

The draft is saved with the target's tokenizer as an orbax checkpoint (models/orbax_io.py,
written to a temporary sibling directory and renamed), which `--draft_model` loads.

Cost: a 4-layer SmolLM2 draft (200 steps of 4 x 128 tokens) trains in minutes on a CPU, most of
it the output head and softmax over the 49152-token vocabulary, for target and draft.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from tqdm import tqdm

from engine.step_batch import make_step_batch
from models.kv_cache import init_kv_cache
from models.llama import AttentionMetadata, forward
from models.orbax_io import save_checkpoint
from models.weights import model_from_pure_dict
from ops.backends import device_kernels
from ops.kernel_choice import KernelBackends
from quant.loader import load_model
from scripts import common

common.define_model_flags()
flags.DEFINE_integer("num_layers", 4, "Decoder layers of the draft.")
flags.DEFINE_enum("init_layers", "spaced", ["spaced", "first"],
                  "Which target layers the draft starts from: evenly spaced, or the first ones.")
flags.DEFINE_string("text_file", None,
                    "UTF-8 training text (default: the Debian license texts, see above).")
flags.DEFINE_integer("num_tokens", 60000, "Use at most this many tokens of the text.")
flags.DEFINE_integer("seq_len", 128, "Tokens per training row.")
flags.DEFINE_integer("batch_size", 4, "Rows per training step.")
flags.DEFINE_integer("steps", 200, "Training steps.")
flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate (after 10% warm-up; cosine decay).")
flags.DEFINE_float("weight_decay", 0.0, "adamw weight decay.")
flags.DEFINE_bool("train_embedding", False, "Also train the token embedding (and tied head).")
flags.DEFINE_integer("eval_rows", 8, "Rows of seq_len tokens held out at the end of the text.")
flags.DEFINE_string("output", None, "Orbax checkpoint directory to write the draft to.")
flags.DEFINE_bool("overwrite", False, "Replace --output if it exists.")
flags.DEFINE_string("json_out", None, "Also write the figures as JSON here.")
FLAGS = flags.FLAGS

LICENSE_DIR = "/usr/share/common-licenses"
FALLBACK_MODULES = ("argparse", "collections", "dataclasses", "functools", "itertools", "json",
                    "logging", "os", "pathlib", "re", "string", "subprocess", "textwrap",
                    "typing", "unittest")


def default_text() -> tuple[str, str]:
    """(text, description): the Debian license texts, or stdlib docstrings if they are missing."""
    if os.path.isdir(LICENSE_DIR):
        names = sorted(n for n in os.listdir(LICENSE_DIR)
                       if os.path.isfile(os.path.join(LICENSE_DIR, n))
                       and not os.path.islink(os.path.join(LICENSE_DIR, n)))
        if names:
            texts = []
            for name in names:
                with open(os.path.join(LICENSE_DIR, name), encoding="utf-8",
                          errors="replace") as f:
                    texts.append(f.read())
            return "\n\n".join(texts), f"{LICENSE_DIR} ({len(names)} files)"
    docs = []
    for name in FALLBACK_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for _, member in sorted(vars(module).items()):
            if inspect.isclass(member) or inspect.isfunction(member):
                docs.append(inspect.getdoc(member) or "")
    print(f"note: {LICENSE_DIR} is missing; training on standard-library docstrings instead",
          file=sys.stderr)
    return "\n\n".join(d for d in docs if d), "standard-library docstrings"


def draft_layer_indices(num_target: int, num_draft: int, how: str) -> list[int]:
    """Which target layers initialize the draft's layers."""
    if not 1 <= num_draft <= num_target:
        raise ValueError(f"--num_layers must be in [1, {num_target}] (the target's layers), "
                         f"got {num_draft}")
    if how == "first" or num_draft == 1:
        return list(range(num_draft))
    return [round(i * (num_target - 1) / (num_draft - 1)) for i in range(num_draft)]


def init_draft(cfg, model, layers: list[int]):
    """(draft config, draft model): the target's embedding, head and norm, and `layers`."""
    pure = nnx.to_pure_dict(nnx.state(model))
    draft_cfg = cfg.replace(num_layers=len(layers), name=f"{cfg.name}-draft{len(layers)}")
    draft = {key: value for key, value in pure.items() if key != "layers"}
    draft["layers"] = {i: pure["layers"][src] for i, src in enumerate(layers)}
    dtype = jax.tree.leaves(pure)[0].dtype
    return draft_cfg, model_from_pure_dict(draft_cfg, draft, dtype)


def rows_logits_fn(cfg, batch: int, seq_len: int, dtype, page_size: int = 16,
                   kernels: KernelBackends | None = None):
    """f(model, tokens int32 [batch, seq_len]) -> logits float32 [batch, seq_len, V]: one prefill
    of every row through `models.llama.forward` in a fresh paged cache, with `kernels` (None:
    the jnp reference, which is differentiable; the Pallas kernels have no gradient)."""
    pages_per_row = -(-seq_len // page_size)
    rows = [([0] * seq_len, 0, list(range(b * pages_per_row, (b + 1) * pages_per_row)))
            for b in range(batch)]
    step = make_step_batch(rows, page_size)
    meta = AttentionMetadata(
        positions=jnp.asarray(step.positions), slot_mapping=jnp.asarray(step.slot_mapping),
        block_tables=jnp.asarray(step.block_tables),
        query_start_loc=jnp.asarray(step.query_start_loc), kv_lens=jnp.asarray(step.kv_lens),
        max_q_len=seq_len, max_prefill_seqs=batch)

    def logits_of(model, tokens):
        cache = init_kv_cache(cfg, batch * pages_per_row, page_size, dtype)
        logits, _ = forward(model, cache, tokens.reshape(-1), meta, cfg, kernels=kernels)
        return logits.reshape(batch, seq_len, -1)  # [B, T, V]

    return logits_of


def kl_per_token(teacher_logits, draft_logits):
    """KL(p || q) per token [B, T] of logits [B, T, V], with one exponential per logit of each:
    KL = lse(q) - lse(p) - sum_v p_v (q_v - p_v) over logits (lse: log-sum-exp)."""
    p = jax.nn.softmax(teacher_logits, axis=-1)
    return (jax.nn.logsumexp(draft_logits, axis=-1) - jax.nn.logsumexp(teacher_logits, axis=-1)
            - jnp.sum(p * (draft_logits - teacher_logits), axis=-1))


def distribution_gaps(teacher_logits, draft_logits):
    """Per-token KL(p || q), top-1 agreement and overlap sum(min(p, q)), each [B, T]."""
    p = jax.nn.softmax(teacher_logits, axis=-1)
    q = jax.nn.softmax(draft_logits, axis=-1)
    agree = (jnp.argmax(teacher_logits, -1) == jnp.argmax(draft_logits, -1)).astype(jnp.float32)
    return kl_per_token(teacher_logits, draft_logits), agree, jnp.sum(jnp.minimum(p, q), -1)


def text_rows(ids: np.ndarray, seq_len: int, eval_rows: int):
    """(training token stream, held-out rows [eval_rows, seq_len]) of a token id array."""
    held_out = eval_rows * seq_len
    if len(ids) < held_out + 2 * seq_len:
        raise ValueError(f"the text has {len(ids)} tokens: need at least "
                         f"{held_out + 2 * seq_len} for {eval_rows} held-out rows of {seq_len} "
                         f"tokens and some to train on (lower --eval_rows or --seq_len)")
    return ids[: len(ids) - held_out], ids[len(ids) - held_out:].reshape(eval_rows, seq_len)


def distill(cfg, model, tokenizer, text: str):
    """Trains the draft; returns (draft cfg, draft model, figures dict)."""
    seed, steps, batch, seq_len = FLAGS.seed, FLAGS.steps, FLAGS.batch_size, FLAGS.seq_len
    if steps < 1 or batch < 1 or seq_len < 2 or FLAGS.eval_rows < batch:
        raise ValueError("--steps and --batch_size must be >= 1, --seq_len >= 2 and --eval_rows "
                         ">= --batch_size")
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--seq_len={seq_len} exceeds the model's context of "
                         f"{cfg.max_position_embeddings}")
    ids = np.asarray(tokenizer.encode(text)[: FLAGS.num_tokens], np.int32)
    train_ids, eval_ids = text_rows(ids, seq_len, FLAGS.eval_rows)
    layers = draft_layer_indices(cfg.num_layers, FLAGS.num_layers, FLAGS.init_layers)
    draft_cfg, draft = init_draft(cfg, model, layers)

    dtype = jax.tree.leaves(nnx.state(model))[0].dtype
    # the target (no gradient) runs this device's kernels; the draft, trained, the reference
    target_logits = rows_logits_fn(cfg, batch, seq_len, dtype, kernels=device_kernels())
    draft_logits = rows_logits_fn(draft_cfg, batch, seq_len, dtype)
    target_graph, target_state = nnx.split(model)
    trainable = nnx.Param if FLAGS.train_embedding else \
        nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed_tokens")))
    graph, params, rest = nnx.split(draft, trainable, ...)

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, FLAGS.learning_rate, max(1, steps // 10), max(steps, 2), FLAGS.learning_rate / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, weight_decay=FLAGS.weight_decay))
    opt_state = optimizer.init(params)

    def logits_pair(params, rest, target_state, tokens):
        p_logits = target_logits(nnx.merge(target_graph, target_state), tokens)
        return jax.lax.stop_gradient(p_logits), draft_logits(nnx.merge(graph, params, rest), tokens)

    def loss_fn(params, rest, target_state, tokens):
        return kl_per_token(*logits_pair(params, rest, target_state, tokens)).mean()

    @jax.jit
    def train_step(params, opt_state, rest, target_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, target_state, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_step(params, rest, target_state, tokens):
        return [g.mean() for g in distribution_gaps(*logits_pair(params, rest, target_state,
                                                                   tokens))]

    def evaluate(params):
        sums = np.zeros(3)
        for start in range(0, FLAGS.eval_rows - batch + 1, batch):
            gaps = eval_step(params, rest, target_state, jnp.asarray(eval_ids[start:start + batch]))
            sums += [float(g) for g in gaps]
        n = max(FLAGS.eval_rows // batch, 1)
        return {"kl": sums[0] / n, "top1_agreement": sums[1] / n, "overlap": sums[2] / n}

    rng = np.random.default_rng(seed)
    before = evaluate(params)
    print(f"draft: layers {layers} of the target's {cfg.num_layers}; {len(train_ids)} training "
          f"tokens, {FLAGS.eval_rows * seq_len} held out", file=sys.stderr)
    print(f"held-out before: KL {before['kl']:.4f}, top-1 agreement "
          f"{before['top1_agreement']:.1%}, overlap {before['overlap']:.1%}", file=sys.stderr)
    losses, start = [], time.perf_counter()
    progress = tqdm(range(steps), desc="distill", file=sys.stderr, mininterval=1.0)
    for _ in progress:
        offsets = rng.integers(0, len(train_ids) - seq_len + 1, batch)
        tokens = np.stack([train_ids[o:o + seq_len] for o in offsets])
        params, opt_state, loss = train_step(params, opt_state, rest, target_state,
                                             jnp.asarray(tokens))
        losses.append(float(loss))
        progress.set_postfix(loss=f"{losses[-1]:.4f}")
    train_s = time.perf_counter() - start
    after = evaluate(params)
    print(f"held-out after:  KL {after['kl']:.4f}, top-1 agreement "
          f"{after['top1_agreement']:.1%}, overlap {after['overlap']:.1%} "
          f"(training {train_s:.0f}s, {train_s / steps:.2f}s per step)", file=sys.stderr)
    figures = {"target_layers": layers, "train_tokens": int(len(train_ids)),
               "held_out_tokens": FLAGS.eval_rows * seq_len, "steps": steps,
               "batch_size": batch, "seq_len": seq_len, "learning_rate": FLAGS.learning_rate,
               "before": before, "after": after, "losses": losses, "seconds": train_s}
    return draft_cfg, nnx.merge(graph, params, rest), figures


def main(argv):
    del argv
    common.setup_jax()
    try:
        if not FLAGS.output:
            raise ValueError("give --output, the directory to write the draft to")
        if os.path.exists(FLAGS.output) and not FLAGS.overwrite:
            raise FileExistsError(f"{FLAGS.output} exists (pass --overwrite to replace it)")
        if FLAGS.text_file:
            with open(FLAGS.text_file, encoding="utf-8") as f:
                text, source = f.read(), FLAGS.text_file
        else:
            text, source = default_text()
        loaded = load_model(FLAGS.model, common.resolve_dtype(FLAGS.dtype), FLAGS.random_weights,
                            FLAGS.seed)
        if loaded.tokenizer is None:
            raise ValueError(f"model {FLAGS.model!r} has no tokenizer: the draft needs the "
                             "target's tokenizer to be saved with it")
        print(f"text: {source}", file=sys.stderr)
        draft_cfg, draft, figures = distill(loaded.cfg, loaded.model, loaded.tokenizer, text)
        save_checkpoint(FLAGS.output, draft_cfg, draft, loaded.tokenizer,
                        overwrite=FLAGS.overwrite)
    except common.USER_ERRORS as e:
        common.fail(str(e))
    print(f"saved the {draft_cfg.num_layers}-layer draft to {FLAGS.output}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"model": FLAGS.model, "text": source, "output": FLAGS.output} | figures,
                      f, indent=2)


if __name__ == "__main__":
    app.run(main)
