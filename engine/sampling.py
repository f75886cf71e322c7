"""Batched token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Each row's randomness comes only from its own (seed, step) pair, so a seeded request draws the
same tokens whatever else is in the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with the top-k and top-p cuts applied (-inf outside).

    logits [B, V] float32; temperature [B] (> 0); top_k int32 [B] (0 = off); top_p [B] in (0, 1].
    Rows keep at least their most likely token.
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [B]
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    # Nucleus: keep the smallest prefix of the sorted tokens whose mass reaches top_p.
    sorted_top_k = jnp.where(sorted_desc >= kth_value, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_top_k, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    # top_p >= 1 is no cut: in float32 the mass before a far tail token rounds to 1.0.
    keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    num_keep = jnp.maximum(keep_sorted.sum(-1), 1)  # [B]
    pth_value = jnp.take_along_axis(sorted_top_k, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, pth_value)  # [B, 1]
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


@jax.jit
def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """Picks one token per row.

    logits [B, V] float32; temperature float32 [B] (0 = greedy); top_k int32 [B]; top_p float32
    [B]; seeds uint32 [B]; steps int32 [B] (the index of the token being sampled in its request).
    Returns int32 [B].
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
    cut = filtered_logits(logits, safe_temperature, top_k, top_p)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row).astype(jnp.int32)

    sampled = jax.vmap(draw)(seeds, steps, cut)
    return jnp.where(temperature > 0, sampled, greedy)
