"""The paged KV cache: a pytree of device arrays, one pair of page arrays per layer.

Pages are allocated on the host (engine/block_pool.py); on the device the cache is only
storage, written in place at the slot mapping by the jitted steps, which donate it. A float
cache stores K/V in its dtype; an int8 / fp8 cache stores them in that type with one float32
scale per (head, token) (ops/kv_quant.py), which is about half the bytes of bf16.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from configs.model import ModelConfig
from ops.kv_quant import SCALE_DTYPE, QuantizedPages, is_quantized_kv_dtype, zero_pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer key and value pages, each [num_kv_heads, num_pages, page_size, head_dim], in
    the cache's dtype; for int8 / fp8 pages also per-layer scales [num_kv_heads, num_pages,
    page_size] float32 (empty tuples for a float cache)."""

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    k_scales: tuple[jax.Array, ...] = ()
    v_scales: tuple[jax.Array, ...] = ()

    def __post_init__(self):
        if self.k_scales and len(self.k_scales) != len(self.k_pages):
            raise ValueError(f"KVCache: {len(self.k_scales)} scale arrays for "
                             f"{len(self.k_pages)} layers")

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[2]

    @property
    def dtype(self):
        """The pages' storage dtype."""
        return self.k_pages[0].dtype

    @property
    def quantized(self) -> bool:
        return bool(self.k_scales)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k_pages + self.v_pages + self.k_scales + self.v_scales)

    def layer(self, i: int):
        """Layer i's (keys, values): float page arrays, or QuantizedPages of an int8 / fp8
        cache (what the model's attention and KV write take)."""
        if not self.quantized:
            return self.k_pages[i], self.v_pages[i]
        return (QuantizedPages(self.k_pages[i], self.k_scales[i]),
                QuantizedPages(self.v_pages[i], self.v_scales[i]))

    @classmethod
    def from_layers(cls, keys, values) -> "KVCache":
        """The cache of per-layer pages as `layer` returns them."""
        keys, values = tuple(keys), tuple(values)
        if not isinstance(keys[0], QuantizedPages):
            return cls(keys, values)
        return cls(tuple(k.values for k in keys), tuple(v.values for v in values),
                   tuple(k.scales for k in keys), tuple(v.scales for v in values))


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """Bytes of K and V that one token occupies across all layers, scales included."""
    per_head = cfg.head_dim * jnp.dtype(dtype).itemsize
    if is_quantized_kv_dtype(dtype):
        per_head += SCALE_DTYPE.itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32,
                  sharding=None) -> KVCache:
    """Allocates a cache of `num_pages` pages of `page_size` tokens for every layer (zeros);
    int8 / float8_e4m3fn pages come with their float32 scales."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

    def pages():
        return [zero_pages(shape, dtype, sharding) for _ in range(cfg.num_layers)]

    return KVCache.from_layers(pages(), pages())
