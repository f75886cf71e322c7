"""KV-cache sizing from the memory the device has free (like vLLM's gpu_memory_utilization).

budget = memory_fraction x device memory - memory in use (the weights) - activation reserve
         (or a fixed number of bytes: kv_cache_memory, on any device)
pages  = budget // bytes of one page across all layers (K and V, and the scales of int8 / fp8
         pages)
"""
from __future__ import annotations

import dataclasses
import gc

import jax
import jax.numpy as jnp

from configs.model import ModelConfig
from models.kv_cache import kv_bytes_per_token
from ops.moe_matmul import TILE_ROWS, tile_chunk


# Share of a GPU's memory that jax's allocator takes at start (jax's own default, 0.75, leaves
# a quarter of the card to nothing); the KV cache then fills memory_fraction of this pool.
# The rest of the card holds the CUDA context, library handles and NCCL's buffers.
GPU_MEMORY_POOL_FRACTION = "0.95"
POOL_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                  "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")


def memory_pool_environment(environ) -> dict[str, str]:
    """The variables to add to `environ` so that jax's GPU allocator takes
    GPU_MEMORY_POOL_FRACTION of the card: none when the user already chose the pool (its
    fraction, preallocation or allocator)."""
    if any(name in environ for name in POOL_VARIABLES):
        return {}
    return {"XLA_CLIENT_MEM_FRACTION": GPU_MEMORY_POOL_FRACTION}


def memory_pool_hint(platform: str, environ) -> str | None:
    """A line for a GPU process whose jax allocator keeps its own default pool (the Python API:
    the scripts set GPU_MEMORY_POOL_FRACTION before jax starts), else None."""
    if platform != "gpu" or memory_pool_environment(environ) == {}:
        return None
    return (f"jax holds its default 75% of the GPU; set XLA_CLIENT_MEM_FRACTION="
            f"{GPU_MEMORY_POOL_FRACTION} before jax starts for a larger KV cache")


@dataclasses.dataclass(frozen=True)
class CachePlan:
    num_pages: int
    page_size: int
    bytes_per_page: int
    device_bytes: int
    in_use_bytes: int
    reserve_bytes: int
    max_model_len: int
    kv_dtype: str = ""
    fixed_bytes: int | None = None  # kv_cache_memory, when the budget was given

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def max_full_length_seqs(self) -> int:
        """Sequences of max_model_len tokens that fit at once."""
        return self.num_pages // -(-self.max_model_len // self.page_size)

    def summary(self) -> str:
        gib = 2**30
        source = (f"of a fixed {size(self.fixed_bytes)}" if self.fixed_bytes is not None
                  else f"device {self.device_bytes / gib:.1f} GiB, in use "
                       f"{self.in_use_bytes / gib:.2f} GiB, activation reserve "
                       f"{self.reserve_bytes / gib:.2f} GiB")
        return (f"KV cache ({self.kv_dtype}): {self.num_pages} pages x {self.page_size} tokens = "
                f"{self.num_pages * self.page_size} tokens, {size(self.cache_bytes)} "
                f"({source}); at most {self.max_full_length_seqs} sequences of "
                f"{self.max_model_len} tokens at once")


def size(num_bytes: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return (f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30
            else f"{num_bytes / 2**20:.1f} MiB")


def device_memory(device=None) -> tuple[int, int]:
    """(total bytes the device may allocate, bytes in use now).

    GPUs report both through memory_stats(); for the CPU the total is the host's available memory
    (MemAvailable) plus what jax already holds. Garbage is collected first: a dropped engine
    held in a reference cycle would otherwise count its KV cache as in use, and a second engine
    built in the same process would find no room.
    """
    gc.collect()
    device = device or jax.local_devices()[0]  # jax.devices()[0] may be another process's
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    in_use = sum(a.nbytes for a in jax.live_arrays())
    with open("/proc/meminfo") as f:
        available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
    return available_kib * 1024 + in_use, in_use


def activation_reserve_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                             dtype) -> int:
    """A generous bound of one step's temporaries: per-token hidden/MLP/qkv activations at
    float32 width, twice (XLA keeps a few alive at once), plus float32 logits and their sort for
    sampling, and the penalties' int32 count table (engine/penalty_counts.py) and a step's rows
    of it."""
    per_token = 4 * (3 * cfg.hidden_size + 2 * cfg.intermediate_size
                     + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    logits = 4 * cfg.vocab_size * max_num_seqs * 3
    penalty_counts = 4 * cfg.vocab_size * max_num_seqs * 2
    return (2 * per_token * max_num_batched_tokens + logits + penalty_counts + (256 << 20)
            + moe_reserve_bytes(cfg, max_num_batched_tokens))


def moe_reserve_bytes(cfg: ModelConfig, tokens: int) -> int:
    """A mixture layer's temporaries beyond a dense MLP's, for a step of `tokens`: each
    (token, expert) pair's row, gate-up and down products and their combine at float32 width
    (with the tiles form's padding), and one batched product's gathered experts in the tiles
    form (ops.moe_matmul.tile_chunk); 0 for a dense model."""
    if not cfg.is_moe:
        return 0
    hidden, gate_up = cfg.hidden_size, 2 * cfg.moe_intermediate_size
    rows = tokens * cfg.num_experts_per_tok + TILE_ROWS * cfg.num_experts
    chunk = tile_chunk(hidden, gate_up, -(-rows // TILE_ROWS))
    return 4 * rows * (3 * hidden + gate_up) + 4 * chunk * hidden * gate_up


def plan_kv_cache(cfg: ModelConfig, kv_dtype, page_size: int, max_model_len: int,
                  max_num_batched_tokens: int, max_num_seqs: int,
                  memory_fraction: float | None, device=None, fit_max_model_len: bool = True,
                  kv_cache_memory: int | None = None) -> CachePlan:
    """How many pages of `kv_dtype` (scales counted) fit in `kv_cache_memory` bytes if given,
    else in `memory_fraction` of the device; ValueError if not one sequence of max_model_len
    tokens (with fit_max_model_len; else if not one page: the caller then bounds its context by
    the pages there are)."""
    dtype = jnp.dtype(kv_dtype)
    bytes_per_page = kv_bytes_per_token(cfg, dtype) * page_size
    if kv_cache_memory is not None:
        if kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {kv_cache_memory}")
        total = in_use = reserve = 0
        budget, setting, knob = kv_cache_memory, f"kv_cache_memory={kv_cache_memory}", \
            "--kv_cache_memory"
    else:
        if memory_fraction is None or not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        total, in_use = device_memory(device)
        reserve = activation_reserve_bytes(cfg, max_num_batched_tokens, max_num_seqs, dtype)
        budget = int(total * memory_fraction) - in_use - reserve
        setting, knob = f"memory_fraction={memory_fraction}", "--memory_fraction"
    num_pages = max(budget // bytes_per_page, 0)
    plan = CachePlan(num_pages, page_size, bytes_per_page, total, in_use, reserve, max_model_len,
                     dtype.name, kv_cache_memory)
    if not fit_max_model_len and num_pages < 1:
        raise ValueError(f"{setting} leaves no room for a KV-cache page ({plan.summary()}): "
                         f"raise {knob}")
    needed = -(-max_model_len // page_size)
    if fit_max_model_len and num_pages < needed:
        raise ValueError(
            f"{setting} leaves room for {num_pages} KV-cache pages, but one sequence of "
            f"max_model_len={max_model_len} needs {needed} ({plan.summary()}): raise {knob} or "
            f"lower --max_model_len")
    return plan
