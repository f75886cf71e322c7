"""Speculative decoding: proposers, and verification by exact rejection sampling.

A speculating request proposes k tokens d_0..d_{k-1} after its last token; the target model
computes the k + 1 positions in one step, and `verify` keeps the longest prefix the target agrees
with plus one token of its own, so every step yields 1 to k + 1 tokens:

- greedy requests accept while d_i equals the target's argmax, then take the argmax;
- sampled requests accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), where p is the
  target's and q the proposer's distribution after the request's temperature / top-k / top-p /
  min-p; at the first rejection they sample from normalize(max(0, p - q)); when all k are accepted
  the bonus token comes from p_k (Leviathan et al. 2023; Chen et al. 2023). The output then has
  exactly the target's distribution. An n-gram proposal is a point mass: q_i(d_i) = 1.

Rejected tokens need no undoing: the engine advances num_computed_tokens only past accepted ones.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.sampling import filtered_logits
from engine.step_batch import MAX_SHORT_Q


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """method: 'ngram' or 'draft'; k: most tokens proposed per step; speculation stops for the
    step when more than max_batch sequences run (verification stops paying off there)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 16

    def __post_init__(self):
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens < MAX_SHORT_Q:
            raise ValueError(f"num_speculative_tokens must be 1 to {MAX_SHORT_Q - 1} (a "
                             f"verification step's program holds at most {MAX_SHORT_Q} tokens a "
                             f"sequence), got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({self.ngram_min}) <= ngram_max "
                             f"({self.ngram_max})")


def propose_ngram(token_ids: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Prompt lookup: match the last n tokens (n from ngram_max down to ngram_min) earlier in the
    sequence; propose up to k tokens that followed the latest earlier match."""
    tokens = np.asarray(token_ids)
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start:start + k].tolist()
    return []


@dataclasses.dataclass
class SpecStats:
    """Speculation counters: drafts (request-steps that proposed), drafted and accepted tokens,
    and accepted counts per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list = dataclasses.field(default_factory=list)
    drafted_per_position: list = dataclasses.field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for counts, upto in ((self.drafted_per_position, num_draft),
                             (self.accepted_per_position, num_accepted)):
            counts.extend([0] * (num_draft - len(counts)))
            for i in range(upto):
                counts[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step of a speculating request: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    def as_dict(self) -> dict:
        rates = [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        return {"drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "acceptance_per_position": rates,
                "mean_acceptance_length": self.mean_acceptance_length}


def _key(seed, step, stream):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)


@functools.partial(jax.jit, static_argnames=("all_greedy",))
def verify(target_logits: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array,
           draft_probs: jax.Array | None, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, min_p: jax.Array, seeds: jax.Array, steps: jax.Array,
           all_greedy: bool = False):
    """Accepts a prefix of each row's proposal and picks the next token.

    target_logits [S, K+1, V] float32: the target's logits at the row's last token and at each
    proposed token; draft_tokens int32 [S, K] (only the first num_draft[s] count); draft_probs
    [S, K, V] (the proposer's filtered distributions) or None for point-mass proposals;
    sampling arrays [S] as in engine.sampling.sample (temperature 0: greedy); steps: the output
    index of the row's next token.
    Returns (num_accepted int32 [S], tokens int32 [S, K+1]): the row's new tokens are
    tokens[s, :num_accepted[s] + 1] (accepted proposals, then the target's own token).
    Rows with num_draft 0 sample exactly like engine.sampling.sample with the same seed/step.
    all_greedy (static, chosen on the host rather than by a device-side cond, as in
    engine.sampling._sample): no row samples, so the greedy rule alone runs (no sort).
    """
    rows, k1, vocab = target_logits.shape
    k = k1 - 1
    greedy = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [S, K+1]
    is_draft = jnp.arange(k)[None, :] < num_draft[:, None]  # [S, K]
    safe_draft = jnp.clip(draft_tokens, 0, vocab - 1)

    if not all_greedy:
        return _verify_sampled(target_logits, greedy, safe_draft, is_draft, num_draft,
                               draft_probs, temperature, top_k, top_p, min_p, seeds, steps)
    ok = (safe_draft == greedy[:, :k]) & is_draft
    a = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)
    final = jnp.take_along_axis(greedy, a[:, None], axis=1)[:, 0]
    tokens = jnp.concatenate([safe_draft, jnp.zeros((rows, 1), jnp.int32)], axis=1)
    return a.astype(jnp.int32), tokens.at[jnp.arange(rows), a].set(final)


def _verify_sampled(target_logits, greedy, safe_draft, is_draft, num_draft, draft_probs,
                    temperature, top_k, top_p, min_p, seeds, steps):
    """`verify` for batches with sampled rows (greedy rows follow the greedy rule)."""
    rows, k1, vocab = target_logits.shape
    k = k1 - 1
    flat = target_logits.reshape(rows * k1, vocab)
    rep = lambda a: jnp.repeat(a, k1)  # noqa: E731  [S] -> [S*(K+1)]
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    cut = filtered_logits(flat, rep(safe_t), rep(top_k), rep(top_p), rep(min_p))
    p = jax.nn.softmax(cut, axis=-1).reshape(rows, k1, vocab)  # [S, K+1, V]
    p_draft = jnp.take_along_axis(p[:, :k], safe_draft[..., None], axis=-1)[..., 0]  # [S, K]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, safe_draft[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda s, t: jax.vmap(lambda i: jax.random.uniform(_key(s, t + i, 1)))(
        jnp.arange(k)))(seeds, steps)  # [S, K]
    sampled_ok = u < p_draft / jnp.maximum(q_draft, 1e-30)
    greedy_ok = safe_draft == greedy[:, :k]
    ok = jnp.where((temperature > 0)[:, None], sampled_ok, greedy_ok) & is_draft
    num_accepted = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)  # [S]
    # The target's own token at position a = num_accepted.
    a = num_accepted
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [S, V]
    rejected = a < num_draft
    d_a = jnp.take_along_axis(safe_draft, jnp.minimum(a, k - 1)[:, None], axis=1)[:, 0] \
        if k > 0 else jnp.zeros_like(a)
    if draft_probs is None:
        q_a = jax.nn.one_hot(d_a, vocab, dtype=p.dtype)
    else:
        q_a = jnp.take_along_axis(draft_probs, jnp.minimum(a, max(k - 1, 0))[:, None, None],
                                  axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_a)
    final_dist = jnp.where(rejected[:, None], residual, p_a)
    cut_a = jnp.take_along_axis(cut.reshape(rows, k1, vocab), a[:, None, None], axis=1)[:, 0]
    final_logits = jnp.where(rejected[:, None], jnp.log(final_dist), cut_a)
    final_sampled = jax.vmap(
        lambda s, t, row: jax.random.categorical(jax.random.fold_in(jax.random.key(s), t), row)
    )(seeds, steps + a, final_logits).astype(jnp.int32)
    final_greedy = jnp.take_along_axis(greedy, a[:, None], axis=1)[:, 0]
    final = jnp.where(temperature > 0, final_sampled, final_greedy)
    tokens = jnp.concatenate([safe_draft, jnp.zeros((rows, 1), jnp.int32)], axis=1)
    tokens = tokens.at[jnp.arange(rows), a].set(final)
    return num_accepted.astype(jnp.int32), tokens
