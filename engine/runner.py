"""The model runner: the only place that calls jax.jit, donates the cache and pads to buckets.

A step batch is rectangular: B sequences, each computing T consecutive tokens (T = 1 for decode,
a prompt or chunk for prefill), over block tables W pages wide. B, T and W are each padded up
to a power-of-two bucket, so the number of compiled programs stays small:
len(batch buckets) x len(token buckets) x len(page buckets) at most, and in practice one per
distinct (B, T, W) bucket triple that traffic reaches.
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from engine.kv_cache import KVCache, init_kv_cache
from engine.sampling import sample
from models.llama import AttentionMetadata, LlamaForCausalLM, forward


@dataclasses.dataclass
class StepBatch:
    """One step's inputs, host numpy, unpadded (all int32).

    token_ids [B, T], positions [B, T], slot_mapping [B, T] (-1 for rows shorter than T),
    block_tables [B, W], kv_lens [B], logits_indices [B] (index in T of each row's last token).
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    kv_lens: np.ndarray
    logits_indices: np.ndarray


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def _pad(a: np.ndarray, shape: tuple[int, ...], value: int) -> np.ndarray:
    out = np.full(shape, value, dtype=np.int32)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


class ModelRunner:
    """Owns the weights and the KV cache on the device, and the jitted step and sampler."""

    def __init__(self, cfg: ModelConfig, model: LlamaForCausalLM, num_pages: int,
                 page_size: int, kv_dtype=None):
        self.cfg = cfg
        self.graphdef, self.state = nnx.split(model)
        kv_dtype = kv_dtype or jax.tree.leaves(self.state)[0].dtype
        self.cache: KVCache = init_kv_cache(cfg, num_pages, page_size, kv_dtype)
        self.page_size = page_size
        self.compiled_shapes: set[tuple] = set()
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=("all_logits",))

    def _step_impl(self, state, cache, tokens, meta, logits_indices, all_logits=False):
        model = nnx.merge(self.graphdef, state)
        return forward(model, cache, tokens, meta, self.cfg,
                       None if all_logits else logits_indices)

    def _padded(self, batch: StepBatch, min_tokens: int):
        b, t = batch.token_ids.shape
        bp, tp = bucket(b), (1 if t == 1 else bucket(t, min_tokens))
        wp = bucket(batch.block_tables.shape[1], 4)
        self.compiled_shapes.add((bp, tp, wp))
        meta = AttentionMetadata(
            positions=jnp.asarray(_pad(batch.positions, (bp, tp), 0)),
            slot_mapping=jnp.asarray(_pad(batch.slot_mapping, (bp, tp), -1)),
            block_tables=jnp.asarray(_pad(batch.block_tables, (bp, wp), 0)),
            kv_lens=jnp.asarray(_pad(batch.kv_lens, (bp,), 0)))
        tokens = jnp.asarray(_pad(batch.token_ids, (bp, tp), 0))
        return tokens, meta, jnp.asarray(_pad(batch.logits_indices, (bp,), 0))

    def execute(self, batch: StepBatch, min_tokens: int = 16) -> jax.Array:
        """Runs one step; returns the last-token logits, float32 [B, V] (on the device)."""
        tokens, meta, logits_indices = self._padded(batch, min_tokens)
        logits, self.cache = self._step(self.state, self.cache, tokens, meta, logits_indices)
        return logits[: batch.token_ids.shape[0]]

    def warmup(self, batch_size: int, num_tokens: int, num_pages: int) -> None:
        """Compiles the program of this bucket by running it on padding (nothing is written)."""
        dummy = StepBatch(token_ids=np.zeros((batch_size, num_tokens), np.int32),
                          positions=np.zeros((batch_size, num_tokens), np.int32),
                          slot_mapping=np.full((batch_size, num_tokens), -1, np.int32),
                          block_tables=np.zeros((batch_size, num_pages), np.int32),
                          kv_lens=np.zeros(batch_size, np.int32),
                          logits_indices=np.zeros(batch_size, np.int32))
        logits = self.execute(dummy)
        ones = np.ones(batch_size)
        self.sample(logits, ones, ones.astype(np.int32), ones, ones, ones)

    def execute_all_logits(self, batch: StepBatch) -> jax.Array:
        """Runs one step; returns logits of every token, float32 [B, T, V] (on the device)."""
        tokens, meta, logits_indices = self._padded(batch, 16)
        logits, self.cache = self._step(self.state, self.cache, tokens, meta, logits_indices,
                                        all_logits=True)
        b, t = batch.token_ids.shape
        return logits[:b, :t]

    def sample(self, logits: jax.Array, temperature: np.ndarray, top_k: np.ndarray,
               top_p: np.ndarray, seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Samples one token per row of `logits` [B, V]; returns host int32 [B]."""
        b = logits.shape[0]
        bp = bucket(b)
        logits = jnp.pad(logits, ((0, bp - b), (0, 0)))
        args = [jnp.asarray(np.pad(np.asarray(a, dtype), (0, bp - b)))
                for a, dtype in ((temperature, np.float32), (top_k, np.int32),
                                 (top_p, np.float32), (seeds, np.uint32), (steps, np.int32))]
        args[2] = jnp.where(jnp.arange(bp) < b, args[2], 1.0)  # padded rows: top_p = 1
        return np.asarray(sample(logits, *args))[:b]


def full_sequence_logits(cfg: ModelConfig, model: LlamaForCausalLM, token_ids: np.ndarray,
                         page_size: int = 16) -> np.ndarray:
    """Logits of every position of each row of token_ids [B, T], one prefill in a fresh cache.

    Returns float32 numpy [B, T, V]. Used by perplexity evaluation and numerics tests.
    """
    token_ids = np.asarray(token_ids, np.int32)
    batch, seq = token_ids.shape
    pages_per_row = -(-seq // page_size)
    runner = ModelRunner(cfg, model, batch * pages_per_row, page_size)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    tables = np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
    slots = tables[:, positions[0] // page_size] * page_size + positions % page_size
    step = StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slots,
                     block_tables=tables, kv_lens=np.full(batch, seq, np.int32),
                     logits_indices=np.full(batch, seq - 1, np.int32))
    return np.asarray(runner.execute_all_logits(step))
