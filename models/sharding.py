"""How weights are split over the (data, model) device mesh: the partition rules, and placing
weights on their shards as they are loaded or built.

The rules are one function over a weight's path in the model state (`partition_spec`), not
partition metadata on the Flax modules, for three reasons:
  * the same function places every form the weights take: the NNX state, the nested dicts
    orbax restores into (abstract targets with shardings), and the arrays inside a quantized
    weight (packed codes, scales, offsets, permutation), whose shapes differ from the float
    kernel's and which quant/ builds after the model exists;
  * whether a dimension splits depends on tp (9 query heads do not split in 2), which module
    metadata written at construction cannot know;
  * models/llama.py stays a plain model.

Tensor parallelism (mesh axis `model`, size tp), Megatron style:
    column-parallel  q_proj, k_proj, v_proj, gate_proj, up_proj, lm_head   kernel [in, out/tp]
    row-parallel     o_proj, down_proj                                      kernel [in/tp, out]
    vocab-parallel   embed_tokens [vocab/tp, hidden] (also the output head when tied)
    replicated       RMSNorm weights
so each decoder layer needs one all-reduce after o_proj and one after down_proj, and no weight
ever moves. Biases follow their kernel's output axis.

Replication rule (a dimension that does not split is replicated, never padded):
  * attention splits by heads when tp divides the query heads; its KV heads then either split
    (tp divides them) or, when tp is a multiple of them, are repeated tp / KV-heads times so that
    each shard holds the one KV head its query heads read (as vLLM does). Otherwise (SmolLM2's 9
    query heads at tp 2, 4, 8) the whole attention block (q/k/v/o and the KV cache) is
    replicated over `model` and computed on every shard; the MLP and vocabulary still split.
  * the MLP splits when tp divides intermediate_size, the vocabulary when tp divides vocab_size.
  * inside a quantized kernel each 2-D array (packed codes, scales, offsets) splits along the
    kernel's split axis when that array's dimension divides by tp (per-channel scales [1, N] of
    a row-parallel kernel stay whole); the act-order permutation is replicated. So a shard holds
    its columns' (or rows' groups') scales next to its codes.

Data parallelism (mesh axis `data`): weights are replicated over it; the KV cache's pages are
split over it (each data shard owns a range of pages; engine/sharding.py).

Expert parallelism (mesh axis `expert`, size ep): a mixture of experts' stacked expert arrays
[E, in, out] (float kernels, or codes / scales / offsets) split their experts over it, and
gate/up columns and down rows over `model` where they divide (models.moe.expert_partition_spec,
the one rule the layer's shard_map also reads); the router and every other weight are
replicated over it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from configs.mesh import AXES, EXPERT, MODEL, expert_size, mesh_shape
from configs.model import ModelConfig
from models.weights import abstract_model, random_model
from models.moe import check_expert_mesh, expert_partition_spec

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP = frozenset({"gate_proj", "up_proj", "down_proj"})
KV_PROJECTIONS = frozenset({"k_proj", "v_proj"})
NOT_SPLIT = frozenset({"perm"})  # act-order permutation of a quantized kernel's input rows


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How attention is laid out over tp model shards (see the module docstring)."""

    shard_heads: bool  # q/k/v columns, o rows and the KV cache split by heads over `model`
    kv_repeat: int  # each KV head is stored this many times (1: no repetition)
    reason: str

    def describe(self) -> str:
        return self.reason


def attention_plan(cfg: ModelConfig, tp: int) -> AttentionPlan:
    """The attention layout of `cfg` over tp shards (the replication rule of the docstring)."""
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    if tp == 1:
        return AttentionPlan(True, 1, "one model shard")
    if h % tp:
        return AttentionPlan(False, 1, f"{h} query heads do not split over tp={tp}: attention "
                                       "and the KV cache are replicated on every model shard")
    if kvh % tp == 0:
        return AttentionPlan(True, 1, f"{h // tp} query and {kvh // tp} KV heads per shard")
    if tp % kvh == 0:
        return AttentionPlan(True, tp // kvh,
                             f"{h // tp} query heads per shard; {kvh} KV heads < tp={tp}: each "
                             f"repeated {tp // kvh} times, one per shard")
    return AttentionPlan(False, 1, f"{kvh} KV heads neither divide nor are divided by tp={tp}: "
                                   "attention and the KV cache are replicated")


def runtime_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded step runs: KV heads counted after repetition (attention_plan)."""
    plan = attention_plan(cfg, tp)
    if plan.kv_repeat == 1:
        return cfg
    return cfg.replace(num_kv_heads=cfg.num_kv_heads * plan.kv_repeat)


def path_names(path) -> tuple[str, ...]:
    """A pytree key path as plain names ('layers', '0', 'self_attn', 'q_proj', 'kernel', ...).

    NNX Variable boxes ('value') are dropped, so State, pure dicts and abstract targets give the
    same names; a quantized kernel's arrays end in their field ('packed', 'scales', ...).
    """
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    return tuple(n for n in names if n not in ("value", "raw_value"))


def partition_spec(names: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig,
                   tp: int, ep: int = 1) -> P:
    """The PartitionSpec of the weight array at `names` (path_names) with `shape`.

    cfg is the config the array belongs to: the stored one (k/v with their original KV heads,
    replicated when tp does not divide them) or runtime_config's (k/v repeated, split by head).
    ep: the `expert` axis's size (mixtures of experts).
    """
    if cfg.is_moe and "mlp" in names and len(shape) == 3:
        module = next((n for n in reversed(names) if n in MLP), None)
        return expert_partition_spec(module, shape, {EXPERT: ep, MODEL: tp})
    if tp == 1:
        return P()

    def fit(*axes):  # a mesh axis only where the dimension divides
        return P(*(a if a is not None and shape[i] % tp == 0 else None
                   for i, a in enumerate(axes)))

    name_set = set(names)
    if "embed_tokens" in name_set:
        return fit(MODEL, None) if cfg.vocab_size % tp == 0 else P()
    module = next((n for n in reversed(names) if n in COLUMN_PARALLEL | ROW_PARALLEL), None)
    if module is None or names[-1] in NOT_SPLIT:
        return P()
    if module in ATTENTION and not attention_plan(cfg, tp).shard_heads:
        return P()
    if module in KV_PROJECTIONS and cfg.num_kv_heads % tp:
        return P()  # stored KV heads fewer than tp: repeated per shard at run time
    if module in MLP and cfg.intermediate_size % tp:
        return P()
    if module == "lm_head" and cfg.vocab_size % tp:
        return P()
    if len(shape) == 1:  # bias [out]
        return fit(MODEL) if module in COLUMN_PARALLEL else P()
    if len(shape) != 2:
        return P()
    return fit(None, MODEL) if module in COLUMN_PARALLEL else fit(MODEL, None)


def tree_shardings(tree, cfg: ModelConfig, mesh):
    """NamedShardings for every array leaf of a weight tree (State, pure dict or abstract)."""
    tp, _ = mesh_shape(mesh)
    ep = expert_size(mesh)
    if cfg.is_moe:
        check_expert_mesh(cfg.num_experts, {EXPERT: ep})
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(
            mesh, partition_spec(path_names(path), tuple(leaf.shape), cfg, tp, ep)), tree)


def repeat_kv_heads(tree, cfg: ModelConfig, repeat: int):
    """Repeats each KV head of the k/v projections `repeat` times along their output axis.

    Works on float kernels [in, KVH*D], biases [KVH*D] and the arrays of quantized kernels
    ([rows, KVH*D] codes / scales / offsets; the permutation is left alone): columns are
    independent, so a repeated column of codes with its scales is the repeated float column.
    """
    if repeat == 1:
        return tree
    kvh, d = cfg.num_kv_heads, cfg.head_dim

    def repeat_leaf(path, leaf):
        names = path_names(path)
        if not KV_PROJECTIONS & set(names) or names[-1] in NOT_SPLIT:
            return leaf
        lead = leaf.shape[:-1]
        heads = leaf.reshape(lead + (kvh, 1, d))
        return jnp.broadcast_to(heads, lead + (kvh, repeat, d)).reshape(lead + (kvh * repeat * d,))

    return jax.tree_util.tree_map_with_path(repeat_leaf, tree)


def shard_state(state, cfg: ModelConfig, mesh):
    """Places a model state on the mesh for the sharded step; returns (state, runtime config).

    Leaves already laid out by the rules (a model loaded onto the mesh) stay where they are;
    KV heads repeated for tp > KV heads are computed on the devices that hold them.
    """
    tp, _ = mesh_shape(mesh)
    run_cfg = runtime_config(cfg, tp)
    repeat = run_cfg.num_kv_heads // cfg.num_kv_heads
    fn = functools.partial(repeat_kv_heads, cfg=cfg, repeat=repeat)
    shardings = tree_shardings(jax.eval_shape(fn, state), run_cfg, mesh)
    if repeat == 1 and all(getattr(a, "sharding", None) == s for a, s in
                           zip(jax.tree.leaves(state), jax.tree.leaves(shardings))):
        return state, run_cfg
    return jax.jit(fn, out_shardings=shardings)(state), run_cfg


def put(host: np.ndarray, sharding) -> jax.Array:
    """A host array (the same on every process) as a global array with `sharding`.

    One process: a plain device_put. Several: each process fills its own devices' shards.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def leaf_placer(cfg: ModelConfig, mesh):
    """A function (path, host array) -> array on the mesh by the rules (for loaders).

    Loaders build weights as host numpy; this places each one straight onto its shards, so no
    device ever holds the whole model (and each process fills only its own devices).
    """
    tp, _ = mesh_shape(mesh)
    ep = expert_size(mesh)

    def place(path, host):
        spec = partition_spec(path_names(path), tuple(np.shape(host)), cfg, tp, ep)
        return put(np.asarray(host), NamedSharding(mesh, spec))

    return place


def random_model_on_mesh(cfg: ModelConfig, seed: int, dtype, mesh):
    """A random model of cfg's shapes created directly on its shards (models.weights'
    random_model, each weight on the sharding the rules give it)."""
    state = nnx.state(abstract_model(cfg, dtype))
    return random_model(cfg, seed, dtype, jax.tree.leaves(tree_shardings(state, cfg, mesh)))


def abstract_with_shardings(tree, cfg: ModelConfig, mesh):
    """ShapeDtypeStructs of a (pure dict) tree carrying the rules' shardings (orbax targets)."""
    shardings = tree_shardings(tree, cfg, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def storage_layout(model, cfg: ModelConfig, tp: int):
    """The model with every weight split as the rules split it at `tp`, over tp host CPUs.

    orbax writes each array in chunks of its shards, so a checkpoint saved from this layout is
    read shard by shard when restored at any tp dividing this one (scripts/convert_checkpoint.py).
    """
    cpus = jax.devices("cpu")
    if len(cpus) < tp:
        raise ValueError(f"storage layout over tp={tp} needs {tp} host CPU devices, found "
                         f"{len(cpus)} (set XLA_FLAGS=--xla_force_host_platform_device_count={tp})")
    mesh = Mesh(np.array(cpus[:tp]).reshape(1, 1, tp), AXES,
                axis_types=(AxisType.Auto,) * len(AXES))
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, tree_shardings(state, cfg, mesh)))
