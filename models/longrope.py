"""Phi-3's LongRoPE in a paged KV cache, and how it compares with transformers (5.x).

transformers picks the factors per forward call from the sequence's length: the long ones where
it exceeds original_max_position_embeddings, else the short ones, for every token of the call.
Phi-3's generate also drops its KV cache at the step where the sequence first grows past that
length and recomputes the whole sequence, so its logits at every step are those of the whole
sequence so far computed with the factors that its length selects.

Here each step's tokens of a sequence take the long factors where the sequence's length after
the step (its kv_len) exceeds original_max_position_embeddings; keys and values in the cache
stay as they were computed. That equals transformers wherever no step before the last crosses
the length: a sequence that stays within it (short factors), and a prompt longer than it that
is prefilled in one step (long factors from the first token; a budget of
max_num_batched_tokens at least the prompt, or chunked prefill off). It differs where a prompt
longer than the length is prefilled in chunks (the chunks that end within it run short), and
from the step where a decode crosses the length (transformers recomputes the earlier tokens
with the long factors in every layer; here they keep their short-factor keys and values).
Rotating the cached keys on at the crossing would not close that gap: the deeper layers' keys
and values come from hidden states computed with the short factors. So that each request's
result depends only on its own tokens and the step budget, LLMEngine turns prefix caching off
for these models and refuses speculative decoding (a verification step's length would pick the
factors of the tokens it proposes).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from configs.model import RopeScaling
from ops.kernel_choice import KernelBackends
from ops.rope_kv import rope_and_write_kv


def uses_longrope(scaling: RopeScaling | None) -> bool:
    """Whether a model with this rope scaling runs LongRoPE (see the module doc)."""
    return scaling is not None and scaling.rope_type == "longrope"


def longrope_and_write_kv(qkv, meta, inv_freq: np.ndarray, k_pages, v_pages,
                          scaling: RopeScaling, num_heads: int,
                          kernels: KernelBackends | None = None, qk_norm: tuple | None = None):
    """ops.rope_kv.rope_and_write_kv under LongRoPE (module doc).

    meta: the step's models.llama.AttentionMetadata; inv_freq: [2, D / 2], the short and the long
    factors' frequencies (models.llama.rope_inv_freq). Two passes of rope_and_write_kv, each
    writing only its own tokens' keys and values. Returns (q [N, H, D], k_pages, v_pages).
    """
    original = scaling.original_max_position_embeddings
    n = meta.positions.shape[0]
    seq = jnp.searchsorted(meta.query_start_loc, jnp.arange(n, dtype=jnp.int32), side="right",
                           method="scan_unrolled")  # no while loop (a host round trip per step)
    seq = jnp.clip(seq - 1, 0, meta.kv_lens.shape[0] - 1)  # each token's sequence
    long = meta.kv_lens[seq] > original  # [N]
    rotated = []
    for freq, mine in ((inv_freq[0], ~long), (inv_freq[1], long)):
        slots = jnp.where(mine, meta.slot_mapping, -1)  # the other pass's tokens: not written
        q, k_pages, v_pages = rope_and_write_kv(qkv, meta.positions, freq, k_pages, v_pages,
                                                slots, num_heads=num_heads, qk_norm=qk_norm,
                                                kernels=kernels)
        rotated.append(q)
    return jnp.where(long[:, None, None], rotated[1], rotated[0]), k_pages, v_pages
