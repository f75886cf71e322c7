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
    page_size] float32 (empty tuples for a float cache).

    stacked_layers (static): 0 for one array per layer; L > 0 when one array holds the pages of
    all L layers, [num_kv_heads, L * num_pages, page_size, head_dim], layer i's at
    [i * num_pages, (i + 1) * num_pages) (the cache of a scanned step, models/layer_scan.py).
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    k_scales: tuple[jax.Array, ...] = ()
    v_scales: tuple[jax.Array, ...] = ()
    stacked_layers: int = dataclasses.field(default=0, metadata=dict(static=True))

    def __post_init__(self):
        if self.k_scales and len(self.k_scales) != len(self.k_pages):
            raise ValueError(f"KVCache: {len(self.k_scales)} scale arrays for "
                             f"{len(self.k_pages)} layers")
        if self.stacked_layers and len(self.k_pages) != 1:
            raise ValueError(f"KVCache: a stacked cache holds one page array, not "
                             f"{len(self.k_pages)}")

    @property
    def num_layers(self) -> int:
        return self.stacked_layers or len(self.k_pages)

    @property
    def num_pages(self) -> int:
        """Pages per layer."""
        return self.k_pages[0].shape[1] // max(self.stacked_layers, 1)

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
        cache (what the model's attention and KV write take). Of a stacked cache: a slice."""
        if self.stacked_layers:
            if not 0 <= i < self.stacked_layers:
                raise IndexError(f"KVCache.layer({i}) of {self.stacked_layers} layers")
            pages = slice(i * self.num_pages, (i + 1) * self.num_pages)
            return tuple(jax.tree.map(lambda a: a[:, pages], p) for p in self.stacked_pages())
        if not self.quantized:
            return self.k_pages[i], self.v_pages[i]
        return (QuantizedPages(self.k_pages[i], self.k_scales[i]),
                QuantizedPages(self.v_pages[i], self.v_scales[i]))

    def stacked_pages(self):
        """(keys, values) of a stacked cache, every layer's pages in one array each: float
        arrays or QuantizedPages."""
        if not self.stacked_layers:
            raise ValueError("KVCache.stacked_pages: the cache holds one array per layer")
        if not self.quantized:
            return self.k_pages[0], self.v_pages[0]
        return (QuantizedPages(self.k_pages[0], self.k_scales[0]),
                QuantizedPages(self.v_pages[0], self.v_scales[0]))

    def with_stacked_pages(self, keys, values) -> "KVCache":
        """This stacked cache with its page arrays replaced (as `stacked_pages` returns them)."""
        return KVCache.from_stacked(keys, values, self.stacked_layers)

    @classmethod
    def from_stacked(cls, keys, values, num_layers: int) -> "KVCache":
        """The stacked cache of num_layers layers whose pages are keys, values [KVH,
        num_layers * P, S, D] (float arrays or QuantizedPages)."""
        if not isinstance(keys, QuantizedPages):
            return cls((keys,), (values,), stacked_layers=num_layers)
        return cls((keys.values,), (values.values,), (keys.scales,), (values.scales,),
                   stacked_layers=num_layers)

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
                  sharding=None, stacked: bool = False) -> KVCache:
    """Allocates a cache of `num_pages` pages of `page_size` tokens for every layer (zeros);
    int8 / float8_e4m3fn pages come with their float32 scales. stacked: one page array for all
    layers (KVCache.stacked_layers; the cache of a scanned step, models/layer_scan.py)."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
    if stacked:
        shape = (cfg.num_kv_heads, cfg.num_layers * num_pages, page_size, cfg.head_dim)
        keys, values = zero_pages(shape, dtype, sharding), zero_pages(shape, dtype, sharding)
        return KVCache.from_stacked(keys, values, cfg.num_layers)
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

    def pages():
        return [zero_pages(shape, dtype, sharding) for _ in range(cfg.num_layers)]

    return KVCache.from_layers(pages(), pages())
