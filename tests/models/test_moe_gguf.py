"""GGUF files of Mixtral ("llama" with experts) and Qwen3-MoE ("qwen3moe"), written here with
gguf.GGUFWriter from the tiny transformers directories' tensors in llama.cpp's names and layouts
(stacked experts, q/k rows permuted for "llama"), load to the same config and tensors."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.perplexity import full_sequence_logits
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_dir
from models.weights import model_from_tensors
from tests.conftest import GOLDEN_DIR
from tests.models.test_golden import relative_error
from tests.models.test_loaders import add_decoder_keys, permute_llamacpp

LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
         "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
         "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
         "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
         "mlp.gate.weight": "ffn_gate_inp", "mlp.experts.gate_proj.weight": "ffn_gate_exps",
         "mlp.experts.up_proj.weight": "ffn_up_exps",
         "mlp.experts.down_proj.weight": "ffn_down_exps"}
GLOBAL = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
          "lm_head.weight": "output"}


def write_moe_gguf(path, cfg, tensors: dict, arch: str, expert_type,
                   weights_norm: bool | None = None, extra=None) -> None:
    """llama.cpp's layout of an HF-named MoE checkpoint (no tokenizer: the vocabulary is the
    embedding's rows); weights_norm: the expert_weights_norm key, None to leave it out."""
    w = gguf.GGUFWriter(str(path), arch)
    add_decoder_keys(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if weights_norm is not None:
        w.add_expert_weights_norm(weights_norm)
    if extra is not None:
        extra(w)
    w.add_feed_forward_length(cfg.intermediate_size)  # Mixtral's is the experts' width
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for name, arr in tensors.items():
        if name in GLOBAL:
            gname = GLOBAL[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{LAYER[rest]}"
            if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                arr = permute_llamacpp(arr, cfg.num_heads if "q_proj" in rest
                                       else cfg.num_kv_heads)
        if "_exps" in gname and expert_type == Q.Q8_0:
            w.add_tensor(gname + ".weight", gguf.quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(gname + ".weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family,arch,expert_type", [("tiny-mixtral", "llama", Q.Q8_0),
                                                     ("tiny-qwen3-moe", "qwen3moe", Q.F32)])
def test_moe_gguf_loads_as_the_transformers_directory(tmp_path, family, arch, expert_type):
    hf = load_hf_dir(os.path.join(GOLDEN_DIR, family), load_tokenizer=False)
    path = tmp_path / f"{family}.gguf"
    norm = None if arch == "llama" else hf.config.norm_topk_prob  # Mixtral: the default
    write_moe_gguf(path, hf.config, hf.tensors, arch, expert_type, weights_norm=norm)
    ck = load_gguf(path, load_tokenizer=False)
    assert ck.config == hf.config.replace(name=family, eos_token_ids=(), bos_token_id=None)
    assert sorted(ck.tensors) == sorted(hf.tensors)
    for name, want in hf.tensors.items():
        if "_proj.weight" in name and "experts" in name and expert_type == Q.Q8_0:
            np.testing.assert_allclose(ck.tensors[name], want, atol=np.abs(want).max() / 200)
        else:
            np.testing.assert_array_equal(ck.tensors[name], want, name)
    if expert_type == Q.F32:  # float32 throughout: the transformers logits
        golden = dict(np.load(os.path.join(GOLDEN_DIR, family, "golden.npz")))
        model = model_from_tensors(ck.config, ck.tensors)
        logits = full_sequence_logits(ck.config, model, golden["input_ids"], page_size=4)
        assert relative_error(logits, golden["logits"]) < 1e-4


def test_qwen3moe_gguf_defaults_and_refusals(tmp_path):
    """Without expert_weights_norm the chosen experts' weights are renormalised (llama.cpp's
    default; every released Qwen3-MoE sets norm_topk_prob); shared experts and sigmoid gating
    (other MoE families) are refused."""
    hf = load_hf_dir(os.path.join(GOLDEN_DIR, "tiny-qwen3-moe"), load_tokenizer=False)
    write_moe_gguf(tmp_path / "q.gguf", hf.config, hf.tensors, "qwen3moe", Q.F32)
    assert load_gguf(tmp_path / "q.gguf", load_tokenizer=False).config.norm_topk_prob
    write_moe_gguf(tmp_path / "s.gguf", hf.config, hf.tensors, "qwen3moe", Q.F32,
                   extra=lambda w: w.add_expert_shared_count(1))
    with pytest.raises(ValueError, match="expert_shared_count"):
        load_gguf(tmp_path / "s.gguf", load_tokenizer=False)
