"""The paged KV cache: a pytree of device arrays, one pair of page arrays per layer.

Pages are allocated on the host (engine/block_pool.py); on the device the cache is only
storage, written in place at the slot mapping by the jitted steps, which donate it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from configs.model import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer key and value pages, each [num_kv_heads, num_pages, page_size, head_dim]."""

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[2]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k_pages + self.v_pages)


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32,
                  sharding=None) -> KVCache:
    """Allocates a cache of `num_pages` pages of `page_size` tokens for every layer (zeros)."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

    def pages():
        return tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.num_layers))

    return KVCache(k_pages=pages(), v_pages=pages())
