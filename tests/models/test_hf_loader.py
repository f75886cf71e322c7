"""Tests of the HF checkpoint-directory loader: single and sharded safetensors, bf16, tied heads,
bad configs, and the HF-written golden tiny checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from configs.model import PRESETS, ModelConfig
from models.hf_loader import load_hf_dir
from tests.models.test_loaders import GOLDEN, TINY, random_hf

def hf_config(cfg: ModelConfig, model_type="llama", **extra) -> dict:
    out = {"architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
           "model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
           "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
           "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
           "eos_token_id": list(cfg.eos_token_ids)}
    if cfg.rope_scaling:
        s = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                               "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_position_embeddings}
    return {**out, **extra}


def write_hf(d: Path, cfg: ModelConfig, tensors: dict, *, shards: int = 1, dtype=np.float32,
             model_type="llama") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config(cfg, model_type)))
    items = {k: v.astype(dtype) for k, v in tensors.items()}
    if shards == 1:
        save_file(items, str(d / "model.safetensors"))
        return d
    names = sorted(items)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: items[k] for k in names[s::shards]}
        save_file(part, str(d / fname))
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


@pytest.mark.parametrize("shards,dtype", [(1, np.float32), (3, np.float32), (1, np.float16),
                                          (2, ml_dtypes.bfloat16)])
def test_hf_dir_round_trip(tmp_path, shards, dtype):
    cfg = PRESETS["tiny-llama31"].replace(name="ckpt")
    hf = random_hf(cfg, seed=shards)
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    ck = load_hf_dir(write_hf(tmp_path / "ckpt", cfg, {**hf, **extra}, shards=shards, dtype=dtype))
    assert ck.config == cfg and ck.tokenizer is None
    assert sorted(ck.tensors) == sorted(hf)
    for k, v in hf.items():
        assert ck.tensors[k].dtype == np.float32
        np.testing.assert_array_equal(ck.tensors[k], v.astype(dtype).astype(np.float32), k)


def test_hf_dir_tied_qwen2_drops_lm_head(tmp_path):
    cfg = PRESETS["tiny-qwen2"].replace(name="qw")
    hf = random_hf(cfg, seed=5)
    d = write_hf(tmp_path / "qw", cfg, {**hf, "lm_head.weight": hf["model.embed_tokens.weight"]},
                 model_type="qwen2")
    ck = load_hf_dir(d)
    assert ck.config == cfg and "lm_head.weight" not in ck.tensors
    np.testing.assert_array_equal(ck.tensors["model.layers.1.self_attn.k_proj.bias"],
                                  hf["model.layers.1.self_attn.k_proj.bias"])


def test_hf_dir_errors(tmp_path):
    cfg = TINY
    hf = random_hf(cfg, 0)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path / "empty")
    d = write_hf(tmp_path / "bad", cfg, hf)
    (d / "config.json").write_text(json.dumps(hf_config(cfg, "mamba")))
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'"):
        load_hf_dir(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps(
        hf_config(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    with pytest.raises(ValueError, match="'yarn'"):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps(hf_config(cfg)))
    save_file({k: v for k, v in hf.items() if "layers.1.mlp.up" not in k},
              str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf_dir(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_dir(d)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama31", "tiny-qwen2"])
def test_hf_golden_dirs(name):
    """Directories written by HF transformers itself (tests/golden): config, tokenizer."""
    d, golden = GOLDEN / name, GOLDEN / "tokenizer_golden.json"
    if not (d / "config.json").exists() or not golden.exists():
        pytest.skip(f"{d} not present")
    ck = load_hf_dir(d)
    assert ck.config == PRESETS[name]
    g = json.loads(golden.read_text())
    for case in g["encodings"]:
        assert ck.tokenizer.encode(case["text"]) == case["ids"], case["text"]
    assert ck.tokenizer.apply_chat_template(g["chat_messages"]) == g["chat_rendered"]


def test_transformers_saved_dir_chat_template_and_generation_eos():
    """A directory saved by transformers 5 (save_pretrained): the chat template comes from
    chat_template.jinja, and generation_config.json's EOS ids join config.json's."""
    d = GOLDEN / "tiny-qwen3"
    assert (d / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((d / "tokenizer_config.json").read_text())
    ck = load_hf_dir(d)
    assert ck.config == PRESETS["tiny-qwen3"].replace(eos_token_ids=(2, 0))
    assert set(ck.tokenizer.eos_token_ids) >= {0, 2}
    g = json.loads((GOLDEN / "tokenizer_golden.json").read_text())
    assert ck.tokenizer.apply_chat_template(g["chat_messages"]) == g["chat_rendered"]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3",
                                  "tiny-phi3"])
def test_family_configs_read_as_presets(name):
    """config.json in each family's own field names maps onto the preset."""
    ck = load_hf_dir(GOLDEN / name, load_tokenizer=False)
    assert ck.config == PRESETS[name].replace(eos_token_ids=(2, 0))


def test_unsupported_family_fields_name_the_field(tmp_path):
    cfg = TINY
    d = write_hf(tmp_path / "bad", cfg, random_hf(cfg, 0))
    for extra, field in (({"hidden_act": "relu"}, "hidden_act 'relu'"),
                         ({"use_sliding_window": True}, "use_sliding_window"),
                         ({"rope_scaling": {"rope_type": "yarn"}}, "'yarn'"),
                         ({"rope_scaling": {"rope_type": "longrope"}}, "short_factor list"),
                         ({"partial_rotary_factor": 0.75}, "partial_rotary_factor")):
        (d / "config.json").write_text(json.dumps(hf_config(cfg, **extra)))
        with pytest.raises(ValueError, match=field):
            load_hf_dir(d)


def test_multimodal_gemma3_dir_loads_its_text_decoder(tmp_path):
    """model_type 'gemma3': the config nested in text_config, the decoder's tensors under
    model.language_model., the vision tensors left out."""
    src = GOLDEN / "tiny-gemma3"
    text = json.loads((src / "config.json").read_text())
    d = tmp_path / "mm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
         "text_config": text, "vision_config": {"hidden_size": 8}}))
    ref = load_hf_dir(src, load_tokenizer=False)
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    renamed = {("lm_head.weight" if k == "lm_head.weight" else
                "model.language_model." + k[len("model."):]): v for k, v in hf.items()}
    save_file({**renamed, "model.vision_tower.patch.weight": np.ones((2, 2), np.float32)},
              str(d / "model.safetensors"))
    ck = load_hf_dir(d, load_tokenizer=False)
    assert ck.config == ref.config.replace(name="mm", eos_token_ids=(2,))  # no generation_config
    for k, v in ref.tensors.items():
        np.testing.assert_array_equal(ck.tensors[k], v, k)
