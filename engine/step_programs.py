"""The traced pieces of the runner's step programs (engine/runner.py), pure functions inside a
jitted program: a step's unpacked inputs, the tokens it reads from the previous step's samples,
and the device loop of a multi-step round with the sampling of each of its steps."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.sampling import sample_from_counts, sample_from_packed
from engine.step_inputs import StepLayout, unpack
from models.llama import AttentionMetadata, forward


def input_tokens(fields: dict, prev_samples: jax.Array) -> jax.Array:
    """A step's input token ids [N]: the host's, or prev_samples[sample_index] where the
    unpacked fields' sample_index is >= 0 (a token the previous step sampled, whose id the host
    has not read yet: asynchronous scheduling)."""
    index = fields["sample_index"]
    return jnp.where(index >= 0, prev_samples[jnp.maximum(index, 0)], fields["tokens"])


def step_fields(packed, layout: StepLayout, tables) -> dict:
    """The step's unpacked inputs (engine/step_inputs.py); with resident tables
    (layout.resident), block_tables [S, W] are the rows of the device's `tables` [R, W] that
    the packed inputs name."""
    x = unpack(packed, layout)
    if layout.resident:
        x["block_tables"] = tables[x["block_tables"]]  # [S] rows -> [S, W]
    return x


def draw_tokens(logits, floats, ints, draw: int | jax.Array, mode: str, counts=None,
                penalty_rows=None) -> tuple[jax.Array, jax.Array | None]:
    """(Each row's token, the count table): the argmax (mode 'greedy'), or drawn with draw
    index ints[2] + draw (engine.sampling.sample_from_packed); with a count table, from the
    penalized logits, each counted row's token added to the table
    (engine.sampling.sample_penalized's program; penalty_rows: its rows and strengths)."""
    draw = jnp.asarray(draw).astype(ints.dtype)
    if counts is not None:
        return sample_from_counts(logits, floats, ints.at[2].add(draw), counts, *penalty_rows,
                                  mode=mode)
    if mode == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    return sample_from_packed(logits, floats, ints.at[2].add(draw), mode=mode), None


def decode_loop(model, cfg, kernels, page_size: int, sample_rows: int, cache, first_tokens,
                positions, real, tables, floats, ints, counts, penalty_rows, num_steps: int,
                first_draw: int, mode: str, data_shards: int = 1):
    """`num_steps` decode steps of the S rows in one device loop: step i computes token
    first_tokens (then each step's samples) at positions + i, in the rows where `real` (the
    others compute nothing and write nowhere), and samples with draw index ints[2] +
    first_draw + i (`draw_tokens`). With data_shards > 1 the rows are that many shards' rows
    end to end (engine/sharded_runner.py), each shard's query starts counted from 0.
    Returns (tokens [num_steps, S], the last tokens [sample_rows] zero-padded, count table or
    None, cache)."""
    num_seqs = positions.shape[0]
    # one query token per row: [S + 1], or per shard [data_shards * (S / data_shards + 1)]
    start = jnp.tile(jnp.arange(num_seqs // data_shards + 1, dtype=jnp.int32), data_shards)
    rows = jnp.arange(num_seqs, dtype=jnp.int32)

    def body(i, carry):
        cache, tokens, out, counts = carry  # tokens [S], out [num_steps, S]
        pos = positions + i
        page_index = jnp.minimum(pos // page_size, tables.shape[1] - 1)
        page = jnp.take_along_axis(tables, page_index[:, None], axis=1)[:, 0]
        meta = AttentionMetadata(
            positions=pos, slot_mapping=jnp.where(real, page * page_size + pos % page_size, -1),
            block_tables=tables, query_start_loc=start,
            kv_lens=jnp.where(real, pos + 1, 0), max_q_len=1, max_prefill_seqs=0)
        logits, cache = forward(model, cache, tokens, meta, cfg, rows, kernels=kernels)
        tokens, counts = draw_tokens(logits, floats, ints, first_draw + i, mode, counts,
                                     penalty_rows)
        return cache, tokens, out.at[i].set(tokens), counts

    out = jnp.zeros((num_steps, num_seqs), jnp.int32)
    cache, last, out, counts = jax.lax.fori_loop(0, num_steps, body,
                                                 (cache, first_tokens, out, counts))
    return out, jnp.pad(last, (0, sample_rows - last.shape[0])), counts, cache
