"""Flags and helpers shared by the absl entry points in scripts/."""
from __future__ import annotations

import os
import sys

from absl import flags

DTYPES = ("float32", "bfloat16", "float16")


def define_model_flags() -> None:
    """--model, --dtype, --random_weights, --seed."""
    flags.DEFINE_string("model", "smollm2-135m",
                        "Preset name, GGUF file, HF checkpoint directory or orbax directory.")
    flags.DEFINE_enum("dtype", None, DTYPES,
                      "Weight and activation dtype (default: float32 on CPU, bfloat16 on GPU).")
    flags.DEFINE_bool("random_weights", False,
                      "Use random weights of the preset's real shapes (benchmarks, no checkpoint).")
    flags.DEFINE_integer("seed", 0, "Seed for random weights and for unseeded sampling.")


def define_engine_flags() -> None:
    """--max_model_len, --max_num_seqs, --page_size, --num_pages."""
    flags.DEFINE_integer("max_model_len", None,
                         "Longest sequence (prompt + output) served (default: the model's context, "
                         "at most 2048).")
    flags.DEFINE_integer("max_num_seqs", 8, "Most sequences decoded together.")
    flags.DEFINE_integer("page_size", 16, "Tokens per KV-cache page.")
    flags.DEFINE_integer("num_pages", None,
                         "KV-cache pages (default: max_num_seqs full-length sequences).")


def resolve_dtype(name: str | None):
    """The jnp dtype for --dtype, defaulting by backend."""
    import jax
    import jax.numpy as jnp
    if name is None:
        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return jnp.dtype(name)


def engine_config_from_flags(FLAGS, cfg):
    """The EngineConfig of the engine flags for model config `cfg`."""
    from engine.llm_engine import EngineConfig
    max_model_len = FLAGS.max_model_len or min(2048, cfg.max_position_embeddings)
    return EngineConfig(max_model_len=max_model_len, max_num_seqs=FLAGS.max_num_seqs,
                        page_size=FLAGS.page_size, num_pages=FLAGS.num_pages, seed=FLAGS.seed)


def fail(message: str) -> None:
    """Prints one clear error line and exits with status 1."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


# What bad input raises inside the project: each carries a message that names the problem.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, RuntimeError)


flags.DEFINE_string("compilation_cache_dir", os.path.expanduser("~/.cache/pallasite/jax"),
                    "jax persistent compilation cache ('' disables): a second start is faster.")


def setup_jax() -> None:
    """Quiets jax's backend probing and turns on the persistent compilation cache."""
    import logging

    import jax
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    if flags.FLAGS.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", flags.FLAGS.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
