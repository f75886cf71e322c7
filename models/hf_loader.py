"""Loading HF transformers checkpoint directories (config.json + safetensors) as float32 numpy.

Supported: model_type "llama" (LlamaForCausalLM: Llama 2/3, SmolLM2), "qwen2" (q/k/v biases),
"qwen3" (q/k norms), "mistral" (sliding window), "gemma2" (soft caps, alternating sliding
window, GeGLU, four norms per layer stored as w of (1 + w)) and "gemma3_text" (Gemma 2's layout,
q/k norms, 5:1 local:global layers with their own RoPE base; "gemma3" directories load their text
decoder from text_config) and "phi3" (sliding window; its fused qkv_proj and gate_up_proj are
split into the q/k/v and gate/up tensors), "mixtral" and "qwen3_moe" (mixtures of experts: each
expert's tensors stacked per projection, from the per-expert names of the hub's checkpoints or
the stacked gate_up_proj / down_proj of transformers 5; every layer sparse); rope_scaling
none/"default", rope_type "llama3", "linear" or Phi-3's "longrope"; EOS ids from config.json
and generation_config.json; weights in
`model.safetensors` or sharded through `model.safetensors.index.json`, stored as F32, F16 or BF16
(BF16 is widened from its raw bytes, so no bfloat16 numpy dtype is needed). The tokenizer is read
from tokenizer.json (+ tokenizer_config.json) when present.

Pure numpy: no jax import.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
from safetensors import safe_open

from configs.model import ModelConfig, RopeScaling
from models.checkpoint import LoadedCheckpoint, expected_tensor_shapes, validate_tensors
from models.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                         "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                         "gemma3": "Gemma3ForConditionalGeneration", "phi3": "Phi3ForCausalLM",
                         "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Families whose RMSNorm multiplies by (1 + w): the loader stores 1 + w (models/checkpoint.py).
UNIT_OFFSET_NORMS = ("gemma2", "gemma3_text", "gemma3")
# Gemma 3's multimodal checkpoints: the text decoder's tensor prefixes (transformers 5, then 4.x)
# and the vision tensors, which are not loaded.
_TEXT_DECODER_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                          "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def load_hf_dir(path: str | os.PathLike, *, load_tokenizer: bool = True) -> LoadedCheckpoint:
    """Reads an HF checkpoint directory into a LoadedCheckpoint (name = directory name)."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory not found: {d}")
    config_path = d / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: an HF checkpoint directory needs "
                                f"config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    extra_eos = _generation_config_eos(d)
    cfg = config_from_hf(raw, name=d.name, source=str(config_path), extra_eos_token_ids=extra_eos)

    tokenizer = None
    if load_tokenizer and (d / "tokenizer.json").is_file():
        tc = d / "tokenizer_config.json"
        tokenizer = Tokenizer.from_hf_files(d / "tokenizer.json", tc if tc.is_file() else None,
                                            eos_token_ids=cfg.eos_token_ids)
    if not cfg.eos_token_ids and tokenizer is not None:
        cfg = cfg.replace(eos_token_ids=tokenizer.eos_token_ids)

    tensors = _read_weights(d)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if raw.get("model_type") == "gemma3":
        tensors = _text_decoder_tensors(tensors)
    if raw.get("model_type") == "phi3":
        tensors = split_fused_projections(cfg, tensors)
    if cfg.is_moe:
        tensors = stack_experts(cfg, tensors)
    if raw.get("model_type") in UNIT_OFFSET_NORMS:
        tensors = {k: v + np.float32(1.0) if k.endswith("norm.weight") else v
                   for k, v in tensors.items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    unknown = sorted(set(tensors) - set(expected_tensor_shapes(cfg)))
    if unknown:
        raise ValueError(f"{d}: tensors this loader does not know how to use: "
                         f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    validate_tensors(cfg, tensors, str(d))
    return LoadedCheckpoint(config=cfg, tensors=tensors, tokenizer=tokenizer)


def config_from_hf(raw: dict[str, Any], name: str, source: str = "config.json",
                   extra_eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    """The ModelConfig of an HF config.json dict."""
    model_type = raw.get("model_type")
    if model_type is None:  # very old configs: fall back on the architecture name
        archs = raw.get("architectures") or []
        model_type = next((t for t, a in SUPPORTED_MODEL_TYPES.items() if a in archs), None)
        if model_type is None:
            raise ValueError(f"{source}: no model_type, and architectures {archs} are not "
                             f"supported; supported: {', '.join(SUPPORTED_MODEL_TYPES.values())}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":  # multimodal: the text decoder's config is nested
        if not isinstance(raw.get("text_config"), dict):
            raise ValueError(f"{source}: model_type 'gemma3' needs a text_config object")
        outer_eos = {k: raw[k] for k in ("eos_token_id", "bos_token_id") if k in raw}
        raw = {**outer_eos, **raw["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"

    def req(key: str):
        if raw.get(key) is None:
            raise ValueError(f"{source}: required key {key!r} is missing")
        return raw[key]

    act_key = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
    act = raw.get(act_key) or "silu"
    if act not in _ACTIVATIONS:
        raise ValueError(f"{source}: {act_key} {act!r} is not supported "
                         f"(only {', '.join(_ACTIVATIONS)})")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias is not supported")
    if raw.get("use_sliding_window"):  # Qwen2/3: a window on the layers past max_window_layers
        raise ValueError(f"{source}: use_sliding_window is not supported")
    gemma = model_type in ("gemma2", "gemma3_text")
    windowed = gemma or model_type in ("mistral", "phi3", "mixtral")
    rotary = (raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                    raw.get("partial_rotary_factor", 1.0))
    if float(rotary) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {rotary} is not supported (only 1)")
    sliding_window = raw.get("sliding_window") if windowed else None
    layer_types = tuple(raw.get("layer_types") or ())
    if gemma and not layer_types:  # every pattern-th layer global (Gemma 2: 2, Gemma 3: 6)
        pattern = 2 if model_type == "gemma2" else int(raw.get("sliding_window_pattern", 6))
        layer_types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                            for i in range(int(req("num_hidden_layers"))))
    if sliding_window is None or (layer_types and set(layer_types) == {"full_attention"}):
        sliding_window, layer_types = None, ()
    hidden, num_heads = int(req("hidden_size")), int(req("num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)

    # transformers >= 5 may nest rope settings in "rope_parameters", per layer type for Gemma 3.
    rope_params = raw.get("rope_parameters") or {}
    rope_local_theta = (raw.get("rope_local_base_freq", 10000.0) if model_type == "gemma3_text"
                        else None)
    if "full_attention" in rope_params:
        local = rope_params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: rope_parameters.sliding_attention rope_type "
                             f"{local['rope_type']!r} is not supported (only 'default')")
        rope_local_theta = local.get("rope_theta", rope_local_theta)
        rope_params = rope_params["full_attention"] or {}
    rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = rope_params
    rope_scaling = _rope_scaling(scaling, source, raw)

    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    attention_bias = True if model_type == "qwen2" else bool(raw.get("attention_bias", False))
    moe = _moe_fields(raw, model_type, source)
    try:
        return ModelConfig(
            name=name, vocab_size=int(req("vocab_size")), hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")), num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            rope_local_theta=_optional_float(rope_local_theta),
            attention_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"), **moe,
            sliding_window=None if sliding_window is None else int(sliding_window),
            layer_types=layer_types,
            attn_logit_softcap=_optional_float(raw.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(raw.get("final_logit_softcapping")),
            query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
            hidden_act=_ACTIVATIONS[act], sandwich_norms=gemma, embed_scale=gemma,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in [*eos_ids, *extra_eos_token_ids])))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def _moe_fields(raw: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The ModelConfig MoE fields of a mixtral / qwen3_moe config ({} for other families)."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    experts = raw.get("num_local_experts", raw.get("num_experts"))
    if experts is None or raw.get("num_experts_per_tok") is None:
        raise ValueError(f"{source}: a {model_type} config needs num_local_experts (or "
                         "num_experts) and num_experts_per_tok")
    if model_type == "mixtral":
        return dict(num_experts=int(experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    if int(raw.get("decoder_sparse_step", 1)) != 1 or raw.get("mlp_only_layers"):
        raise ValueError(f"{source}: dense layers among the experts (decoder_sparse_step "
                         f"{raw.get('decoder_sparse_step')}, mlp_only_layers "
                         f"{raw.get('mlp_only_layers')}) are not supported: every layer must be "
                         "sparse")
    if raw.get("moe_intermediate_size") is None:
        raise ValueError(f"{source}: required key 'moe_intermediate_size' is missing")
    return dict(num_experts=int(experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


# Per-expert tensor names of the hub's checkpoints -> the stacked projection they belong to.
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate_proj": "gate_proj",
                 "up_proj": "up_proj", "down_proj": "down_proj"}


def stack_experts(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A mixture's expert tensors as models/checkpoint.py names them: Mixtral's
    block_sparse_moe.* renamed mlp.*, per-expert experts.{j}.{w1,w3,w2 | *_proj}.weight and
    transformers 5's experts.gate_up_proj [E, 2I, H] (gate rows first) / experts.down_proj
    stacked into mlp.experts.{gate,up,down}_proj.weight [E, out, in]."""
    out, per_expert = {}, {}
    for name, arr in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        head, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = arr
            continue
        parts = rest.split(".")
        if parts[0].isdigit() and len(parts) == 3 and parts[1] in _EXPERT_NAMES:
            per_expert.setdefault((head, _EXPERT_NAMES[parts[1]]), {})[int(parts[0])] = arr
        elif rest == "gate_up_proj":
            i = arr.shape[1] // 2
            out[f"{head}.mlp.experts.gate_proj.weight"] = arr[:, :i]
            out[f"{head}.mlp.experts.up_proj.weight"] = arr[:, i:]
        elif rest == "down_proj":
            out[f"{head}.mlp.experts.down_proj.weight"] = arr
        else:
            out[name] = arr  # reported as unknown by the caller
    for (head, proj), by_index in per_expert.items():
        if sorted(by_index) != list(range(cfg.num_experts)):
            raise ValueError(f"{head}.mlp.experts: {proj} holds experts {sorted(by_index)[:8]}, "
                             f"expected 0..{cfg.num_experts - 1}")
        out[f"{head}.mlp.experts.{proj}.weight"] = np.stack(
            [by_index[j] for j in range(cfg.num_experts)])
    return out


def split_fused_projections(cfg: ModelConfig,
                            tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Phi-3's fused self_attn.qkv_proj (rows q, k, v) and mlp.gate_up_proj (rows gate, up)
    split into the separate HF tensors (models.llama.fuse_projections fuses them again where a
    device wants it)."""
    h, kvh, d, i = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    out = {}
    for name, arr in tensors.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[:-len("qkv_proj.weight")]
            if arr.shape[0] != (h + 2 * kvh) * d:
                raise ValueError(f"tensor {name!r} has shape {arr.shape}, expected "
                                 f"({(h + 2 * kvh) * d}, {cfg.hidden_size})")
            out[base + "q_proj.weight"] = arr[:h * d]
            out[base + "k_proj.weight"] = arr[h * d:(h + kvh) * d]
            out[base + "v_proj.weight"] = arr[(h + kvh) * d:]
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name[:-len("gate_up_proj.weight")]
            if arr.shape[0] != 2 * i:
                raise ValueError(f"tensor {name!r} has shape {arr.shape}, expected "
                                 f"({2 * i}, {cfg.hidden_size})")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = arr[:i], arr[i:]
        else:
            out[name] = arr
    return out


def _text_decoder_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A multimodal Gemma 3 checkpoint's text-decoder tensors under the text model's names."""
    out = {}
    for name, arr in tensors.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_DECODER_PREFIXES if name.startswith(p)), None)
        out[name if prefix is None else _TEXT_DECODER_PREFIXES[prefix] + name[len(prefix):]] = arr
    return out


def _optional_float(value) -> Optional[float]:
    return None if value is None else float(value)


def _rope_scaling(scaling: Optional[dict], source: str,
                  raw: Optional[dict] = None) -> Optional[RopeScaling]:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
    if kind in ("longrope", "su"):  # "su": early Phi-3 configs' name of it
        return _longrope_scaling(scaling, source, raw or {})
    if kind != "llama3":
        raise ValueError(f"{source}: rope scaling type {kind!r} is not supported "
                         f"(only 'llama3', 'linear' and 'longrope')")
    defaults = RopeScaling()
    return RopeScaling(
        factor=float(scaling.get("factor", defaults.factor)),
        low_freq_factor=float(scaling.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(scaling.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(scaling.get(
            "original_max_position_embeddings", defaults.original_max_position_embeddings)))


def _longrope_scaling(scaling: dict, source: str, raw: dict) -> RopeScaling:
    """Phi-3's LongRoPE as transformers reads it: original_max_position_embeddings from the
    config's top level first (Phi-3 keeps it there), then from the scaling dict, else
    max_position_embeddings; without an attention_factor, sqrt(1 + ln(f) / ln(original)) with f
    the scaling's factor, else max_position_embeddings / original (1 where f <= 1)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ValueError(f"{source}: longrope rope scaling needs a {key} list")
    max_pos = int(raw.get("max_position_embeddings", 8192))
    original = int(raw.get("original_max_position_embeddings")
                   or scaling.get("original_max_position_embeddings") or max_pos)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(scaling.get("factor") or max_pos / original)
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return RopeScaling(factor=1.0, original_max_position_embeddings=original,
                       rope_type="longrope", short_factor=tuple(scaling["short_factor"]),
                       long_factor=tuple(scaling["long_factor"]),
                       attention_factor=float(attention_factor))


def _generation_config_eos(d: Path) -> tuple[int, ...]:
    p = d / "generation_config.json"
    if not p.is_file():
        return ()
    try:
        eos = json.loads(p.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return ()
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def _read_weights(d: Path) -> dict[str, np.ndarray]:
    index = d / "model.safetensors.index.json"
    single = d / "model.safetensors"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from None
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(read_safetensors(d / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index} lists tensors its shards do not hold: {missing[:8]}")
        return tensors
    if single.is_file():
        return read_safetensors(single)
    raise FileNotFoundError(f"{d}: no weights found (expected model.safetensors or "
                            f"model.safetensors.index.json)")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as float32 numpy."""
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    out: dict[str, np.ndarray] = {}
    bf16: list[str] = []
    try:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype == "BF16":
                    bf16.append(name)
                elif dtype in _FLOAT_DTYPES:
                    out[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
                else:
                    raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    except (OSError, RuntimeError) as e:  # safetensors reports corrupt files as these
        raise ValueError(f"{path} is not a valid safetensors file: {e}") from None
    if bf16:
        out.update(_read_bf16(path, bf16))
    return out


def _read_bf16(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """bfloat16 tensors read from raw bytes (header: u64 length + JSON) and widened to float32."""
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
    out = {}
    for name in names:
        info = header[name]
        start, end = info["data_offsets"]
        raw = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=8 + header_len + start)
        out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
    return out
