"""Building the Flax model from HF-named tensors, and random models of real shapes."""
from __future__ import annotations

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


def random_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> LlamaForCausalLM:
    """A model of `cfg`'s shapes with random normal(0.02) weights, created on the device."""
    return nnx.jit(lambda: LlamaForCausalLM(cfg, nnx.Rngs(seed), dtype), static_argnums=())()


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
