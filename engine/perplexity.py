"""Perplexity of a model on a token sequence, and the default evaluation text.

One forward pass of the whole sequence through the paged cache (`full_sequence_logits`, also the
numerics tests' reference); perplexity = exp(mean negative log-likelihood of each token given the ones
before it). scripts.eval_ppl and scripts.quant_report both measure with it.
"""
from __future__ import annotations

import math

import numpy as np
from pydoc_data.topics import topics

from configs.model import ModelConfig
from engine.runner import ModelRunner
from engine.step_batch import StepBatch
from models.llama import LlamaForCausalLM


def default_text() -> str:
    """The pydoc topics of the running CPython, joined in key order (ships with every CPython)."""
    return "\n\n".join(topics[k] for k in sorted(topics))


def perplexity_of_ids(cfg: ModelConfig, model, ids: list[int], page_size: int = 16,
                      kv_dtype=None) -> tuple[float, float]:
    """(perplexity, mean NLL) of `ids` under the model, in one forward pass through the cache."""
    n = len(ids)
    if n < 2:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {n}")
    if n > cfg.max_position_embeddings:
        raise ValueError(f"{n} tokens exceed the model's context of {cfg.max_position_embeddings}")
    logits = full_sequence_logits(cfg, model, np.asarray([ids]), page_size, kv_dtype)[0]
    logits = logits.astype(np.float64)  # [n, V]
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -log_probs[np.arange(n - 1), np.asarray(ids[1:])].mean()
    return math.exp(nll), float(nll)


def full_sequence_logits(cfg: ModelConfig, model: LlamaForCausalLM, token_ids: np.ndarray,
                         page_size: int = 16, kv_dtype=None) -> np.ndarray:
    """Logits of every position of each row of token_ids [B, T], one prefill in a fresh cache.

    Returns float32 numpy [B, T, V]. Used by perplexity evaluation and numerics tests.
    kv_dtype: the KV cache's dtype (ops.kv_quant.kv_cache_dtype: None or 'auto' the model's;
    'int8' / 'fp8' store quantized pages).
    """
    token_ids = np.asarray(token_ids, np.int32)
    batch, seq = token_ids.shape
    pages_per_row = -(-seq // page_size)
    runner = ModelRunner(cfg, model, batch * pages_per_row, page_size, kv_dtype)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    tables = np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
    slots = np.take_along_axis(tables, positions // page_size, axis=1) * page_size \
        + positions % page_size
    start = np.arange(0, batch * seq + 1, seq, dtype=np.int32)
    step = StepBatch(token_ids=token_ids.reshape(-1), positions=positions.reshape(-1),
                     slot_mapping=slots.reshape(-1), block_tables=tables, query_start_loc=start,
                     kv_lens=np.full(batch, seq, np.int32), logits_indices=start[1:] - 1)
    return np.asarray(runner.execute_all_logits(step)).reshape(batch, seq, -1)
