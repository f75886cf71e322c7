"""What every weight loader returns: a config, HF-named float tensors and a tokenizer.

The interchange format between loaders (GGUF, HF safetensors, orbax) and the model is a flat
dict of numpy arrays named and shaped as in HF transformers checkpoints:

    model.embed_tokens.weight                      [vocab, hidden]
    model.layers.{i}.input_layernorm.weight        [hidden]
    model.layers.{i}.self_attn.q_proj.weight       [num_heads * head_dim, hidden]
    model.layers.{i}.self_attn.k_proj.weight       [num_kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.v_proj.weight       [num_kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias   [out]            (Qwen2 only)
    model.layers.{i}.self_attn.o_proj.weight       [hidden, num_heads * head_dim]
    model.layers.{i}.self_attn.{q,k}_norm.weight   [head_dim]       (qk_norm: Qwen3)
    model.layers.{i}.post_attention_layernorm.weight [hidden]
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight [hidden] (sandwich_norms: Gemma)
    model.layers.{i}.mlp.gate_proj.weight          [intermediate, hidden]
    model.layers.{i}.mlp.up_proj.weight            [intermediate, hidden]
    model.layers.{i}.mlp.down_proj.weight          [hidden, intermediate]
    model.layers.{i}.mlp.gate.weight               [experts, hidden]  (MoE: router, instead
    model.layers.{i}.mlp.experts.gate_proj.weight  [experts, moe_intermediate, hidden]  of the
    model.layers.{i}.mlp.experts.up_proj.weight    [experts, moe_intermediate, hidden]  dense
    model.layers.{i}.mlp.experts.down_proj.weight  [experts, hidden, moe_intermediate]  MLP's)
    model.norm.weight                              [hidden]
    lm_head.weight                                 [vocab, hidden]  (untied models only)

Q and K rows are in HF order (rotate-half RoPE), never GGUF's interleaved order. Norm weights
are the factors the normed values are multiplied by: Gemma checkpoints store w of (1 + w), and
the HF loader adds the one (as llama.cpp's GGUF conversion does). The experts of a mixture
are stacked per projection, each expert [out, in] as in HF checkpoints (the loaders stack
Mixtral's block_sparse_moe.experts.{j}.w1/w3/w2 and Qwen3-MoE's mlp.experts.{j}.*_proj).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from configs.model import ModelConfig
from models.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedCheckpoint:
    """A model as read from disk: its config, HF-named tensors, and its tokenizer (or None)."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer | None


def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes a checkpoint of `cfg` must contain."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * d,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if cfg.is_moe:
            e, i = cfg.num_experts, cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_proj.weight"] = (e, i, h)
            shapes[p + "mlp.experts.up_proj.weight"] = (e, i, h)
            shapes[p + "mlp.experts.down_proj.weight"] = (e, h, i)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def validate_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], source: str) -> None:
    """Raises ValueError naming the first missing or mis-shaped tensor of `source`."""
    for name, shape in expected_tensor_shapes(cfg).items():
        if name not in tensors:
            raise ValueError(f"{source}: missing tensor {name!r} (expected shape {shape})")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                             f"expected {shape} for config {cfg.name!r}")
