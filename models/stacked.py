"""The decoder layers as one layer of stacked weights, run by a scan: one traced layer body.

A jitted step traces every unrolled decoder layer apart, so its program grows, and compiles
slower, with the number of layers. `stack_layers` (the last step of models.prepare's
preparation, after loading, quantizing and fusing, which all see per-layer modules) replaces
`model.layers` by a `StackedLayers`: one DecoderLayer whose every weight has a leading
[num_layers] axis. `scan_layers` runs it with jax.lax.scan over the layers.

The KV cache of a scanned model keeps every layer's pages in one array (models/kv_cache.py,
`KVCache.stacked_layers`): [KVH, L * P, page_size, D], layer i's pages at [i * P, (i + 1) * P).
Layer i reads and writes through block tables and slots offset by i * P pages, so the scan
carries the whole cache and each layer's KV write is a scatter into it, in place: no layer's
pages are sliced out or copied. What differs between layers (the sliding window, the RoPE
frequencies of Gemma's local layers) goes in as scanned data when it differs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from models.kv_cache import KVCache

# The window of a full-attention layer when windows are data: wider than any context.
FULL_WINDOW = 1 << 30


class StackedLayers(nnx.Module):
    """num_layers decoder layers as one module whose weights are [num_layers, ...] stacks.

    Indexing or iterating gives per-layer modules with their own (copied) weights, for
    inspection; the step runs the stack with `scan_layers`.
    """

    def __init__(self, layer: nnx.Module, num_layers: int):
        self.layer = layer
        self.num_layers = num_layers

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, i: int) -> nnx.Module:
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"layer {i} of {self.num_layers}")
        graphdef, state = nnx.split(self.layer)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def __iter__(self):
        return (self[i] for i in range(self.num_layers))


def stackable(layers) -> str | None:
    """None when the layers share one structure (module tree, shapes, dtypes, static fields:
    they can be stacked), else why not."""
    if isinstance(layers, StackedLayers):
        return "the layers are stacked already"
    if len(layers) < 2:
        return "fewer than two layers"
    first = nnx.split(layers[0])
    first_shapes = jax.tree.map(lambda a: (a.shape, a.dtype), first[1])
    for i, layer in enumerate(layers):
        graphdef, state = nnx.split(layer)
        if graphdef != first[0] or jax.tree.map(lambda a: (a.shape, a.dtype),
                                                 state) != first_shapes:
            return f"layer {i} differs from layer 0 in structure or weight shapes"
    return None


def stack_layers(layers) -> StackedLayers:
    """A StackedLayers of the per-layer modules `layers` (an nnx.List of DecoderLayers of one
    structure; ValueError naming the difference otherwise). Each weight is stacked and its
    per-layer arrays dropped before the next, so memory grows by about one weight's stack.
    The caller replaces model.layers with the result; `layers` is emptied."""
    why = stackable(layers)
    if why is not None:
        raise ValueError(f"stack_layers: {why}")
    num_layers = len(layers)
    graphdef = nnx.split(layers[0])[0]
    states = [nnx.split(layer)[1] for layer in layers]
    treedef = jax.tree.structure(states[0])
    leaves = [jax.tree.leaves(s) for s in states]
    del states
    while len(layers):
        layers.pop()
    stacked = []
    for j in range(len(leaves[0])):
        stacked.append(jnp.stack([layer_leaves[j] for layer_leaves in leaves]))
        for layer_leaves in leaves:
            layer_leaves[j] = None
    layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, stacked))
    return StackedLayers(layer, num_layers)


def is_stacked(model) -> bool:
    """Whether `model`'s decoder layers are a StackedLayers (its cache must be stacked too)."""
    return isinstance(getattr(model, "layers", None), StackedLayers)


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


def scan_layers(layers: StackedLayers, x: jax.Array, cache: KVCache, meta, cfg: ModelConfig,
                kernels, attention_of: Callable) -> tuple[jax.Array, KVCache]:
    """Runs the stacked layers over hidden states x [N, hidden] with jax.lax.scan; returns
    (x after the last layer, the cache with this step's K/V written).

    cache: stacked (KVCache.stacked_layers == layers.num_layers). meta: the step's
    AttentionMetadata (block tables and slots of one layer's pages). attention_of(i): layer i's
    (inverse RoPE frequencies, sliding window or None), models.llama.layer_attention.
    """
    num_layers = layers.num_layers
    if cache.stacked_layers != num_layers:
        raise ValueError(f"scan_layers: the cache holds {len(cache.k_pages)} page arrays "
                         f"(stacked_layers={cache.stacked_layers}); a stacked model of "
                         f"{num_layers} layers needs init_kv_cache(..., stacked=True)")
    inv_freq, window, data = _layer_data(num_layers, attention_of)
    pages_per_layer, page_size = cache.num_pages, cache.page_size
    graphdef, state = nnx.split(layers.layer)
    k_all, v_all = cache.stacked_pages()

    def body(carry, xs):
        h, k, v = carry
        i = xs["index"]
        layer = nnx.merge(graphdef, xs["state"])
        slots = meta.slot_mapping
        layer_meta = dataclasses.replace(
            meta, block_tables=meta.block_tables + i * pages_per_layer,
            slot_mapping=jnp.where(slots >= 0, slots + i * (pages_per_layer * page_size), -1))
        h, k, v = layer(h, k, v, layer_meta, cfg, xs.get("inv_freq", inv_freq), kernels,
                        xs.get("window", window))
        return (h, k, v), None

    (x, k_all, v_all), _ = jax.lax.scan(body, (x, k_all, v_all), dict(data, state=state))
    return x, cache.with_stacked_pages(k_all, v_all)
