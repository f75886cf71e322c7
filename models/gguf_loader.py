"""Loading GGUF files (llama.cpp's format) into HF-named float32 tensors.

Supported:
  architectures   general.architecture "llama" (Llama 2/3, SmolLM2; Mixtral when it has
                  llama.expert_count), "qwen2" (q/k/v biases), "qwen3" (q/k norms),
                  "qwen3moe", "gemma2", "gemma3" (text decoder) and "phi3". Experts come
                  stacked (blk.N.ffn_{gate,up,down}_exps, router blk.N.ffn_gate_inp); the
                  per-expert tensors of early Mixtral files (blk.N.ffn_gate.J) are refused
  Gemma           four norms per layer (attn_norm, post_attention_norm, ffn_norm before the MLP,
                  post_ffw_norm), GeGLU, embeddings times sqrt(hidden), soft caps from
                  {arch}.attn_logit_softcapping / final_logit_softcapping, the window from
                  attention.sliding_window on the layers that attention.sliding_window_pattern
                  marks (an int n: every n-th layer global; or one bool per layer, true =
                  sliding; absent: llama.cpp's 2 for gemma2, 6 for gemma3). The softmax scale is
                  attention.scale where present, else llama.cpp's rule (see _gemma_fields).
                  Gemma 3's local layers use rope.freq_base_swa (default 10000) and no scaling;
                  rope.scaling.type linear applies to its global layers.
  Phi-3           fused blk.N.attn_qkv (rows q, k, v) and blk.N.ffn_up (rows gate, up: phi3 has
                  no ffn_gate) are split; attention.sliding_window where present; LongRoPE from
                  rope_factors_short / rope_factors_long (see _longrope_from_gguf).
  tensor types    F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, dequantized to float32 with
                  `gguf.quants.dequantize`; any other type raises ValueError naming the tensor
  rope scaling    none, or Llama 3 style, which llama.cpp stores as a `rope_freqs.weight` tensor of
                  per-frequency divisors (not as metadata): the RopeScaling that reproduces it is
                  recovered. rope.scaling.type linear (except on gemma3), yarn and longrope (except
                  on phi3) raise ValueError.
  tokenizer       byte-level BPE or SentencePiece BPE (see models/tokenizer.py, `Tokenizer.from_gguf`)

llama.cpp's converter permutes the rows of the llama Q and K projections so that rotary pairs are
interleaved (w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2)); we undo that here, so the
tensors are in HF (rotate-half) order. Qwen2/3, Gemma and Phi-3 are converted without the
permutation (their RoPE is rotate-half).

Gemma's RMSNorm multiplies by (1 + w), w being what HF checkpoints store. llama.cpp's converter
writes every Gemma 2/3 `*norm.weight` tensor (the q/k norms included) as 1 + w, so that its
plain RMSNorm computes the same; transformers' own GGUF reader subtracts the one again for these
two architectures. models/llama.py's RMSNorm multiplies by its weight as it is and the HF loader
adds the one, so GGUF norm weights are taken as stored.

Pure numpy: no jax import.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import numpy as np

import gguf
from gguf import GGMLQuantizationType, GGUFValueType

from configs.model import ModelConfig, RopeScaling
from models.checkpoint import LoadedCheckpoint, validate_tensors
from models.gguf_file import open_gguf
from models.hf_loader import split_fused_projections
from models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
SUPPORTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router of a mixture of experts
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",  # [E, I, hidden]
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",  # [E, hidden, I]
}
# Where an architecture's tensor of the same llama.cpp name is another HF tensor: Gemma's
# ffn_norm is the norm before the MLP (gguf's FFN_PRE_NORM); Phi-3's fused projections.
_GEMMA_LAYER_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES,
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
_ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE: per-frequency divisors of the short and long contexts (gguf's
# ROPE_FACTORS_SHORT / ROPE_FACTORS_LONG), each [head_dim / 2].
_LONGROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_IGNORED_LAYER_TENSORS = ("attn_rot_embd",)  # old converters stored rotary inv_freq per layer


def load_gguf(path: str | os.PathLike, *, load_tokenizer: bool = True) -> LoadedCheckpoint:
    """Reads a GGUF file into a LoadedCheckpoint of HF-named float32 tensors.

    The config's name is the file stem. With load_tokenizer, the GGUF's tokenizer is built (or
    ValueError raised if its tokenizer model is unsupported); without, `tokenizer` is None.
    """
    p = Path(path)
    reader = open_gguf(p)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{p}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if (_field(reader, "split.count") or 1) > 1:
        raise ValueError(f"{p}: split GGUF files are not supported; merge them with "
                         f"llama-gguf-split --merge first")
    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:  # fail before spending time on dequantizing anything
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"{p}: tensor {t.name!r} has unsupported type {t.tensor_type.name}; "
                             f"supported: {', '.join(q.name for q in SUPPORTED_TENSOR_TYPES)}")

    tokenizer = None
    if load_tokenizer and _field(reader, "tokenizer.ggml.model") is not None:
        tokenizer = Tokenizer.from_gguf(reader)
    cfg = config_from_gguf(reader, name=p.stem, source=str(p))

    tensors: dict[str, np.ndarray] = {}
    unknown = []
    for t in reader.tensors:
        hf_name = _hf_name(t.name, arch)
        if hf_name is None:
            if (t.name not in (_ROPE_FREQS, *_LONGROPE_FACTORS)
                    and not any(k in t.name for k in _IGNORED_LAYER_TENSORS)):
                unknown.append(t.name)
            continue
        w = dequantize_tensor(t)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        tensors[hf_name] = w
    if unknown:
        raise ValueError(f"{p}: tensors this loader does not know how to use: "
                         f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    if arch == "llama" and cfg.attention_bias:
        raise ValueError(f"{p}: llama GGUF with q/k/v biases is not supported")
    if arch == "qwen3" and "blk.0.attn_q_norm.weight" not in by_name:
        raise ValueError(f"{p}: qwen3 GGUF without q/k norms (blk.0.attn_q_norm.weight missing)")
    if arch == "qwen2" and "blk.0.attn_q.bias" not in by_name:
        raise ValueError(f"{p}: qwen2 GGUF without q/k/v biases (blk.0.attn_q.bias missing)")
    del reader  # releases the memory map: every tensor above is a copy
    if arch == "phi3":
        tensors = split_fused_projections(cfg, tensors)
    validate_tensors(cfg, tensors, str(p))
    return LoadedCheckpoint(config=cfg, tensors=tensors, tokenizer=tokenizer)


def config_from_gguf(reader: gguf.GGUFReader, name: str, source: str = "GGUF") -> ModelConfig:
    """The ModelConfig described by a GGUF file's metadata (and its tensor list)."""
    arch = _field(reader, "general.architecture")

    def get(key: str, default=None, required: bool = False):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            if required:
                raise ValueError(f"{source}: metadata key {arch}.{key} is missing")
            return default
        if isinstance(value, list):
            raise ValueError(f"{source}: per-layer values of {arch}.{key} are not supported")
        return value

    hidden = int(get("embedding_length", required=True))
    num_heads = int(get("attention.head_count", required=True))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"{source}: key_length {head_dim} != value_length {value_dim} "
                         f"is not supported")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{source}: partial rotary embeddings (rope.dimension_count {rope_dim} "
                         f"< head_dim {head_dim}) are not supported")
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type != "none" and (arch, scaling_type) not in (("gemma3", "linear"),
                                                                ("phi3", "longrope")):
        raise ValueError(f"{source}: rope scaling type {scaling_type!r} is not supported")
    rope_theta = float(get("rope.freq_base", 10000.0))
    num_layers = int(get("block_count", required=True))
    family = {}
    if arch in GEMMA_ARCHITECTURES:
        family = _gemma_fields(reader, arch, get, num_layers, hidden, num_heads, head_dim, source)
    elif arch == "phi3" and get("attention.sliding_window") is not None:
        family = dict(sliding_window=int(get("attention.sliding_window")))

    tensor_names = {t.name: t for t in reader.tensors}
    rope_scaling = family.pop("rope_scaling", None)
    if _ROPE_FREQS in tensor_names:
        factors = dequantize_tensor(tensor_names[_ROPE_FREQS])
        rope_scaling = rope_scaling_from_factors(
            factors, head_dim, rope_theta, get("rope.scaling.original_context_length"), source)
    if any(n in tensor_names for n in _LONGROPE_FACTORS):
        if arch != "phi3":
            raise ValueError(f"{source}: {arch} GGUF with LongRoPE factor tensors is not "
                             f"supported")
        rope_scaling = _longrope_from_gguf(tensor_names, get, source)

    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens)
    elif get("vocab_size") is not None:
        vocab_size = int(get("vocab_size"))
    elif "token_embd.weight" in tensor_names:
        vocab_size = int(tensor_names["token_embd.weight"].shape[-1])
    else:
        raise ValueError(f"{source}: cannot tell the vocabulary size (no token list, "
                         f"no {arch}.vocab_size, no token_embd.weight)")

    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    moe = {}
    if get("expert_count") is not None:  # Mixtral ("llama") and Qwen3-MoE
        unsupported = {"expert_shared_count": get("expert_shared_count", 0),  # shared experts
                       "expert_gating_func": get("expert_gating_func", 1),  # 1: softmax
                       "expert_weights_scale": get("expert_weights_scale", 1.0)}
        for key, value in unsupported.items():
            if value != (0 if key == "expert_shared_count" else 1):
                raise ValueError(f"{source}: {arch}.{key} = {value} is not supported")
        expert_width = get("expert_feed_forward_length") or get("feed_forward_length",
                                                                required=True)
        # both families renormalise the chosen experts' probabilities (llama.cpp's default)
        moe = dict(num_experts=int(get("expert_count")),
                   num_experts_per_tok=int(get("expert_used_count", required=True)),
                   moe_intermediate_size=int(expert_width),
                   norm_topk_prob=bool(get("expert_weights_norm", True)))
    elif arch == "qwen3moe":
        raise ValueError(f"{source}: metadata key qwen3moe.expert_count is missing")
    return ModelConfig(
        name=name, vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", moe.get("moe_intermediate_size"),
                                  required=not moe)),
        num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 8192)),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)), **moe,
        **family)


def _longrope_from_gguf(tensor_names: dict, get, source: str) -> RopeScaling:
    """Phi-3's LongRoPE from its factor tensors, rope.scaling.original_context_length and
    rope.scaling.attn_factor (absent: transformers' sqrt(1 + ln(f) / ln(original)), f the context
    over the original length). llama.cpp picks the long factors by the context it is run with;
    this engine follows transformers' per-sequence choice (models/longrope.py)."""
    missing = [n for n in _LONGROPE_FACTORS if n not in tensor_names]
    if missing:
        raise ValueError(f"{source}: LongRoPE needs both factor tensors; {missing[0]} is missing")
    short, long = (dequantize_tensor(tensor_names[n]).reshape(-1) for n in _LONGROPE_FACTORS)
    original = int(get("rope.scaling.original_context_length", required=True))
    attention_factor = get("rope.scaling.attn_factor")
    if attention_factor is None:
        factor = int(get("context_length", original)) / original
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return RopeScaling(factor=1.0, original_max_position_embeddings=original,
                       rope_type="longrope", short_factor=tuple(short.tolist()),
                       long_factor=tuple(long.tolist()), attention_factor=float(attention_factor))


# llama.cpp's block counts of the 27B models, whose softmax scale it takes as
# 1 / sqrt(hidden / heads) (gemma_pytorch's query_pre_attn_scalar for them); other sizes use
# 1 / sqrt(head_dim).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_fields(reader: gguf.GGUFReader, arch: str, get, num_layers: int, hidden: int,
                  num_heads: int, head_dim: int, source: str) -> dict:
    """The ModelConfig fields of a gemma2 / gemma3 GGUF beyond the Llama ones."""
    window = get("attention.sliding_window")
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if pattern is None:
        pattern = 2 if arch == "gemma2" else 6
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{source}: {arch}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [int(pattern) == 0 or (i + 1) % int(pattern) != 0 for i in range(num_layers)]
    layer_types = tuple("sliding_attention" if s else "full_attention" for s in sliding)
    if window is None or not any(sliding):
        window, layer_types = None, ()
    scale = get("attention.scale")
    if scale is not None:
        scalar = _round6(1.0 / float(scale) ** 2)
    elif num_layers == _GEMMA_27B_LAYERS[arch]:
        scalar = float(hidden // num_heads)
    else:
        scalar = float(head_dim)
    soft_caps = {k: get(f"{k}_logit_softcapping") for k in ("attn", "final")}
    fields = dict(
        sliding_window=None if window is None else int(window), layer_types=layer_types,
        attn_logit_softcap=None if soft_caps["attn"] is None else float(soft_caps["attn"]),
        final_logit_softcap=None if soft_caps["final"] is None else float(soft_caps["final"]),
        query_pre_attn_scalar=scalar, hidden_act="gelu_tanh", sandwich_norms=True,
        embed_scale=True)
    if arch == "gemma3":
        fields["rope_local_theta"] = float(get("rope.freq_base_swa", 10000.0))
        if get("rope.scaling.type", "none") == "linear":
            fields["rope_scaling"] = RopeScaling(
                factor=float(get("rope.scaling.factor", required=True)), rope_type="linear")
    return fields


def dequantize_tensor(t) -> np.ndarray:
    """A GGUF ReaderTensor as a float32 numpy array in numpy (HF) dimension order.

    GGUF lists dimensions fastest-first, so a [in, out] GGUF shape is an [out, in] array.
    """
    if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"tensor {t.name!r} has unsupported type {t.tensor_type.name}")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    w = np.array(w, dtype=np.float32, copy=True)  # F32 comes back as a view of the file's memmap
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if w.shape != shape:
        raise ValueError(f"tensor {t.name!r} dequantized to shape {w.shape}, expected {shape}")
    return w


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving permutation of Q/K projection rows.

    llama.cpp: w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape),
    so row (h, i, j) of GGUF [n_heads, head_dim // 2, 2] is row (h, j, i) of HF.
    """
    head_dim = w.shape[0] // n_heads
    if head_dim * n_heads != w.shape[0] or head_dim % 2:
        raise ValueError(f"cannot un-permute {w.shape} for {n_heads} heads")
    return np.ascontiguousarray(
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(scaling: RopeScaling, head_dim: int, rope_theta: float) -> np.ndarray:
    """Per-frequency divisors of the rotary inverse frequencies under Llama 3 scaling
    (what llama.cpp stores in rope_freqs.weight): 1 for short wavelengths, `factor` for long
    ones, and a smooth interpolation in between."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = scaling.original_max_position_embeddings
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    smooth = (orig / wavelen - low) / (high - low)
    with np.errstate(divide="ignore"):  # only the medium band is used, where this is finite
        mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def rope_scaling_from_factors(factors: np.ndarray, head_dim: int, rope_theta: float,
                              original_context: Optional[int] = None,
                              source: str = "GGUF") -> Optional[RopeScaling]:
    """The Llama 3 RopeScaling whose rope factors equal `factors` (None if all are 1).

    Only the ratios low/orig and high/orig are observable, so original_max_position_embeddings
    is taken from metadata when present (else 8192) and the frequency factors fitted to it.
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape != (head_dim // 2,):
        raise ValueError(f"{source}: rope_freqs has {f.size} values, expected {head_dim // 2}")
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    factor = _short_float(f.max())
    orig = int(original_context or 8192)
    candidates = [RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=orig)]
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    is_one, is_max = f <= 1 + 1e-6, f >= factor * (1 - 1e-6)
    mid = ~is_one & ~is_max
    if mid.sum() >= 2:  # smooth = (orig / wavelen - low) / (high - low) is linear in 1 / wavelen
        smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(orig / wavelen[mid], smooth, 1)
        low = -intercept / slope
        candidates.append(RopeScaling(factor, _round6(low), _round6(low + 1 / slope), orig))
    elif is_one.any() and is_max.any() and not mid.any():
        # A sharp step: any boundaries between the last 1 and the first `factor` reproduce it.
        w1, w2 = wavelen[is_one].max(), wavelen[is_max].min()
        high_wl, low_wl = w1 + (w2 - w1) / 3, w1 + 2 * (w2 - w1) / 3
        candidates.append(RopeScaling(factor, _round6(orig / low_wl), _round6(orig / high_wl),
                                      orig))
    for c in candidates:
        if np.allclose(llama3_rope_factors(c, head_dim, rope_theta), f, rtol=1e-4, atol=1e-6):
            return c
    raise ValueError(f"{source}: rope_freqs.weight {np.round(f, 4).tolist()} matches no Llama 3 "
                     f"rope scaling")


def _hf_name(gguf_name: str, arch: str = "llama") -> Optional[str]:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{int(parts[1])}.{names[parts[2]]}"
    return None


def _field(reader: gguf.GGUFReader, key: str):
    """A metadata value (float32 values as their shortest decimal: 1e-05, not 9.99999974e-06)."""
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.contents()
    if f.types and f.types[0] == GGUFValueType.FLOAT32:
        value = _short_float(value)
    return value


def _short_float(x) -> float:
    return float(str(np.float32(x)))


def _round6(x: float) -> float:
    return float(f"{x:.6g}")
