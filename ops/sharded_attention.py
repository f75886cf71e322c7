"""The KV write and the step attention per shard, under jax.shard_map over the step's mesh.

When the sharded runner (engine/sharded_runner.py) traces its step inside `jax.set_mesh(mesh)`,
ops.paged_attention.write_kv and step_attention route here. Each device then runs the ordinary
single-device function (the Pallas kernel on GPU, the jnp reference elsewhere) on its own part:

    mesh axis `model`  the heads: q [N, H/tp, D] against pages [KVH/tp, P, S, D] (or all heads
                       on every shard when attention is replicated, see engine/sharding.py)
    mesh axis `data`   the sequences: each data shard holds its own N flat tokens, S sequences
                       and P pages, with block tables, slots and query offsets local to it

So the gather through the block tables never crosses devices, and attention needs no
communication. Inside shard_map the mesh axes are manual, which is how the dispatch knows it is
already per shard.
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

DATA = "data"
MODEL = "model"


def active_mesh():
    """The abstract mesh to shard attention over, or None (no mesh, or already per shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.axis_names) != {DATA, MODEL} or mesh.manual_axes:
        return None
    return mesh


def head_axis(mesh, num_heads: int, num_kv_heads: int):
    """MODEL when both head counts split over the model axis, else None (replicated heads)."""
    tp = mesh.shape[MODEL]
    return MODEL if num_heads % tp == 0 and num_kv_heads % tp == 0 else None


def sharded_write_kv(mesh, k_pages, v_pages, k, v, slot_mapping, **options):
    """write_kv per shard: k, v [N, KVH, D] split (data, heads); slots local to the data shard.

    options: write_kv's static keyword options, passed to every shard.
    """
    from ops.paged_attention import write_kv

    heads = head_axis(mesh, k.shape[1], k.shape[1])
    pages = P(heads, DATA, None, None)
    fn = jax.shard_map(functools.partial(write_kv, **options), mesh=mesh, check_vma=False,
                       in_specs=(pages, pages, P(DATA, heads, None), P(DATA, heads, None),
                                 P(DATA)),
                       out_specs=(pages, pages))
    return fn(k_pages, v_pages, k, v, slot_mapping)


def sharded_step_attention(mesh, q, k_pages, v_pages, block_tables, query_start_loc, kv_lens,
                           *, max_q_len: int, max_prefill_seqs: int):
    """step_attention per shard (arguments as there, laid out per data shard: see module doc)."""
    from ops.paged_attention import step_attention

    heads = head_axis(mesh, q.shape[1], k_pages.shape[0])
    pages = P(heads, DATA, None, None)
    local = functools.partial(step_attention, max_q_len=max_q_len,
                              max_prefill_seqs=max_prefill_seqs)
    fn = jax.shard_map(local, mesh=mesh, check_vma=False,
                       in_specs=(P(DATA, heads, None), pages, pages, P(DATA, None), P(DATA),
                                 P(DATA)),
                       out_specs=P(DATA, heads, None))
    return fn(q, k_pages, v_pages, block_tables, query_start_loc, kv_lens)
