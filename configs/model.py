"""Model configurations: one frozen, hashable dataclass and named presets.

A `ModelConfig` is passed to jitted functions as a static argument, so it must be
hashable; every field is a plain Python scalar or a tuple.
"""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling: Llama-3.1's ("rope_type": "llama3" in HF configs, the default),
    linear ("linear": every frequency divided by `factor`; Gemma 3's global layers) or Phi-3's
    LongRoPE ("longrope": frequency i divided by short_factor[i] or long_factor[i], the long
    ones where a sequence is longer than original_max_position_embeddings, and attention logits
    times attention_factor ** 2; models.llama.rope_inv_freq)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    short_factor: tuple[float, ...] = ()  # longrope: one divisor per frequency [head_dim / 2]
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # longrope: cos and sin (so q and k) times this

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear", "longrope"):
            raise ValueError(f"RopeScaling.rope_type {self.rope_type!r} is not supported "
                             "(only 'llama3', 'linear' and 'longrope')")
        for name in ("short_factor", "long_factor"):  # hashable, also when built from JSON
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.rope_type == "longrope" and not (
                self.short_factor and len(self.short_factor) == len(self.long_factor)):
            raise ValueError(f"RopeScaling: longrope needs short_factor and long_factor of one "
                             f"length, got {len(self.short_factor)} and {len(self.long_factor)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder of the Llama family and its relatives (Llama 2/3,
    SmolLM2, Qwen2/3, Mistral, Gemma 2 and 3, Phi-3, and the mixtures of experts Mixtral and
    Qwen3-MoE), switched by the fields below."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    # RoPE base of the sliding-window layers, which take no scaling (Gemma 3); None: rope_theta
    # and rope_scaling on every layer.
    rope_local_theta: Optional[float] = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3)
    # Keys a query sees: positions > its own - sliding_window, on the layers `layer_types` marks
    # "sliding_attention" (every layer when layer_types is empty: Mistral); None: full attention.
    sliding_window: Optional[int] = None
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" or "full_attention"
    attn_logit_softcap: Optional[float] = None  # attention logits -> cap * tanh(logits / cap)
    final_logit_softcap: Optional[float] = None  # the same on the output logits (Gemma 2)
    query_pre_attn_scalar: Optional[float] = None  # softmax scale 1/sqrt(this), not head_dim
    hidden_act: str = "silu"  # the gate's activation: "silu" or "gelu_tanh" (GeGLU, Gemma)
    # Gemma's four norms per layer: attention and MLP outputs are normed before their residual
    # add (post_attention_layernorm, post_feedforward_layernorm), the MLP input by
    # pre_feedforward_layernorm.
    sandwich_norms: bool = False
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # One [hidden, (H + 2 KVH) * D] q/k/v kernel and one [hidden, 2 I] gate/up kernel per layer
    # instead of five (models.llama.fuse_projections; fewer, larger matmuls in a decode step).
    # Checkpoints store the unfused layout; fusion happens after loading, on one device.
    fused_projections: bool = False
    # The layers' four products (fused q/k/v and gate/up) stored [out, in]
    # (models.llama.transpose_for_gemv, after loading, on one device): steps of at most
    # ops.gemv.MAX_ROWS tokens run each product as one kernel with its RMSNorm, SiLU x up and
    # residual add inside (ops/gemv.py); larger steps multiply by the transposes in XLA.
    gemv_layers: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (models/moe.py): every layer's MLP is num_experts experts of width
    # moe_intermediate_size, each token weighted over the num_experts_per_tok experts of the
    # highest router probability; 0 experts: the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # The chosen experts' probabilities divided by their sum (Mixtral always; Qwen3-MoE by its
    # config), else the softmax over all experts as they are.
    norm_topk_prob: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelConfig.hidden_act {self.hidden_act!r} is not supported "
                             "(only 'silu' and 'gelu_tanh')")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"ModelConfig.layer_types: unknown layer types {sorted(unknown)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size >= 1):
            raise ValueError(f"ModelConfig: {self.num_experts} experts need 1 <= "
                             f"num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                             f"and moe_intermediate_size >= 1 ({self.moe_intermediate_size})")

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of decoder layer `layer`, or None where it attends to every key."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> Optional[float]:
        """The softmax scale when it is not head_dim ** -0.5, else None: 1 / sqrt of
        query_pre_attn_scalar, times LongRoPE's attention_factor squared (transformers multiplies
        cos and sin by it, so both q and k)."""
        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope" and s.attention_factor != 1.0:
            scale = (self.head_dim ** -0.5 if scale is None else scale) * s.attention_factor ** 2
        return scale

    @property
    def is_moe(self) -> bool:
        """Whether the layers' MLPs are mixtures of experts (models/moe.py)."""
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (the grouped-query attention ratio)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Number of weights (embedding counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        mlp = (3 * h * self.moe_intermediate_size * self.num_experts + h * self.num_experts
               if self.is_moe else 3 * h * i)
        layer = attn + mlp + (4 if self.sandwich_norms else 2) * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def num_active_params(self) -> int:
        """Weights one token reads: num_params with only its num_experts_per_tok experts."""
        if not self.is_moe:
            return self.num_params()
        idle = self.num_experts - self.num_experts_per_tok
        return (self.num_params()
                - self.num_layers * idle * 3 * self.hidden_size * self.moe_intermediate_size)


SMOLLM2_135M = ModelConfig(
    name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_ids=(2,))

LLAMA32_1B = ModelConfig(
    name="llama3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
    rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0), rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))

LLAMA31_8B = ModelConfig(
    name="llama3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
    rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0), rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))

QWEN25_05B = ModelConfig(
    name="qwen2.5-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True,
    bos_token_id=None, eos_token_ids=(151645, 151643))

QWEN3_8B = ModelConfig(
    name="qwen3-8b", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
    bos_token_id=None, eos_token_ids=(151645, 151643))

MISTRAL_7B = ModelConfig(  # v0.1: the release with a 4096-token sliding window
    name="mistral-7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=4096,
    bos_token_id=1, eos_token_ids=(2,))

GEMMA2_9B = ModelConfig(
    name="gemma-2-9b", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
    num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, max_position_embeddings=8192,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=4096,
    layer_types=("sliding_attention", "full_attention") * 21, attn_logit_softcap=50.0,
    final_logit_softcap=30.0, query_pre_attn_scalar=256.0, hidden_act="gelu_tanh",
    sandwich_norms=True, embed_scale=True, bos_token_id=2, eos_token_ids=(1, 107))

# Tiny test configs: one per architectural variant, small enough for CPU tests.
TINY_LLAMA = ModelConfig(
    name="tiny-llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))

TINY_LLAMA31 = ModelConfig(
    name="tiny-llama31", vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2,
    num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=1024, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=256),
    tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))

TINY_QWEN2 = ModelConfig(
    name="tiny-qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=1, head_dim=16, max_position_embeddings=512, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True, eos_token_ids=(2,))

GEMMA3_12B = ModelConfig(
    name="gemma-3-12b", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
    num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, max_position_embeddings=131072,
    rope_theta=1000000.0, rope_scaling=RopeScaling(factor=8.0, rope_type="linear"),
    rope_local_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
    sliding_window=1024, layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 8,
    query_pre_attn_scalar=256.0, hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=True,
    bos_token_id=2, eos_token_ids=(1, 106))

MIXTRAL_8X7B = ModelConfig(
    name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True, bos_token_id=1,
    eos_token_ids=(2,))

QWEN3_30B_A3B = ModelConfig(
    name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    bos_token_id=None, eos_token_ids=(151645, 151643))

PHI3_MINI = ModelConfig(  # Phi-3-mini-4k: the checkpoint's fused qkv and gate/up are split
    name="phi-3-mini", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
    num_layers=32, num_heads=32, num_kv_heads=32, head_dim=96, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=2047,
    bos_token_id=1, eos_token_ids=(32000, 32001, 32007))

# The families' distinctive features switched on: untied heads, a sliding window shorter than
# the golden sequences (12 prompt + 16 generated tokens), soft caps that bind.
TINY_QWEN3 = ModelConfig(
    name="tiny-qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True, bos_token_id=1,
    eos_token_ids=(2,))

TINY_MISTRAL = ModelConfig(
    name="tiny-mistral", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
    tie_word_embeddings=False, sliding_window=5, bos_token_id=1, eos_token_ids=(2,))

TINY_GEMMA2 = ModelConfig(
    name="tiny-gemma2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=5,
    layer_types=("sliding_attention", "full_attention"), attn_logit_softcap=2.0,
    final_logit_softcap=8.0, query_pre_attn_scalar=24.0, hidden_act="gelu_tanh",
    sandwich_norms=True, embed_scale=True, bos_token_id=1, eos_token_ids=(2,))

TINY_GEMMA3 = ModelConfig(
    name="tiny-gemma3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
    rope_theta=1000000.0, rope_scaling=RopeScaling(factor=4.0, rope_type="linear"),
    rope_local_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
    sliding_window=5, layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    query_pre_attn_scalar=24.0, hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=True,
    bos_token_id=1, eos_token_ids=(2,))

TINY_PHI3 = ModelConfig(
    name="tiny-phi3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
    tie_word_embeddings=False, sliding_window=5, bos_token_id=1, eos_token_ids=(2,))

# Mixtures of experts: Mixtral (renormalised top-2 of 4) and Qwen3-MoE (top-3 of 8, the
# probabilities as they are, as the Qwen3-MoE config's default norm_topk_prob=False gives).
TINY_MIXTRAL = ModelConfig(
    name="tiny-mixtral", vocab_size=256, hidden_size=64, intermediate_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
    rope_theta=1000000.0, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, norm_topk_prob=True, bos_token_id=1, eos_token_ids=(2,))

TINY_QWEN3_MOE = ModelConfig(
    name="tiny-qwen3-moe", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
    bos_token_id=1, eos_token_ids=(2,))

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (SMOLLM2_135M, LLAMA32_1B, LLAMA31_8B, QWEN25_05B, QWEN3_8B, MISTRAL_7B,
                        GEMMA2_9B, GEMMA3_12B, PHI3_MINI, MIXTRAL_8X7B, QWEN3_30B_A3B,
                        TINY_LLAMA, TINY_LLAMA31, TINY_QWEN2, TINY_QWEN3, TINY_MISTRAL,
                        TINY_GEMMA2, TINY_GEMMA3, TINY_PHI3, TINY_MIXTRAL, TINY_QWEN3_MOE)
}
PRESETS["tiny"] = TINY_LLAMA


def get_preset(name: str) -> ModelConfig:
    """Returns the preset called `name`, or raises ValueError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: "
                         f"{', '.join(sorted(PRESETS))}") from None


def config_to_dict(cfg: ModelConfig) -> dict:
    """A JSON-ready dict of `cfg` (inverse: config_from_dict)."""
    return dataclasses.asdict(cfg)


# Fields that older checkpoints store and that no longer exist (their value there is always the
# old default, false): skipped when a stored config is read.
RETIRED_FIELDS = ("fold_norm_scale",)


def config_from_dict(d: dict) -> ModelConfig:
    """Rebuilds a ModelConfig from `config_to_dict` output; unknown keys raise ValueError."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    d = {k: v for k, v in d.items() if k not in RETIRED_FIELDS}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    for key in ("eos_token_ids", "layer_types"):
        if key in d:
            d[key] = tuple(d[key])
    return ModelConfig(**d)
