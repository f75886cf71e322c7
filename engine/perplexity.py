"""Perplexity of a model on a token sequence, and the default evaluation text.

One forward pass of the whole sequence through the paged cache (engine.runner's
full_sequence_logits); perplexity = exp(mean negative log-likelihood of each token given the ones
before it). scripts.eval_ppl and scripts.quant_report both measure with it.
"""
from __future__ import annotations

import math

import numpy as np
from pydoc_data.topics import topics

from configs.model import ModelConfig
from engine.runner import full_sequence_logits


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
