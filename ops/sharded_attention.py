"""The KV write and the step attention per shard, under jax.shard_map over the step's mesh.

When the sharded runner (engine/sharded_runner.py) builds its KernelBackends with its mesh and
traces its step inside `jax.set_mesh(mesh)`, ops.paged_attention.write_kv and step_attention
route here with their own per-shard function. Each device then runs the ordinary single-device
function (the Pallas kernel on GPU, the jnp reference elsewhere) on its own part:

    mesh axis `model`  the heads: q [N, H/tp, D] against pages [KVH/tp, P, S, D] (or all heads
                       on every shard when attention is replicated, see engine/sharding.py)
    mesh axis `data`   the sequences: each data shard holds its own N flat tokens, S sequences
                       and P pages, with block tables, slots and query offsets local to it

So the gather through the block tables never crosses devices, and attention needs no
communication. shard_map takes the mesh of the context (`jax.set_mesh`).
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from configs.mesh import DATA, EXPERT, MODEL
from ops.kv_quant import QuantizedPages


def head_axis(mesh_shape: dict[str, int], num_heads: int, num_kv_heads: int):
    """MODEL when both head counts split over the model axis, else None (replicated heads)."""
    tp = mesh_shape[MODEL]
    return MODEL if num_heads % tp == 0 and num_kv_heads % tp == 0 else None


def check_mesh(mesh_shape: dict[str, int]) -> None:
    """Raises ValueError unless the mesh has the axes DATA and MODEL (and at most EXPERT
    besides, over which attention is replicated)."""
    if not {DATA, MODEL} <= set(mesh_shape) <= {DATA, EXPERT, MODEL}:
        raise ValueError(f"sharded attention: mesh axes {tuple(mesh_shape)} must be "
                         f"({DATA!r}, {MODEL!r}) and optionally {EXPERT!r}")


def page_spec(pages, heads):
    """The partition spec of a layer's pages [KVH, P, S, D] (heads, data), or of QuantizedPages
    (the scales [KVH, P, S] split alike)."""
    spec = P(heads, DATA, None, None)
    if isinstance(pages, QuantizedPages):
        return QuantizedPages(spec, P(heads, DATA, None))
    return spec


def sharded_write_kv(mesh_shape: dict[str, int], write: Callable, k_pages, v_pages, k, v,
                     slot_mapping):
    """write(k_pages, v_pages, k, v, slot_mapping) per shard: k, v [N, KVH, D] split (data,
    heads); slots local to the data shard; pages float or QuantizedPages. `write` is the
    single-device write_kv."""
    check_mesh(mesh_shape)
    heads = head_axis(mesh_shape, k.shape[1], k.shape[1])
    pages = page_spec(k_pages, heads)
    fn = jax.shard_map(write, check_vma=False,
                       in_specs=(pages, pages, P(DATA, heads, None), P(DATA, heads, None),
                                 P(DATA)),
                       out_specs=(pages, pages))
    return fn(k_pages, v_pages, k, v, slot_mapping)


def sharded_step_attention(mesh_shape: dict[str, int], attend: Callable, q, k_pages, v_pages,
                           block_tables, query_start_loc, kv_lens):
    """attend(q, k_pages, v_pages, block_tables, query_start_loc, kv_lens) per shard (the
    single-device step_attention; arguments laid out per data shard: see module doc)."""
    check_mesh(mesh_shape)
    heads = head_axis(mesh_shape, q.shape[1], k_pages.shape[0])
    pages = page_spec(k_pages, heads)
    fn = jax.shard_map(attend, check_vma=False,
                       in_specs=(P(DATA, heads, None), pages, pages, P(DATA, None), P(DATA),
                                 P(DATA)),
                       out_specs=P(DATA, heads, None))
    return fn(q, k_pages, v_pages, block_tables, query_start_loc, kv_lens)
