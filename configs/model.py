"""Model configurations: one frozen, hashable dataclass and named presets.

A `ModelConfig` is passed to jitted functions as a static argument, so it must be
hashable; every field is a plain Python scalar or a tuple.
"""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style rope frequency scaling ("rope_type": "llama3" in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2)."""

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
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
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

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")

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
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


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

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (SMOLLM2_135M, LLAMA32_1B, LLAMA31_8B, QWEN25_05B,
                        TINY_LLAMA, TINY_LLAMA31, TINY_QWEN2)
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
    if "eos_token_ids" in d:
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelConfig(**d)
