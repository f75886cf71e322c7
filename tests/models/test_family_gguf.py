"""GGUF files of the qwen3, gemma2, gemma3 and phi3 architectures, written here with
gguf.GGUFWriter from the tiny transformers directories in llama.cpp's tensor names, layouts and
metadata keys (Gemma's norms stored as 1 + w, Phi-3's q/k/v and gate/up fused, its LongRoPE
factors as rope_factors_short / rope_factors_long), load to the directory's config and tensors,
and their logits and greedy tokens are transformers'."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from configs.model import ModelConfig
from engine.perplexity import full_sequence_logits
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_dir
from models.weights import model_from_tensors
from tests.conftest import GOLDEN_DIR
from tests.models.test_golden import relative_error
from tests.models.test_loaders import add_decoder_keys

GLOBAL = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
          "lm_head.weight": "output"}
LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
         "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
         "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
         "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
         "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
         "mlp.down_proj.weight": "ffn_down"}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm.weight": "post_attention_norm",
               "pre_feedforward_layernorm.weight": "ffn_norm",
               "post_feedforward_layernorm.weight": "post_ffw_norm"}
ARCH = {"tiny-qwen3": "qwen3", "tiny-gemma2": "gemma2", "tiny-gemma3": "gemma3",
        "tiny-phi3": "phi3", "tiny-phi3-longrope": "phi3"}


def llamacpp_tensors(cfg: ModelConfig, tensors: dict, arch: str) -> dict[str, np.ndarray]:
    """HF-named tensors as loaded (Gemma norms already 1 + w) in llama.cpp's names; phi3's
    q/k/v rows concatenated into attn_qkv and gate/up rows into ffn_up."""
    names = GEMMA_LAYER if arch.startswith("gemma") else LAYER
    out = {}
    for name, arr in tensors.items():
        if name in GLOBAL:
            out[GLOBAL[name] + ".weight"] = arr
            continue
        _, _, i, rest = name.split(".", 3)
        out[f"blk.{i}.{names[rest]}.weight"] = arr
    if arch == "phi3":
        for i in range(cfg.num_layers):
            qkv = [out.pop(f"blk.{i}.attn_{p}.weight") for p in "qkv"]
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(qkv)
            gate_up = [out.pop(f"blk.{i}.ffn_{p}.weight") for p in ("gate", "up")]
            out[f"blk.{i}.ffn_up.weight"] = np.concatenate(gate_up)
    return out


def write_family_gguf(path, cfg: ModelConfig, tensors: dict, arch: str, extra=None) -> None:
    """The metadata llama.cpp's converter writes for `arch` (the vocabulary: the embedding's
    rows); extra(writer) adds or overrides keys."""
    w = gguf.GGUFWriter(str(path), arch)
    add_decoder_keys(w, cfg)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    if arch.startswith("gemma"):
        if cfg.attn_logit_softcap is not None:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcap)
        if cfg.final_logit_softcap is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcap)
        # the tiny models' scalar (24) is neither llama.cpp default: state it
        w.add_attention_scale(cfg.query_pre_attn_scalar ** -0.5)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "gemma3":
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        w.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
        w.add_rope_scaling_attn_factors(scaling.attention_factor)
        for kind in ("short", "long"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.asarray(getattr(scaling, f"{kind}_factor"), np.float32))
    if extra is not None:
        extra(w)
    for name, arr in llamacpp_tensors(cfg, tensors, arch).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", sorted(ARCH))
def test_family_gguf_matches_transformers(tmp_path, family):
    hf = load_hf_dir(os.path.join(GOLDEN_DIR, family), load_tokenizer=False)
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, hf.config, hf.tensors, ARCH[family])
    ck = load_gguf(path, load_tokenizer=False)
    want = hf.config.replace(name=family, eos_token_ids=(), bos_token_id=None)
    if want.rope_scaling is not None and want.rope_scaling.rope_type == "longrope":
        got, want_s = ck.config.rope_scaling, want.rope_scaling  # stored as float32
        for field in ("short_factor", "long_factor", "attention_factor"):
            np.testing.assert_allclose(getattr(got, field), getattr(want_s, field), rtol=1e-6)
        want = want.replace(rope_scaling=got)
    assert ck.config == want
    assert sorted(ck.tensors) == sorted(hf.tensors)
    for name, want in hf.tensors.items():
        np.testing.assert_array_equal(ck.tensors[name], want, name)
    # one prefill over the prompt and transformers' greedy continuation: the prompt's logits
    # are the golden ones (float32: relative 1e-4), and each continuation token is the argmax
    # at the position before it (every golden step wins by a margin of at least 0.05).
    golden = dict(np.load(os.path.join(GOLDEN_DIR, family, "golden.npz")))
    prompt_len = golden["input_ids"].shape[1]
    ids = np.concatenate([golden["input_ids"], golden["greedy_ids"]], axis=1)
    logits = full_sequence_logits(ck.config, model_from_tensors(ck.config, ck.tensors), ids,
                                  page_size=4)
    assert relative_error(logits[:, :prompt_len], golden["logits"]) < 1e-4
    greedy = logits[:, prompt_len - 1:-1].argmax(-1)
    np.testing.assert_array_equal(greedy, golden["greedy_ids"])


def test_family_gguf_defaults_and_refusals(tmp_path):
    """Without attention.scale the scale is llama.cpp's 1 / sqrt(head_dim) (the 27B block counts
    aside), without a window pattern gemma2 alternates from a sliding first layer; a rope scaling
    other than gemma3's linear one is refused by name, as LongRoPE factors without their
    original context length."""
    hf = load_hf_dir(os.path.join(GOLDEN_DIR, "tiny-gemma2"), load_tokenizer=False)
    cfg, tensors = hf.config, hf.tensors

    def defaults(w):  # drop the two keys write_family_gguf sets for the tiny model
        for key in ("gemma2.attention.scale", "gemma2.attention.sliding_window_pattern"):
            w.kv_data[0].pop(key)
    write_family_gguf(tmp_path / "d.gguf", cfg, tensors, "gemma2", extra=defaults)
    got = load_gguf(tmp_path / "d.gguf", load_tokenizer=False).config
    assert got.query_pre_attn_scalar == cfg.head_dim
    assert got.layer_types == ("sliding_attention", "full_attention")
    write_family_gguf(tmp_path / "y.gguf", cfg, tensors, "gemma2",
                      extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN))
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        load_gguf(tmp_path / "y.gguf", load_tokenizer=False)
    phi3 = load_hf_dir(os.path.join(GOLDEN_DIR, "tiny-phi3-longrope"), load_tokenizer=False)
    write_family_gguf(tmp_path / "p.gguf", phi3.config, phi3.tensors, "phi3", extra=lambda w: (
        w.kv_data[0].pop("phi3.rope.scaling.original_context_length")))
    with pytest.raises(ValueError, match="phi3.rope.scaling.original_context_length"):
        load_gguf(tmp_path / "p.gguf", load_tokenizer=False)
