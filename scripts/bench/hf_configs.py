"""The transformers config of a ModelConfig's family and shapes: what the decode benchmark's HF
peer (scripts/bench/hf_peer.py) builds. Plain Python with no flags, so tests import it; the
caller passes the transformers module, an optional dependency."""
from __future__ import annotations


def hf_model_type(cfg) -> str:
    """The transformers model_type whose decoder computes what cfg describes, told apart by the
    fields that switch a family's math on (configs/model.py). Phi-3 computes Mistral's (its
    checkpoints only store q/k/v and gate/up fused), or Llama's without a sliding window (RoPE
    aside, which `hf_config` leaves at the default), so it runs as one of those."""
    if cfg.is_moe:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.sandwich_norms:
        return "gemma3_text" if cfg.rope_local_theta is not None else "gemma2"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.attention_bias:
        return "qwen2"
    return "llama" if cfg.sliding_window is None else "mistral"


def hf_config(cfg, transformers):
    """The transformers config of cfg's family (`hf_model_type`) and shapes (RoPE left at the
    family's default: a peer's speed does not depend on its frequencies)."""
    kind = hf_model_type(cfg)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings)
    gemma = dict(sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types),
                 query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or 0),
                 hidden_activation="gelu_pytorch_tanh")
    if kind == "llama":
        return transformers.LlamaConfig(**common, attention_bias=cfg.attention_bias)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=cfg.sliding_window)
    if kind == "gemma2":
        return transformers.Gemma2Config(**common, **gemma,
                                         attn_logit_softcapping=cfg.attn_logit_softcap,
                                         final_logit_softcapping=cfg.final_logit_softcap)
    if kind == "gemma3_text":
        return transformers.Gemma3TextConfig(**common, **gemma)
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **{**common, "intermediate_size": cfg.moe_intermediate_size},
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok)
    return transformers.Qwen3MoeConfig(
        **common, moe_intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[])
