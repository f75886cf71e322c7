"""The decoder layers run by a scan: one traced and compiled layer body for every layer.

A jitted step traces every unrolled decoder layer apart, so its program grows, and compiles
slower, with the number of layers. `scan_layers` runs the layers with jax.lax.scan over the
layer index instead. The weights stay as they are, one module per layer: a loop body reading
weights stacked [num_layers, ...] would copy each layer's slice before its product (XLA on
the CPU materializes a dynamic slice that feeds a dot), which doubles a decode step's weight
traffic. Instead each product picks its layer's weight with jax.lax.switch, so the product
reads the layer's own buffer (`LayerChoice`); only the small vectors (norm weights, biases)
are stacked and sliced.

The KV cache of a scanned step keeps every layer's pages in one array (models/kv_cache.py,
`KVCache.stacked_layers`): [KVH, L * P, page_size, D], layer i's pages at [i * P, (i + 1) * P).
Layer i reads and writes through block tables and slots offset by i * P pages, so the scan
carries the whole cache and each layer's KV write is a scatter into it, in place. What differs
between layers (the sliding window, the RoPE frequencies of Gemma's local layers) goes in as
scanned data when it differs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from models.kv_cache import KVCache

# The window of a full-attention layer when windows are data: wider than any context.
FULL_WINDOW = 1 << 30


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """The weight of one product in every layer (values: one per layer, each an array or a
    quantized / transposed weight) and the scanned layer index; a Linear holding one runs its
    product with `apply`."""

    values: tuple
    index: jax.Array

    def apply(self, product: Callable):
        """product(layer index's value), as a switch over the layers: each branch multiplies
        by its own layer's weight, which is read where it lies (no copy)."""
        branches = [functools.partial(product, value) for value in self.values]
        return jax.lax.switch(self.index, branches)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_product_weight(path) -> bool:
    return str(path[-1]) == "['kernel']"


def layer_windows(cfg: ModelConfig) -> set:
    return {cfg.layer_window(i) for i in range(cfg.num_layers)}


def scannable(cfg: ModelConfig, layers, kernels) -> str | None:
    """None when `layers` (the model's per-layer modules) can run as one scanned body with
    `kernels`, else why not: the layers must share one structure (module tree, weight shapes
    and dtypes), the attention kernel must take a per-layer window as data when windows differ
    (the jnp reference does; the Pallas kernel's window is static), and transposed layers run
    fused kernels that read their weights directly."""
    if len(layers) < 2:
        return "fewer than two layers"
    if cfg.gemv_layers:
        return "the layers are transposed for the fused GEMV kernel"
    if cfg.is_moe:  # models/moe.py multiplies by its stacked experts, not through a Linear
        return "a mixture of experts' layers read their expert weights directly"
    if len(layer_windows(cfg)) > 1 and kernels is not None and kernels.attention != "reference":
        return "the layers' sliding windows differ and the attention kernel's window is static"
    graphdef, state = nnx.split(layers[0])
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    for i, layer in enumerate(layers):
        other_def, other = nnx.split(layer)
        if other_def != graphdef or jax.tree.map(lambda a: (a.shape, a.dtype), other) != shapes:
            return f"layer {i} differs from layer 0 in structure or weight shapes"
    return None


def _layer_data(num_layers: int, attention_of: Callable):
    """(static inverse frequencies or None, static window or None, scanned data): what differs
    between layers goes into the scanned data, what all share stays a constant."""
    per_layer = [attention_of(i) for i in range(num_layers)]
    freqs = [np.asarray(f, np.float32) for f, _ in per_layer]
    windows = [w for _, w in per_layer]
    data = {"index": jnp.arange(num_layers, dtype=jnp.int32)}
    inv_freq = freqs[0]
    if any(not np.array_equal(f, freqs[0]) for f in freqs):
        data["inv_freq"], inv_freq = jnp.asarray(np.stack(freqs)), None  # [L, D / 2]
    window = windows[0]
    if any(w != windows[0] for w in windows):
        data["window"] = jnp.asarray([FULL_WINDOW if w is None else w for w in windows],
                                     jnp.int32)  # [L]
        window = None
    return inv_freq, window, data


def scan_layers(layers, x: jax.Array, cache: KVCache, meta, cfg: ModelConfig, kernels,
                attention_of: Callable) -> tuple[jax.Array, KVCache]:
    """Runs the decoder layers (the model's per-layer modules, `scannable`) over hidden states
    x [N, hidden] with jax.lax.scan; returns (x after the last layer, the cache with this
    step's K/V written).

    cache: stacked (KVCache.stacked_layers == len(layers)). meta: the step's
    AttentionMetadata (block tables and slots of one layer's pages). attention_of(i): layer i's
    (inverse RoPE frequencies, sliding window or None), models.llama.layer_attention.
    """
    num_layers = len(layers)
    if cache.stacked_layers != num_layers:
        raise ValueError(f"scan_layers: the cache holds {len(cache.k_pages)} page arrays "
                         f"(stacked_layers={cache.stacked_layers}); {num_layers} scanned layers "
                         "need init_kv_cache(..., stacked=True)")
    inv_freq, window, data = _layer_data(num_layers, attention_of)
    graphdef = nnx.split(layers[0])[0]
    flat = [jax.tree_util.tree_flatten_with_path(nnx.state(layer), is_leaf=_is_variable)
            for layer in layers]
    treedef = flat[0][1]
    paths = [path for path, _ in flat[0][0]]
    per_layer = [[var for _, var in leaves] for leaves, _ in flat]  # [L][variables]
    # the small vectors (norm weights, biases), stacked [L, ...] and scanned
    data["small"] = {j: jnp.stack([per_layer[n][j].get_value() for n in range(num_layers)])
                     for j, path in enumerate(paths) if not _is_product_weight(path)}
    pages_per_layer, page_size = cache.num_pages, cache.page_size
    k_all, v_all = cache.stacked_pages()

    def body(carry, xs):
        h, k, v = carry
        i = xs["index"]
        variables = [
            var.replace(xs["small"][j] if j in xs["small"] else
                        LayerChoice(tuple(per_layer[n][j].get_value()
                                          for n in range(num_layers)), i))
            for j, var in enumerate(per_layer[0])]
        layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, variables))
        slots = meta.slot_mapping
        layer_meta = dataclasses.replace(
            meta, block_tables=meta.block_tables + i * pages_per_layer,
            slot_mapping=jnp.where(slots >= 0, slots + i * (pages_per_layer * page_size), -1))
        h, k, v = layer(h, k, v, layer_meta, cfg, xs.get("inv_freq", inv_freq), kernels,
                        xs.get("window", window))
        return (h, k, v), None

    (x, k_all, v_all), _ = jax.lax.scan(body, (x, k_all, v_all), data)
    return x, cache.with_stacked_pages(k_all, v_all)
