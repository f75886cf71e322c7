"""Flags and helpers shared by the absl entry points in scripts/."""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from engine import warm_start
from engine.api import default_dtype, load_prepared
from engine.compile_stats import CompileStats, compile_stats, count_compiles
from engine.device_tables import tables_on_device
from engine.engine_config import KV_CACHE_DTYPES, EngineConfig, resolve_engine_config
from engine.memory import memory_pool_environment
from engine.speculative import SpecConfig
from engine.warmup import split_first
from models.prepare import check_preparation, prepare_for_device
from ops.attention_tiles import kernel_takes_head_dim
from ops.backends import TABLES, active_tags, describe_kernels
from ops.kernel_choice import KernelBackends
from ops.quant_wgmma import on_hopper
from quant.model import QuantConfig, quantize_loaded

DTYPES = ("float32", "bfloat16", "float16")


def write_json(path: str, obj) -> None:
    """Writes obj as JSON to `path` through a temporary file and a rename, so that a run cut
    short (a time limit, a hung kernel) leaves the last complete file, never half of one.
    Benchmarks call it after every row."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=str)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # the dump failed: the previous file stands, no leftovers
            os.remove(tmp)


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
    """Engine sizing and batching flags; unset ones take the device's default
    (engine/engine_config.py: the fastest measured serving configuration on a GPU, small sizes
    on the CPU). Also --print_kernels."""
    flags.DEFINE_bool("print_kernels", False,
                      "Print at start-up the table of the kernels the engine runs per op family "
                      "(ops.backends.describe_kernels: platform, layout, dtype, rows, "
                      "implementation).")
    flags.DEFINE_integer("max_model_len", None,
                         "Longest sequence (prompt + output) served (default: the model's "
                         "context; on a GPU bounded by what the KV cache holds, on the CPU by "
                         "2048).")
    flags.DEFINE_integer("max_num_seqs", None,
                         "Most sequences running at once (default: 256 on a GPU, 8 on the CPU).")
    flags.DEFINE_integer("max_num_batched_tokens", None,
                         "Most tokens computed in one step, longer prompts are chunked (default: "
                         "2048 on a GPU, 512 on the CPU).")
    flags.DEFINE_integer("page_size", 16, "Tokens per KV-cache page.")
    flags.DEFINE_integer("num_pages", None, "KV-cache pages (overrides --memory_fraction).")
    flags.DEFINE_float("memory_fraction", None,
                       "Size the KV cache to fill this fraction of device memory (default: 0.9 "
                       "on a GPU; on the CPU, room for max_num_seqs full-length sequences).")
    define_kv_cache_dtype_flag()
    flags.DEFINE_string("kv_cache_memory", None,
                        "Bytes of the KV cache per device, e.g. 8GiB, 512MiB or 1000000 "
                        "(overrides --memory_fraction; works on the CPU too): fixes the cache's "
                        "memory, so a smaller --kv_cache_dtype holds more tokens.")
    flags.DEFINE_bool("enable_prefix_caching", True, "Reuse cached pages of shared prefixes.")
    flags.DEFINE_bool("enable_chunked_prefill", True, "Split long prompts across steps.")
    flags.DEFINE_bool("async_scheduling", None,
                      "Schedule and launch the next step while the device runs the current one "
                      "(host work hides behind device work); speculation and penalties run "
                      "synchronously (default: on on a GPU, off on the CPU).")
    flags.DEFINE_integer("num_decode_steps", None,
                         "Decode steps per program while every running request decodes "
                         "(multi-step scheduling: the host works once per this many steps; "
                         "with --async_scheduling rounds overlap too). 1: off (default: 8 on a "
                         "GPU, 1 on the CPU).")
    flags.DEFINE_bool("mixed_rounds", True,
                      "With --num_decode_steps: run a step with prefill chunks and then "
                      "num_decode_steps - 1 decode steps of its rows in one program, when more "
                      "than half of the sequence slots are scheduled (--nomixed_rounds: such "
                      "steps run alone).")
    flags.DEFINE_integer("compile_threads", None,
                         "Programs compiled at once at start-up (default: the host's cores, at "
                         "most 16). Fewer on a host short of memory.")


def define_kv_cache_dtype_flag() -> None:
    """--kv_cache_dtype (engine.engine_config.KV_CACHE_DTYPES)."""
    flags.DEFINE_enum("kv_cache_dtype", "auto", list(KV_CACHE_DTYPES),
                      "KV-cache storage: auto (the model's dtype), bf16, or int8 / fp8 "
                      "(float8_e4m3fn) pages with a float32 scale per token and head: about "
                      "half the bytes of bf16.")


BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
              "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | None) -> int | None:
    """'8GiB', '512MiB', '2GB', '1000000' -> bytes (None stays None); ValueError otherwise."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in BYTE_UNITS:
        raise ValueError(f"--kv_cache_memory={text!r} must be a number of bytes with an optional "
                         f"unit ({', '.join(u for u in BYTE_UNITS if u)})")
    return int(float(match.group(1)) * BYTE_UNITS[unit])


def define_quant_flags() -> None:
    """--group_size, --symmetric, --act_order, --quantize_lm_head, --calib_text, --calib_tokens,
    --calib_seq_len."""
    flags.DEFINE_integer("group_size", 128,
                         "INT4 group size along the input dim (<= 0: per output channel).")
    flags.DEFINE_bool("symmetric", False, "INT4: symmetric grid (no offsets); default asymmetric.")
    flags.DEFINE_bool("act_order", False, "GPTQ: quantize input channels by decreasing activity.")
    flags.DEFINE_bool("quantize_lm_head", False,
                      "Also quantize an untied output head (RTN with the method's bits and "
                      "group size; an error for a model whose head is its embedding).")
    flags.DEFINE_string("calib_text", None,
                        "UTF-8 calibration text for GPTQ / AWQ (default: the built-in text of "
                        "quant/calibration.py, held apart from eval_ppl's default text).")
    flags.DEFINE_integer("calib_tokens", 16384, "Calibration tokens (GPTQ, AWQ).")
    flags.DEFINE_integer("calib_seq_len", 512, "Tokens per calibration row.")


def quant_config_from_flags(method: str) -> QuantConfig:
    """The QuantConfig of `method` and the quantization flags (quant/model.py)."""
    f = flags.FLAGS
    return QuantConfig(method, group_size=f.group_size, symmetric=f.symmetric,
                       act_order=f.act_order, lm_head=f.quantize_lm_head)


def quantize_from_flags(loaded, method: str) -> dict:
    """Quantizes loaded.model in place with `method` and the quantization flags (quant/model.py).

    Returns the settings to store with a checkpoint.
    """
    f = flags.FLAGS
    return quantize_loaded(loaded, quant_config_from_flags(method), f.calib_text, f.calib_tokens,
                           f.calib_seq_len)


def resolve_dtype(name: str | None):
    """The jnp dtype for --dtype, defaulting by backend (engine.api.default_dtype)."""
    return default_dtype(jax.default_backend()) if name is None else jnp.dtype(name)


def engine_config_from_flags(FLAGS, cfg):
    """The EngineConfig of the engine flags for model config `cfg`, resolved for this process's
    jax backend (engine.engine_config.resolve_engine_config), except an unset --max_model_len:
    it stays None, for LLMEngine to bound the model's context by the KV cache it plans."""
    requested = EngineConfig(max_model_len=FLAGS.max_model_len, max_num_seqs=FLAGS.max_num_seqs,
                             max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                             page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
                             memory_fraction=FLAGS.memory_fraction,
                             kv_cache_dtype=FLAGS.kv_cache_dtype,
                             kv_cache_memory=parse_bytes(FLAGS.kv_cache_memory),
                             enable_prefix_caching=FLAGS.enable_prefix_caching,
                             enable_chunked_prefill=FLAGS.enable_chunked_prefill, seed=FLAGS.seed,
                             async_scheduling=FLAGS.async_scheduling,
                             num_decode_steps=FLAGS.num_decode_steps,
                             mixed_rounds=FLAGS.mixed_rounds,
                             compile_threads=FLAGS.compile_threads)
    resolved = resolve_engine_config(requested, cfg.max_position_embeddings,
                                     jax.default_backend())
    return dataclasses.replace(resolved, max_model_len=FLAGS.max_model_len)


def fail(message: str) -> None:
    """Prints one clear error line and exits with status 1."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


# What bad input raises inside the project: each carries a message that names the problem.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, RuntimeError)


flags.DEFINE_string("compilation_cache_dir", os.path.expanduser("~/.cache/pallasite/jax"),
                    "jax persistent compilation cache: a second start is faster ('': jax's own "
                    "setting, off unless JAX_COMPILATION_CACHE_DIR names a directory).")


flags.DEFINE_bool("exhaustive_gemm_search", False,
                  "On GPU, XLA tries every Triton tiling of each matrix product when it "
                  "autotunes a program (--xla_gpu_exhaustive_tiling_search): decode steps run "
                  "a few percent faster, but programs compile several times longer (the "
                  "persistent compilation cache keeps a second start fast). On in "
                  "scripts.bench.decode.")


def add_xla_flag(name: str, value) -> None:
    """Appends --name=value to XLA_FLAGS unless the variable sets `name` already (the user's
    setting wins); call before jax's backend starts."""
    current = os.environ.get("XLA_FLAGS", "")
    if name not in current:
        os.environ["XLA_FLAGS"] = f"{current} {name}={value}".strip()


def set_xla_flags() -> None:
    """The XLA flags the scripts' flags ask for (--exhaustive_gemm_search); before jax's
    backend starts."""
    if flags.FLAGS.exhaustive_gemm_search:
        add_xla_flag("--xla_gpu_exhaustive_tiling_search", "true")


def setup_jax() -> None:
    """Sets the XLA flags of the scripts' flags and the GPU memory pool
    (memory_pool_environment), quiets jax's backend probing, turns on the
    persistent compilation cache and counts compiles (engine.compile_stats); call before jax's
    backend starts. Every program is cached, however fast it compiled, so that a second start
    of the same configuration loads them all."""
    set_xla_flags()
    os.environ.update(memory_pool_environment(os.environ))
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    count_compiles()
    if flags.FLAGS.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", flags.FLAGS.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def startup_summary(seconds: float, since: CompileStats | None = None) -> str:
    """'ready in S s; N programs: C compiled, L loaded from the compilation cache (T s of
    compiling, summed over the programs)': the programs counted since the snapshot `since`
    (default: since start-up)."""
    stats = compile_stats() - (since or CompileStats())
    cache = "" if jax.config.jax_compilation_cache_dir else " (compilation cache off)"
    return f"ready in {seconds:.1f}s; {stats.describe()}{cache}"


def warmup_for_serving(engine, background: bool) -> list:
    """Compiles, with progress, the programs a server needs before it listens: with
    `background` (and a runner that compiles ahead of time) those of engine.warmup.split_first,
    else every reachable one. Returns the programs left to engine.compile_in_background.

    With `background`, a configuration that has started before on this compilation cache
    (engine/warm_start.py) compiles nothing before it listens: its first programs load in the
    background, a load taking a fraction of a second even when a step reaches the program
    first, where loading them all before listening took most of a warm start (8 of 12 s for
    llama3.2-1b on an H100), tracing each program to find its cache key."""
    programs = engine.warmup_programs()
    first, later = programs, []
    cache_dir = jax.config.jax_compilation_cache_dir
    key = None
    if background and engine.runner.compiles_ahead:
        first, later = split_first(programs, engine.engine_cfg.page_size)
        key = warm_start.fingerprint(engine, first) if cache_dir else None
        if key is not None and warm_start.started_before(cache_dir, key):
            print(f"compilation cache warm: {len(first)} first programs load in the "
                  "background", file=sys.stderr, flush=True)
            first, later, key = [], first + later, None
    # the samplers and the device tables' scatter always: small programs, loaded when warm
    engine.warmup(programs=first, progress=print_progress("compiling", engine.warmup_threads))
    if key is not None:
        warm_start.mark_started(cache_dir, key)
    return later


def freeze_startup_objects() -> None:
    """Takes every object alive after start-up (the model's modules, the engine, jax's compiled
    programs) out of the cyclic garbage collector's scans (`gc.freeze`, as vLLM does after
    start-up), so that full collections during serving walk only what serving made. Objects
    made later are collected as before."""
    gc.collect()
    gc.freeze()


def progress_line(label: str, done: int, total: int, elapsed: float,
                  at_once: int = 1) -> str:
    """'label done/total (elapsed s, ...)': until the end, the time left if the rest go at the
    average pace; with `at_once` jobs side by side, only once that many have finished (the
    first to finish are the cheapest, and the rest end together), else how many run at once."""
    if done >= total or done < 1:
        return f"{label} {done}/{total} ({elapsed:.1f}s)"
    if done < at_once:
        return f"{label} {done}/{total} ({elapsed:.1f}s, {min(at_once, total)} at once)"
    left = elapsed / done * (total - done)
    return f"{label} {done}/{total} ({elapsed:.1f}s, about {left:.0f}s left)"


def print_progress(label: str, at_once: int = 1):
    """A progress callback (done, total) that rewrites one line on stderr (`progress_line`)."""
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        line = progress_line(label, done, total, time.perf_counter() - start, at_once)
        print(f"\r{line:<60}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return report


def define_speculative_flags() -> None:
    """--speculative, --draft_model, --num_speculative_tokens, --ngram_min/max, --spec_max_batch."""
    flags.DEFINE_enum("speculative", "none", ["none", "ngram", "draft"],
                      "Speculative decoding: n-gram prompt lookup or a draft model.")
    flags.DEFINE_string("draft_model", None, "Draft model (any --model form) for --speculative=draft.")
    flags.DEFINE_integer("num_speculative_tokens", 4, "Most tokens proposed per step.")
    flags.DEFINE_integer("ngram_min", 1, "Shortest n-gram matched by the n-gram proposer.")
    flags.DEFINE_integer("ngram_max", 4, "Longest n-gram matched by the n-gram proposer.")
    flags.DEFINE_integer("spec_max_batch", 16, "No speculation in steps with more running requests.")


def define_fusion_flags() -> None:
    """--fuse_projections and --gemv_layers: tri-state (unset: auto, models/prepare.py)."""
    flags.DEFINE_bool("gemv_layers", None,
                      "Store each layer's fused weights transposed so that batch-1 decode steps "
                      "run each product as one Pallas kernel with its RMSNorm, SiLU x up and "
                      "residual add inside (ops/gemv.py; models.llama.transpose_for_gemv), and "
                      "quantized products of more rows the Hopper kernel (ops/quant_wgmma.py, "
                      "which reads codes stored [out, in] only): faster batch-1 decode. "
                      "Needs fused projections, float, INT8 or INT4 (not act-order) weights and "
                      "one device; the kernels run for bf16 activations on a GPU. Default auto: "
                      "on for INT8 / INT4 models on one Hopper GPU, off otherwise.")
    flags.DEFINE_bool("fuse_projections", None,
                      "Fuse each layer's q/k/v and gate/up kernels into one matmul each after "
                      "loading (and quantizing); same tokens, fewer and larger matmuls. Default "
                      "auto: on on a GPU without --tp/--dp, off on the CPU and with a mesh. "
                      "Forcing it on with a mesh is an error (the sharding rules know only the "
                      "unfused weights).")


def check_fusion(mesh) -> None:
    """Fails early (ValueError) when --fuse_projections / --gemv_layers cannot apply to `mesh`:
    call it right after parallel.setup_parallel(), before loading."""
    check_preparation(jax.default_backend(), mesh, flags.FLAGS.fuse_projections,
                      flags.FLAGS.gemv_layers)


def kernels_line(kernels: KernelBackends, head_dim: int | None = None) -> str:
    """One line of the start-up summary: the platform, what each op family runs (the
    KernelEntry.backend tags of ops/backends.py; "xla" for the float products) and the layer
    loop (scan or unrolled). With the model's head_dim, attention and the KV write say so when
    their kernel cannot take it, and the line says when the block tables stay on the device
    (engine.device_tables.tables_on_device)."""
    parts = []
    for family in TABLES:
        interpreted = getattr(kernels, family, "") == "pallas_interpret"
        tags = ["xla" if tag == "any" else "pallas_interpret" if tag == "pallas" and interpreted
                else tag for tag in active_tags(kernels, family)]
        part = f"{family} {'+'.join(tags)}"
        if (family in ("attention", "kv_write") and head_dim is not None
                and getattr(kernels, family) != "reference"
                and not kernel_takes_head_dim(head_dim)):
            part = (f"{family} reference (head_dim {head_dim}: the kernel takes an even head_dim "
                    "of 16 to 256)")
        parts.append(part)
    line = f"kernels on {kernels.platform}: {', '.join(parts)}; layers {kernels.layer_loop}"
    if head_dim is not None and tables_on_device(kernels, head_dim):
        line += "; block tables on the device"
    return line


def print_kernels(kernels: KernelBackends, head_dim: int | None = None, file=None) -> None:
    """Prints `kernels_line` (for a model of this head_dim), then with --print_kernels the
    whole table (describe_kernels), on `file` (default stderr)."""
    file = sys.stderr if file is None else file
    print(kernels_line(kernels, head_dim), file=file, flush=True)
    if flags.FLAGS.print_kernels:
        print(describe_kernels(kernels), file=file, flush=True)


def log_line(line: str) -> None:
    """Prints one line of start-up information on stderr."""
    print(line, file=sys.stderr)


def prepare_model(loaded, mesh=None, label: str = "model"):
    """The loaded model ready for an engine: models.prepare.prepare_for_device with
    --fuse_projections and --gemv_layers, its notes on stderr, loaded.cfg and loaded.model
    updated. Call after loading and quantizing. Returns `loaded`."""
    prepared = prepare_for_device(loaded.cfg, loaded.model, platform=jax.default_backend(),
                                  hopper=on_hopper(), mesh=mesh,
                                  fuse_projections=flags.FLAGS.fuse_projections,
                                  gemv_layers=flags.FLAGS.gemv_layers, label=label)
    for note in prepared.notes:
        log_line(note)
    loaded.cfg, loaded.model = prepared.cfg, prepared.model
    return loaded


def spec_config_from_flags(FLAGS) -> SpecConfig | None:
    """The SpecConfig of the speculative flags, or None for --speculative=none."""
    if FLAGS.speculative == "none":
        return None
    if FLAGS.speculative == "draft" and not FLAGS.draft_model:
        raise ValueError("--speculative=draft needs --draft_model")
    return SpecConfig(FLAGS.speculative, FLAGS.num_speculative_tokens, FLAGS.ngram_min,
                      FLAGS.ngram_max, FLAGS.spec_max_batch)


def speculation_from_flags(FLAGS, dtype):
    """(SpecConfig or None, (draft cfg, draft model) or None) from the speculative flags; the
    draft is prepared per --fuse_projections / --gemv_layers for one device, as load_engine
    prepares it."""
    spec = spec_config_from_flags(FLAGS)
    if spec is None or spec.method != "draft":
        return spec, None
    draft, _ = load_prepared(FLAGS.draft_model, dtype=dtype,
                             fuse_projections=FLAGS.fuse_projections,
                             gemv_layers=FLAGS.gemv_layers, label="draft model", log=log_line)
    return spec, (draft.cfg, draft.model)
