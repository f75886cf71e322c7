"""Draft-model proposer for speculative decoding.

The draft is any smaller model with the target's tokenizer. It has its own paged KV cache of the
same number and size of pages and the same --kv_cache_dtype, indexed by the same block tables as
the target (a request's pages hold the target's K/V in the target's cache and the draft's in the
draft's). Each engine step it runs, for all speculating requests at once: one ragged catch-up
step over the tokens its cache lacks (the newest token, plus any accepted since: at most k + 1; a
request new to speculation first catches up on its prompt, one chunk of the step's token budget
an engine step, proposing nothing until it has), then k - 1 single-token steps, sampling each
proposal from its own filtered distribution q (greedy for greedy requests). Every program it runs
compiles at the engine's warm-up (`warmup`). `num_draft_computed` of a request counts the tokens
in the draft cache; after verification it is cut back to the accepted prefix, which is the
draft's whole rollback.
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

    def propose(self, requests: list, k: int, verify_len: int, budget: int):
        """Proposes up to request.lookahead tokens for each request (k = the largest), catching
        up first on the tokens its cache lacks: at most verify_len tokens a sequence in the step
        that proposes (the target's verification steps' length), any before them in one step of
        at most `budget` tokens (`catch_up`). A request still further behind (a prompt longer
        than the budget, caught up over several engine steps) proposes nothing this step.

        Returns (proposals: a token list per request, empty for one behind; q: device float32
        [bucket(P), K, V] over the P proposing requests in order, K = verify_len - 1, each row's
        first k entries its proposals' distributions; None when none proposes).
        """
        behind = self.catch_up(requests, verify_len, budget)
        proposing = [r for r, late in zip(requests, behind) if not late]
        if not proposing:
            return [[] for _ in requests], None
        rows = []
        for r in proposing:
            first = min(r.num_draft_computed, r.num_tokens - 1)
            rows.append((r.token_ids[first:], first, r.pages))
        arrays = SamplingArrays.from_requests(proposing)
        num = len(proposing)
        padded = arrays.padded(bucket(num))
        tokens_so_far, probs = [], []
        batch = make_step_batch(rows, self.page_size)
        # A short multi-token step like a verification: keyed by (S, W, q), not padded to
        # max_seqs (engine.step_batch.bucket_key).
        batch.verify_len = verify_len
        for i in range(k):
            logits = self.runner.execute_padded(batch)  # [bucket(num), V]
            token, q = draft_sample(logits, padded.temperature, padded.top_k, padded.top_p,
                                    padded.min_p, padded.seeds, padded.steps + i)
            tokens_so_far.append(token)
            probs.append(q)
            if i + 1 < k:
                host = np.asarray(token)[:num]
                batch = make_step_batch(
                    [([int(host[j])], r.num_tokens + i, r.pages) for j, r in enumerate(proposing)],
                    self.page_size)
        proposals = np.stack([np.asarray(t)[:num] for t in tokens_so_far], axis=1)  # [P, k]
        for r in proposing:
            r.num_draft_computed = r.num_tokens + k - 1
        # K entries whatever k (the last repeated; only the first num_draft are read): one
        # stacking program per row count
        probs += probs[-1:] * (verify_len - 1 - k)
        rows_of_proposing = iter(proposals.tolist())
        return ([[] if late else next(rows_of_proposing)[: r.lookahead]
                 for r, late in zip(requests, behind)], stack_probs(tuple(probs)))

    def catch_up(self, requests: list, verify_len: int, budget: int) -> list[bool]:
        """Computes draft K/V toward each request's last verify_len tokens in one step of at
        most `budget` tokens (as the target's chunked prefill: bounded memory and time, and the
        target's prefill programs' shapes). Returns whether each request is still behind: a
        request new to speculation has its whole prompt to catch up on, over as many engine
        steps as its length needs, so that no step stalls the others for a long prompt."""
        rows, used = [], 0
        for r in requests:
            first = min(r.num_draft_computed, r.num_tokens - 1)
            take = min(r.num_tokens - verify_len - first, budget - used)
            if take > 0:
                rows.append((r.token_ids[first: first + take], first, r.pages))
                r.num_draft_computed, used = first + take, used + take
        if rows:
            self.runner.execute_padded(make_step_batch(rows, self.page_size))
        return [min(r.num_draft_computed, r.num_tokens - 1) < r.num_tokens - verify_len
                for r in requests]

    def warmup(self, q_lens, num_pages: int, verification: bool, num_proposed: int) -> None:
        """Compiles the draft's step of q_lens tokens a sequence (the logits of each one's last
        token: `execute_padded`) and, for a verification-shaped catch-up, the proposals'
        sampling and stacking over its rows (num_proposed = K), as ModelRunner.warmup does."""
        self.runner.warmup(q_lens, num_pages, verification, last_logits=True)
        if not verification:
            return
        rows, vocab = bucket(len(q_lens)), self.cfg.vocab_size
        logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
        arrays = SamplingArrays.defaults(rows)
        draft_sample.lower(logits, arrays.temperature, arrays.top_k, arrays.top_p,
                           arrays.min_p, arrays.seeds, arrays.steps).compile()
        stack_probs.lower((logits,) * num_proposed).compile()


@jax.jit
def stack_probs(probs: tuple) -> jax.Array:
    """[S, K, V] of K distributions [S, V]."""
    return jnp.stack(probs, axis=1)
