"""How the engine's own arrays are split over the (data, model) mesh: the KV cache and the
step inputs. The weights' partition rules are models/sharding.py.

The KV cache's pages [KVH, P, S, D] (and an int8 / fp8 cache's scales [KVH, P, S]) split by
heads over `model` when attention splits (the attention layout of
models.sharding.attention_plan), and by pages over `data`: each data shard owns a range of pages
(engine/sharded_pool.py). Step inputs are replicated.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.mesh import DATA, MODEL, mesh_shape
from configs.model import ModelConfig
from models.kv_cache import KVCache, init_kv_cache
from models.sharding import attention_plan, runtime_config
from ops.kv_quant import is_quantized_kv_dtype


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


def kv_scales_spec(run_cfg: ModelConfig, tp: int) -> P:
    """Scales [KVH, P, S] of int8 / fp8 pages: split as their pages."""
    return P(*kv_cache_spec(run_cfg, tp)[:3])


def init_sharded_kv_cache(run_cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                          mesh) -> KVCache:
    """A zero cache of num_pages pages per data shard, created in place on its shards (int8 /
    fp8 pages with their float32 scales, split alike)."""
    tp, dp = mesh_shape(mesh)
    pages = NamedSharding(mesh, kv_cache_spec(run_cfg, tp))
    scales = NamedSharding(mesh, kv_scales_spec(run_cfg, tp))
    layers = (pages,) * run_cfg.num_layers
    shardings = KVCache(layers, layers, *(((scales,) * run_cfg.num_layers,) * 2
                                          if is_quantized_kv_dtype(dtype) else ()))
    return jax.jit(lambda: init_kv_cache(run_cfg, num_pages * dp, page_size, dtype),
                   out_shardings=shardings)()


def replicated(mesh):
    return NamedSharding(mesh, P())
