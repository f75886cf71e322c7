"""The partition rules, the mesh flags and the data-parallel page pool, in this process."""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs.model import (LLAMA31_8B, QWEN25_05B, SMOLLM2_135M, TINY_LLAMA, TINY_LLAMA31,
                           TINY_QWEN2)
from engine.mesh import make_mesh
from engine.sharded_pool import ShardedBlockPool
from engine.sharding import kv_local_config
from models.sharding import (attention_plan, partition_spec, path_names, repeat_kv_heads,
                             runtime_config)
from tests.sharding.scenarios import ROOT, device_env

M = "model"


@pytest.mark.parametrize("cfg,tp,shard_heads,kv_repeat", [
    (SMOLLM2_135M, 1, True, 1),
    (SMOLLM2_135M, 2, False, 1),  # 9 query heads
    (SMOLLM2_135M, 3, True, 1),  # 3 query and 1 KV head per shard
    (SMOLLM2_135M, 4, False, 1),
    (SMOLLM2_135M, 8, False, 1),
    (LLAMA31_8B, 8, True, 1),  # 4 query and 1 KV head per shard
    (LLAMA31_8B, 16, True, 2),  # 8 KV heads, each on 2 shards
    (LLAMA31_8B, 32, True, 4),
    (LLAMA31_8B, 64, False, 1),  # 32 query heads
    (QWEN25_05B, 2, True, 1),
    (QWEN25_05B, 7, False, 1),  # 2 KV heads neither divide nor are divided by 7
    (TINY_QWEN2, 4, True, 4),
])
def test_attention_plan(cfg, tp, shard_heads, kv_repeat):
    plan = attention_plan(cfg, tp)
    assert (plan.shard_heads, plan.kv_repeat) == (shard_heads, kv_repeat), plan.reason
    run_cfg = runtime_config(cfg, tp)
    assert run_cfg.num_kv_heads == cfg.num_kv_heads * kv_repeat
    if shard_heads:  # each shard's query heads read only the KV heads it holds
        assert run_cfg.num_kv_heads % tp == 0 and run_cfg.num_heads % tp == 0


def spec(names: str, shape, cfg=TINY_LLAMA31, tp=2):
    return partition_spec(tuple(names.split(".")), shape, cfg, tp)


def test_layer_specs_megatron_style():
    cfg = TINY_LLAMA31  # 8 heads, 2 KV heads of 8, hidden 64, MLP 160, vocab 256
    assert spec("embed_tokens.embedding", (256, 64)) == P(M, None)  # vocab-parallel
    assert spec("lm_head.kernel", (64, 256)) == P(None, M)
    assert spec("norm.weight", (64,)) == P()
    for name, shape in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (64, 16)),
                        ("self_attn.v_proj", (64, 16)), ("mlp.gate_proj", (64, 160)),
                        ("mlp.up_proj", (64, 160))):
        assert spec(f"layers.0.{name}.kernel", shape, cfg) == P(None, M), name
    assert spec("layers.1.self_attn.o_proj.kernel", (64, 64)) == P(M, None)
    assert spec("layers.1.mlp.down_proj.kernel", (160, 64)) == P(M, None)
    assert spec("layers.1.input_layernorm.weight", (64,)) == P()
    # tp=1: nothing splits.
    assert spec("layers.1.mlp.down_proj.kernel", (160, 64), cfg, 1) == P()


def test_replication_rule():
    # SmolLM2 at tp 4: attention whole on every shard; MLP and vocabulary split.
    smol = SMOLLM2_135M
    assert spec("layers.0.self_attn.q_proj.kernel", (576, 576), smol, 4) == P()
    assert spec("layers.0.self_attn.o_proj.kernel", (576, 576), smol, 4) == P()
    assert spec("layers.0.mlp.down_proj.kernel", (1536, 576), smol, 4) == P(M, None)
    assert spec("embed_tokens.embedding", (49152, 576), smol, 4) == P(M, None)
    # Stored KV heads fewer than tp: whole (then repeated at run time, split per head).
    assert spec("layers.0.self_attn.k_proj.kernel", (64, 16), TINY_LLAMA31, 4) == P()
    run_cfg = runtime_config(TINY_LLAMA31, 4)
    assert spec("layers.0.self_attn.k_proj.kernel", (64, 32), run_cfg, 4) == P(None, M)
    # An MLP or vocabulary that does not divide stays whole.
    odd = TINY_LLAMA.replace(intermediate_size=100, vocab_size=250)
    assert spec("layers.0.mlp.up_proj.kernel", (64, 100), odd, 8) == P()
    assert spec("embed_tokens.embedding", (250, 64), odd, 8) == P()


def test_quantized_arrays_follow_their_kernel():
    """Any 2-D array under a kernel (codes, scales, offsets) splits along the kernel's axis when
    its own dimension divides; the act-order permutation stays whole."""
    down = "layers.0.mlp.down_proj.kernel"  # row-parallel, K = 160
    assert spec(f"{down}.packed", (20, 64)) == P(M, None)  # int4: 8 rows per int32
    assert spec(f"{down}.scales", (5, 64)) == P(None, None)  # 5 groups do not split in 2
    assert spec(f"{down}.scales", (4, 64)) == P(M, None)
    assert spec(f"{down}.perm", (160,)) == P()
    up = "layers.0.mlp.up_proj.kernel"  # column-parallel: codes and scales split by columns
    assert spec(f"{up}.packed", (8, 160)) == P(None, M)
    assert spec(f"{up}.scales", (1, 160)) == P(None, M)
    assert spec(f"{up}.offsets", (2, 160)) == P(None, M)
    assert spec("layers.0.self_attn.q_proj.bias", (64,), TINY_QWEN2) == P(M)


def test_path_names_drop_variable_boxes():
    path = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey(0),
            jax.tree_util.GetAttrKey("value"), jax.tree_util.GetAttrKey("packed"))
    assert path_names(path) == ("layers", "0", "packed")


def test_repeated_kv_heads_serve_the_same_query_heads():
    cfg, tp = TINY_LLAMA31, 8  # 8 query heads, 2 KV heads of 8 dims -> 8 KV heads
    run_cfg = runtime_config(cfg, tp)
    repeat = run_cfg.num_kv_heads // cfg.num_kv_heads
    rng = np.random.default_rng(0)
    tree = {"layers": {"0": {"self_attn": {
        "k_proj": {"kernel": jnp.asarray(rng.standard_normal((64, 16)), jnp.float32),
                   "bias": jnp.asarray(rng.standard_normal(16), jnp.float32)},
        "q_proj": {"kernel": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)}}}}}
    out = repeat_kv_heads(tree, cfg, repeat)["layers"]["0"]["self_attn"]
    assert out["q_proj"]["kernel"] is tree["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    k, k_rep = np.asarray(tree["layers"]["0"]["self_attn"]["k_proj"]["kernel"]), \
        np.asarray(out["k_proj"]["kernel"])
    assert k_rep.shape == (64, 64)
    d = cfg.head_dim
    for h in range(cfg.num_heads):  # query head h reads the same keys before and after
        before = h // cfg.q_per_kv
        after = h // run_cfg.q_per_kv
        np.testing.assert_array_equal(k_rep[:, after * d:(after + 1) * d],
                                      k[:, before * d:(before + 1) * d])
    bias = np.asarray(out["k_proj"]["bias"]).reshape(run_cfg.num_kv_heads, d)
    np.testing.assert_array_equal(bias[::repeat], np.asarray(
        tree["layers"]["0"]["self_attn"]["k_proj"]["bias"]).reshape(2, d))


def test_kv_cache_sized_per_device():
    assert kv_local_config(TINY_LLAMA31, None) is TINY_LLAMA31
    mesh = make_mesh(1, 1)
    assert kv_local_config(TINY_LLAMA31, mesh).num_kv_heads == 2


def test_make_mesh_errors():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"tp=2 x dp={n} = {2 * n} devices does not divide "
                                         rf"the {n} devices"):
        make_mesh(2, n)
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        make_mesh(0, 1)
    assert dict(make_mesh(1, 1).shape) == {"data": 1, "expert": 1, "model": 1}


def test_generate_rejects_a_mesh_that_does_not_divide():
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.generate", "--prompt=hi", "--tp=3",
         "--compilation_cache_dir="], cwd=ROOT, env=device_env(8), capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 1
    assert ("error: tp=3 x dp=1 = 3 devices does not divide the 8 devices"
            in proc.stderr.strip().splitlines()[-1])


# ---- data-parallel page pool ----------------------------------------------------------------

def test_pool_keeps_each_sequence_in_one_shard():
    pool = ShardedBlockPool(num_shards=2, pages_per_shard=8, page_size=4)
    a, b, c = [], [], []
    assert pool.grow(a, 9)  # 3 pages, least used shard: 0
    assert pool.grow(b, 5)  # shard 1 is now the least used
    assert pool.grow(c, 1)  # shard 1 (2 pages) is less used than shard 0 (3)
    assert {pool.shard_of(p) for p in a} == {0} and {pool.shard_of(p) for p in b} == {1}
    assert {pool.shard_of(p) for p in c} == {1}
    assert pool.grow(a, 20) and {pool.shard_of(p) for p in a} == {0}  # grows in its shard
    assert len(a) == 5 and pool.num_used == 5 + 2 + 1
    assert not pool.grow(a, 40)  # shard 0 has 8 pages: a sequence never spills over
    pool.free(a + b + c)
    assert pool.num_free == pool.total_pages == 16
    pool.check_invariants()


def test_pool_prefix_hit_comes_from_the_shard_that_holds_it():
    pool = ShardedBlockPool(num_shards=2, pages_per_shard=8, page_size=4)
    filler, first = [], []
    assert pool.grow(filler, 4)  # shard 0
    prompt = list(range(100, 113))
    assert pool.cached_prefix(prompt, 12) == []
    assert pool.grow(first, 13)  # shard 1
    pool.cache_full_pages(prompt, first, 12, 0)
    pool.grow(filler, 16)  # shard 0 now less free than shard 1... the hit still wins
    hit = pool.cached_prefix(prompt, 12)
    assert hit == first[:3] and {pool.shard_of(p) for p in hit} == {1}
    assert pool.prefix_hit_tokens == 12 and pool.prefix_queried_tokens == 24
    pool.free(hit)
    pool.free(first)
    pool.free(filler)
    pool.check_invariants()


def test_pool_spreads_prompts_that_share_a_prefix_over_the_shards():
    """A prefix that every prompt shares (a system prompt) does not draw every sequence to the
    shard that cached it first: a hit is taken only on a shard using at most its pages more
    than the least used one, so the sequences alternate and both shards soon hold the prefix."""
    pool = ShardedBlockPool(num_shards=2, pages_per_shard=64, page_size=4)
    system = list(range(100, 108))  # two pages that every prompt starts with
    shards, hits = [], []
    for i in range(6):
        prompt = system + list(range(200 + 10 * i, 209 + 10 * i))  # 17 tokens: 5 pages
        pages = pool.cached_prefix(prompt, len(prompt) - 1)
        hits.append(len(pages))
        assert pool.grow(pages, len(prompt))
        pool.cache_full_pages(prompt, pages, len(prompt), hits[-1])
        shards.append({pool.shard_of(p) for p in pages})
    assert shards == [{0}, {1}, {0}, {1}, {0}, {1}]
    assert hits == [0, 0, 2, 2, 2, 2]  # the second went to the idle shard, not to the hit
    pool.check_invariants()
