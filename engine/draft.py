"""Draft-model proposer for speculative decoding.

The draft is any smaller model with the target's tokenizer. It has its own paged KV cache of the
same number and size of pages and the same --kv_cache_dtype, indexed by the same block tables as
the target (a request's pages hold the target's K/V in the target's cache and the draft's in the
draft's). Each engine step it
runs, for all speculating requests at once: one ragged catch-up step over the tokens its cache
lacks (the newest token, plus any accepted since), then k - 1 single-token steps, sampling each
proposal from its own filtered distribution q (greedy for greedy requests). `num_draft_computed`
of a request counts the tokens in the draft cache; after verification it is cut back to the
accepted prefix, which is the draft's whole rollback.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.runner import ModelRunner
from engine.step_batch import bucket, make_step_batch
from engine.sampling import SamplingArrays, filtered_logits
from ops.kernel_choice import KernelBackends


@functools.partial(jax.jit, static_argnames=())
def draft_sample(logits, temperature, top_k, top_p, min_p, seeds, steps):
    """Proposal tokens [S] and the distributions q [S, V] they were drawn from.

    Greedy rows (temperature 0) take the argmax; q is still their filtered softmax at
    temperature 1 (unused by greedy verification). Random stream 2 of the request's seed.
    """
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    cut = filtered_logits(logits, safe_t, top_k, top_p, min_p)
    probs = jax.nn.softmax(cut, axis=-1)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), 2)
        return jax.random.categorical(key, row).astype(jnp.int32)

    sampled = jax.vmap(draw)(seeds, steps, cut)
    tokens = jnp.where(temperature > 0, sampled, jnp.argmax(logits, -1).astype(jnp.int32))
    return tokens, probs


class DraftProposer:
    """Runs the draft model over the speculating requests of a step."""

    def __init__(self, cfg, model, num_pages: int, page_size: int, max_seqs: int,
                 max_width: int, *, kernels: KernelBackends, kv_dtype=None):
        """kernels: the target runner's choice (one device: no mesh), so that the draft runs
        the same kernels as the target without choosing again. kv_dtype: the draft cache's
        (as the target's: ops.kv_quant.kv_cache_dtype, None or 'auto' the draft's dtype)."""
        if kernels.mesh:
            raise ValueError("DraftProposer: the draft runs on one device; pass the target's "
                             "kernels.per_shard(), not a mesh choice")
        self.cfg = cfg
        self.runner = ModelRunner(cfg, model, num_pages, page_size, kv_dtype,
                                  max_seqs=max_seqs, max_width=max_width, kernels=kernels)
        self.page_size = page_size

    def propose(self, requests: list, k: int, verify_len: int):
        """Proposes up to request.lookahead tokens for each request (k = the largest), catching
        up first on at most verify_len tokens a sequence (the target's verification steps').

        Returns (proposals: list of token lists, q: device float32 [S, k, V]).
        """
        rows = []
        for r in requests:
            first = min(r.num_draft_computed, r.num_tokens - 1)
            rows.append((r.token_ids[first:], first, r.pages))
        arrays = SamplingArrays.from_requests(requests)
        num = len(requests)
        padded = arrays.padded(bucket(num))
        tokens_so_far, probs = [], []
        batch = make_step_batch(rows, self.page_size)
        # Catching up on the tokens verified last round (at most verify_len per sequence) is a
        # short multi-token step like a verification: keyed by (S, W, q), not padded to
        # max_seqs (engine.step_batch.bucket_key; a first, long catch-up over a whole prompt
        # still is).
        batch.verify_len = verify_len
        for i in range(k):
            # A long catch-up step pads the batch to the runner's max_seqs: keep bucket(num) rows.
            logits = self.runner.execute_padded(batch)[: bucket(num)]  # [bucket(num), V]
            steps = padded.steps + i
            token, q = draft_sample(logits, *(jnp.asarray(a) for a in (
                padded.temperature, padded.top_k, padded.top_p, padded.min_p, padded.seeds,
                steps)))
            tokens_so_far.append(token)
            probs.append(q[:num])
            if i + 1 < k:
                host = np.asarray(token)[:num]
                batch = make_step_batch(
                    [([int(host[j])], r.num_tokens + i, r.pages) for j, r in enumerate(requests)],
                    self.page_size)
        proposals = np.stack([np.asarray(t)[:num] for t in tokens_so_far], axis=1)  # [S, k]
        for r in requests:
            r.num_draft_computed = r.num_tokens + k - 1
        return [proposals[j, : r.lookahead].tolist() for j, r in enumerate(requests)], \
            jnp.stack(probs, axis=1)
