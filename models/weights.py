"""Building the Flax model from HF-named tensors, and random models of real shapes."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from models.checkpoint import validate_tensors
from models.llama import LlamaForCausalLM


def abstract_model(cfg: ModelConfig, dtype=jnp.float32) -> LlamaForCausalLM:
    """The model with shape-only weights (no memory allocated)."""
    return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, nnx.Rngs(0), dtype))


def random_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32,
                 shardings=None) -> LlamaForCausalLM:
    """A model of `cfg`'s shapes with random normal(0.02) weights (RMSNorm weights 1), created
    on the device (each leaf on its sharding of `shardings`, a flat list, where given)."""
    return random_like(abstract_model(cfg, dtype), seed, shardings)


def leaf_kind(path) -> str:
    """How `random_leaf` fills the weight at this tree path: norm weights ones, a quantized
    weight's codes, scales and offsets (quant/qtensor.py's fields) their own way, any other
    weight normal."""
    name = jax.tree_util.keystr(path)
    for kind in ("packed", "scales", "offsets"):
        if name.endswith(f".{kind}"):
            return kind
    return "ones" if "norm" in name else "normal"


def random_leaf(shape, dtype, kind: str, bits: int, key) -> jax.Array:
    """One random weight of `kind` (`leaf_kind`): normal(0, 0.02); ones; uniform random codes
    (every bit random: int4 words hold 8 codes); scales that give the codes, less their
    midpoint, a spread of 0.02; offsets that remove the midpoint (asymmetric codes)."""
    spread = math.sqrt((4 ** bits - 1) / 12)  # std of a uniform code of `bits` bits
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "packed":
        unsigned = jnp.dtype(dtype) if jnp.dtype(dtype) == jnp.uint8 else jnp.uint32
        return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, unsigned), dtype)
    if kind == "scales":
        return jnp.full(shape, 0.02 / spread, dtype)
    if kind == "offsets":
        return jnp.full(shape, -0.02 / spread * (2 ** bits - 1) / 2, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.lru_cache(maxsize=None)
def _generator(shape, dtype_name: str, sharding, kind: str, bits: int):
    return jax.jit(functools.partial(random_leaf, shape, jnp.dtype(dtype_name), kind, bits),
                   out_shardings=sharding)


def random_like(abstract, seed: int, shardings=None, bits: int = 16):
    """The model `abstract` (shape-only, nnx.eval_shape) with random values per `random_leaf`
    (codes of `bits` bits where it holds quantized weights), each leaf on its sharding of
    `shardings` (a flat list) where given. One small jitted generator per distinct (shape,
    dtype, sharding, kind), called once per weight: compiling the whole initializer as one
    program makes XLA build one kernel per weight, which took 90-100 s on a GPU for a 1B or
    8B model."""
    graphdef, state = nnx.split(abstract)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    base = jax.random.key(seed)
    values = [_generator(leaf.shape, jnp.dtype(leaf.dtype).name,
                         None if shardings is None else shardings[i], leaf_kind(path), bits)(
                  jax.random.fold_in(base, i))
              for i, (path, leaf) in enumerate(paths_leaves)]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))


def hf_tensors_to_pure_dict(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """Maps HF names/layouts (see models/checkpoint.py) to the nested dict of our model's state.

    HF linear weights are [out, in]; nnx.Linear kernels are [in, out].
    """
    t = tensors
    layers = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = {name: {"kernel": t[p + f"self_attn.{name}.weight"].T}
                for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if cfg.attention_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                attn[name]["bias"] = t[p + f"self_attn.{name}.bias"]
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                attn[name] = {"weight": t[p + f"self_attn.{name}.weight"]}
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if cfg.is_moe:  # experts [E, out, in] -> [E, in, out]; router [E, hidden] -> [hidden, E]
            mlp = {name: {"kernel": np.swapaxes(t[p + f"mlp.experts.{name}.weight"], 1, 2)}
                   for name in ("gate_proj", "up_proj", "down_proj")}
            mlp["router"] = {"kernel": t[p + "mlp.gate.weight"].T}
        else:
            mlp = {name: {"kernel": t[p + f"mlp.{name}.weight"].T}
                   for name in ("gate_proj", "up_proj", "down_proj")}
        layers[i] = {
            **{name: {"weight": t[p + f"{name}.weight"]} for name in norms},
            "self_attn": attn,
            "mlp": mlp,
        }
    pure = {"embed_tokens": {"embedding": t["model.embed_tokens.weight"]},
            "layers": layers, "norm": {"weight": t["model.norm.weight"]}}
    if not cfg.tie_word_embeddings:
        pure["lm_head"] = {"kernel": t["lm_head.weight"].T}
    return pure


def model_from_pure_dict(cfg: ModelConfig, pure: dict, dtype=jnp.float32,
                         sharding=None, abstract=None, place=None) -> LlamaForCausalLM:
    """Builds the model from a nested dict of arrays (as written by nnx.to_pure_dict).

    Float arrays are cast to `dtype`; integer ones (packed quantized weights) keep theirs.
    abstract: the shape-only model to fill (default `abstract_model(cfg, dtype)`); a quantized
    checkpoint passes its own (quant.model.quantized_abstract_model).
    place: a function (key path, host numpy array in its final dtype) -> device array that puts
    each host weight where it belongs, e.g. on its shards of a mesh (models.sharding.leaf_placer).
    """
    graphdef, state = nnx.split(abstract if abstract is not None else abstract_model(cfg, dtype))

    def cast(path, a):
        floating = jnp.issubdtype(a.dtype, jnp.floating)
        if place is not None and isinstance(a, np.ndarray):
            return place(path, np.asarray(a, dtype if floating else a.dtype))
        return jnp.asarray(a, dtype if floating else a.dtype, device=sharding)

    leaves = jax.tree_util.tree_map_with_path(cast, pure)
    nnx.replace_by_pure_dict(state, leaves)
    return nnx.merge(graphdef, state)


def model_from_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32,
                       source: str = "checkpoint", place=None) -> LlamaForCausalLM:
    """Validates HF-named tensors against `cfg` and builds the model in `dtype` (place: as in
    model_from_pure_dict)."""
    validate_tensors(cfg, tensors, source)
    return model_from_pure_dict(cfg, hf_tensors_to_pure_dict(cfg, tensors), dtype, place=place)
