"""The engine's configuration and its defaults for the device it runs on (plain Python).

Fields left None take the device's default (`resolve_engine_config`): on a GPU (or TPU) the
fastest serving configuration measured (docs/PERFORMANCE.md, continuous batching on the H200:
256 sequences, 2048-token steps, asynchronous scheduling, asynchronous 8-step decode rounds with
mixed rounds, the KV cache in 90% of the device's memory, the model's own context as far as the
cache holds it); on the CPU small sizes that keep tests and the CPU demo quick.
"""
from __future__ import annotations

import dataclasses

PLATFORMS = ("cpu", "gpu", "tpu")
# KV-cache storage (ops.kv_quant.KV_CACHE_DTYPES): the model's dtype, bf16, or int8 / fp8 pages
# with a float32 scale per token and head.
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8")


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
    """What a None field of EngineConfig becomes on one kind of device."""

    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool
    num_decode_steps: int
    memory_fraction: float | None  # None: room for max_num_seqs full-length sequences
    max_model_len: int | None  # the longest default context; None: the model's own


# The fastest serving configuration measured on the H200 (docs/PERFORMANCE.md): asynchronous
# scheduling hides the host's work, and 8-step rounds amortize it over more model steps.
ACCELERATOR_DEFAULTS = DeviceDefaults(max_num_seqs=256, max_num_batched_tokens=2048,
                                      async_scheduling=True, num_decode_steps=8,
                                      memory_fraction=0.9, max_model_len=None)
CPU_DEFAULTS = DeviceDefaults(max_num_seqs=8, max_num_batched_tokens=512, async_scheduling=False,
                              num_decode_steps=1, memory_fraction=None, max_model_len=2048)


def device_defaults(platform: str) -> DeviceDefaults:
    """The defaults of a jax platform name ('cpu', 'gpu' or 'tpu')."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}: expected one of {PLATFORMS}")
    return CPU_DEFAULTS if platform == "cpu" else ACCELERATOR_DEFAULTS


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes and scheduling; a None field takes the device's default
    (`resolve_engine_config`; LLMEngine resolves its config when it is built).

    The KV cache has `num_pages` pages if given; else as many as fit in `kv_cache_memory`
    bytes if given; else, with `memory_fraction`, as many as fit in that fraction of the
    device's memory (engine/memory.py); else enough for max_num_seqs sequences of
    max_model_len tokens. `kv_cache_dtype` is its storage (KV_CACHE_DTYPES).
    """

    # Longest sequence (prompt + output). Default: the model's context, bounded on a GPU by what
    # the KV cache holds and on the CPU by 2048.
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # default 256 on a GPU, 8 on the CPU
    max_num_batched_tokens: int | None = None  # a step's token budget: 2048 / 512
    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float | None = None  # default 0.9 on a GPU unless num_pages is given
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "bf16", "int8" or "fp8"
    kv_cache_memory: int | None = None  # the cache's bytes (per device), on any device
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    # Schedule step n+1 while step n runs (see LLMEngine.step), on one device or a mesh, with
    # single steps or multi-step rounds; speculative decoding runs synchronously.
    # Default: on on a GPU, off on the CPU.
    async_scheduling: bool | None = None
    # Decode steps per program when every running request decodes (multi-step scheduling, as
    # vLLM's --num-scheduler-steps): the host schedules, dispatches and reads tokens once per
    # this many steps, and sequences that stop within them drop their extra tokens. 1: off.
    # Logprobs, speculation and a sharded runner take single steps. Default: 8 on a GPU, 1 on
    # the CPU.
    num_decode_steps: int | None = None
    # With rounds: a step with prefill chunks is followed, in the same program, by
    # num_decode_steps - 1 decode steps of its rows whose prompts it completes or which decode
    # (engine/multi_step.py), when more than half of the sequence slots' bucket is scheduled and,
    # while requests wait, fewer than 1/16 of the slots are free. It halves the engine's Python
    # per model step (measured faster on the H200: docs/PERFORMANCE.md).
    mixed_rounds: bool = True
    # Programs compiled at once ahead of time (engine/warmup.py). Default: the host's cores, at
    # most 16; fewer on a host short of memory. A large mixture starts no faster with 1
    # (docs/PERFORMANCE.md, Start-up).
    compile_threads: int | None = None

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_pages",
                     "num_decode_steps", "kv_cache_memory", "compile_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")

    @property
    def resolved(self) -> bool:
        """Whether every device-dependent field is set."""
        return None not in (self.max_model_len, self.max_num_seqs, self.max_num_batched_tokens,
                            self.async_scheduling, self.num_decode_steps)

    def summary(self) -> str:
        """One line of the settings (of a resolved config)."""
        rounds = (f"{self.num_decode_steps}-step decode rounds"
                  f"{' with mixed rounds' if self.mixed_rounds else ''}"
                  if self.num_decode_steps > 1 else "single decode steps")
        cache = (f"{self.num_pages} KV pages" if self.num_pages is not None else
                 f"KV cache in {self.kv_cache_memory / 2**20:.1f} MiB"
                 if self.kv_cache_memory is not None else
                 f"KV cache in {self.memory_fraction:.0%} of device memory"
                 if self.memory_fraction is not None else "KV cache for every sequence at full "
                 "length")
        return (f"engine: {self.max_num_seqs} sequences, {self.max_num_batched_tokens}-token "
                f"steps, context {self.max_model_len} tokens, asynchronous scheduling "
                f"{'on' if self.async_scheduling else 'off'}, {rounds}, {cache} "
                f"({self.kv_cache_dtype})")


def resolve_engine_config(engine_cfg: EngineConfig, model_context: int, platform: str,
                          kv_tokens: int | None = None) -> EngineConfig:
    """`engine_cfg` with each None field set to the default of `platform` ('cpu', 'gpu',
    'tpu').

    model_context: the model's own context length (ModelConfig.max_position_embeddings).
    kv_tokens: the tokens the planned KV cache holds (one data shard's), which bounds a default
    max_model_len; None before the cache is planned. An explicit max_model_len longer than the
    model's context is a ValueError.
    """
    d = device_defaults(platform)
    if engine_cfg.max_model_len is not None:
        if engine_cfg.max_model_len > model_context:
            raise ValueError(f"max_model_len={engine_cfg.max_model_len} exceeds the model's "
                             f"context of {model_context} tokens")
        max_model_len = engine_cfg.max_model_len
    else:
        max_model_len = min(model_context, d.max_model_len or model_context,
                            kv_tokens or model_context)
    memory_fraction = engine_cfg.memory_fraction
    if memory_fraction is None and engine_cfg.num_pages is None \
            and engine_cfg.kv_cache_memory is None:
        memory_fraction = d.memory_fraction
    budget = engine_cfg.max_num_batched_tokens
    if budget is None:  # without chunked prefill a whole prompt must fit one step
        budget = (d.max_num_batched_tokens if engine_cfg.enable_chunked_prefill
                  else max(d.max_num_batched_tokens, max_model_len))
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return dataclasses.replace(
        engine_cfg, max_model_len=max_model_len,
        max_num_seqs=pick(engine_cfg.max_num_seqs, d.max_num_seqs),
        max_num_batched_tokens=budget, memory_fraction=memory_fraction,
        async_scheduling=pick(engine_cfg.async_scheduling, d.async_scheduling),
        num_decode_steps=pick(engine_cfg.num_decode_steps, d.num_decode_steps))
