"""How the engine's own arrays are split over the (data, model) mesh: the KV cache and the
step inputs. The weights' partition rules are models/sharding.py.

The KV cache's pages [KVH, P, S, D] split by heads over `model` when attention splits (the
attention layout of models.sharding.attention_plan), and by pages over `data`: each data shard
owns a range of pages (engine/sharded_pool.py). Step inputs are replicated.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.mesh import DATA, MODEL, mesh_shape
from configs.model import ModelConfig
from models.kv_cache import KVCache
from models.sharding import attention_plan, runtime_config


def kv_cache_spec(run_cfg: ModelConfig, tp: int) -> P:
    """Pages [KVH, P, S, D]: heads over `model` when attention splits, pages over `data`."""
    return P(MODEL if attention_plan(run_cfg, tp).shard_heads else None, DATA, None, None)


def kv_local_config(cfg: ModelConfig, mesh) -> ModelConfig:
    """A config whose KV heads are those one device stores (KV-cache sizing per device)."""
    if mesh is None:
        return cfg
    tp, _ = mesh_shape(mesh)
    run_cfg = runtime_config(cfg, tp)
    split = tp if attention_plan(run_cfg, tp).shard_heads else 1
    return run_cfg.replace(num_kv_heads=run_cfg.num_kv_heads // split)


def init_sharded_kv_cache(run_cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                          mesh) -> KVCache:
    """A zero cache of num_pages pages per data shard, created in place on its shards."""
    tp, dp = mesh_shape(mesh)
    shape = (run_cfg.num_kv_heads, num_pages * dp, page_size, run_cfg.head_dim)
    sharding = NamedSharding(mesh, kv_cache_spec(run_cfg, tp))

    def zeros():
        pages = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(run_cfg.num_layers))  # noqa
        return KVCache(pages(), pages())

    return jax.jit(zeros, out_shardings=sharding)()



def replicated(mesh):
    return NamedSharding(mesh, P())
