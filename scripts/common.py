"""Flags and helpers shared by the absl entry points in scripts/."""
from __future__ import annotations

import json
import os
import sys

from absl import flags

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
    on the CPU)."""
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


def quantize_from_flags(loaded, method: str) -> dict:
    """Quantizes loaded.model in place with `method` and the quantization flags (quant/model.py).

    Returns the settings to store with a checkpoint.
    """
    from quant.model import QuantConfig, quantize_loaded
    f = flags.FLAGS
    qcfg = QuantConfig(method, group_size=f.group_size, symmetric=f.symmetric,
                       act_order=f.act_order, lm_head=f.quantize_lm_head)
    return quantize_loaded(loaded, qcfg, f.calib_text, f.calib_tokens, f.calib_seq_len)


def resolve_dtype(name: str | None):
    """The jnp dtype for --dtype, defaulting by backend."""
    import jax
    import jax.numpy as jnp
    if name is None:
        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return jnp.dtype(name)


def engine_config_from_flags(FLAGS, cfg):
    """The EngineConfig of the engine flags for model config `cfg`, resolved for this process's
    jax backend (engine.engine_config.resolve_engine_config), except an unset --max_model_len:
    it stays None, for LLMEngine to bound the model's context by the KV cache it plans."""
    import dataclasses

    import jax
    from engine.engine_config import EngineConfig, resolve_engine_config
    requested = EngineConfig(max_model_len=FLAGS.max_model_len, max_num_seqs=FLAGS.max_num_seqs,
                             max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                             page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
                             memory_fraction=FLAGS.memory_fraction,
                             enable_prefix_caching=FLAGS.enable_prefix_caching,
                             enable_chunked_prefill=FLAGS.enable_chunked_prefill, seed=FLAGS.seed,
                             async_scheduling=FLAGS.async_scheduling,
                             num_decode_steps=FLAGS.num_decode_steps,
                             mixed_rounds=FLAGS.mixed_rounds)
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
                    "jax persistent compilation cache ('' disables): a second start is faster.")


flags.DEFINE_bool("exhaustive_gemm_search", False,
                  "On GPU, XLA tries every Triton tiling of each matrix product when it "
                  "autotunes a program (--xla_gpu_exhaustive_tiling_search): on the H200 "
                  "llama3.1-8b decode steps ran 2-8% faster, but programs compile 3-4x longer "
                  "(a server's warm-up of llama3.2-1b took over 4 minutes instead of 66 s; the "
                  "persistent compilation cache keeps a second start fast). On in bench_decode.")


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
    """Sets the XLA flags of the scripts' flags, quiets jax's backend probing and turns on
    the persistent compilation cache; call before jax's backend starts."""
    import logging

    set_xla_flags()
    import jax
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    if flags.FLAGS.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", flags.FLAGS.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def freeze_startup_objects() -> None:
    """Takes every object alive after start-up (the model's modules, the engine, jax's compiled
    programs) out of the cyclic garbage collector's scans (`gc.freeze`, as vLLM does after
    start-up), so that full collections during serving walk only what serving made. Objects
    made later are collected as before. (On the CPU it made no measurable difference to the
    host time per step: docs/PERFORMANCE.md.)"""
    import gc
    gc.collect()
    gc.freeze()


def print_progress(label: str):
    """A progress callback (done, total) that rewrites one line on stderr."""
    import time
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        end = "\n" if done == total else ""
        print(f"\r{label} {done}/{total} ({time.perf_counter() - start:.1f}s)", end=end,
              file=sys.stderr, flush=True)

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
    """--fuse_projections and --gemv_layers: tri-state (unset: auto); --fold_norm_scale."""
    flags.DEFINE_bool("gemv_layers", None,
                      "Store each layer's fused weights transposed so that batch-1 decode steps "
                      "run each product as one Pallas kernel with its RMSNorm, SiLU x up and "
                      "residual add inside (ops/gemv.py; models.llama.transpose_for_gemv), and "
                      "quantized products of more rows the Hopper kernel (ops/quant_wgmma.py, "
                      "which reads codes stored [out, in] only): llama3.1-8b bf16 batch-1 "
                      "decode about 7% faster on the H200, larger bf16 batches up to 3% slower. "
                      "Needs fused projections, float, INT8 or INT4 (not act-order) weights and "
                      "one device; the kernels run for bf16 activations on a GPU. Default auto: "
                      "on for INT8 / INT4 models on one Hopper GPU, off otherwise.")
    flags.DEFINE_bool("fold_norm_scale", False,
                      "Apply each RMSNorm before a projection as project(x * weight) times the "
                      "row's rsqrt scale after the product (ModelConfig.fold_norm_scale), so XLA "
                      "fuses the norm's multiply into the product: llama3.1-8b batch-1 decode "
                      "2.3% faster on the H200. The same function, rounded at other points than "
                      "HF's RMSNorm in bf16.")
    flags.DEFINE_bool("fuse_projections", None,
                      "Fuse each layer's q/k/v and gate/up kernels into one matmul each after "
                      "loading (and quantizing); same tokens, fewer and larger matmuls (+36% "
                      "tokens/s for llama3.1-8b at batch 1 on the H200). Default auto: on on a GPU "
                      "without --tp/--dp, off on the CPU and with a mesh. Forcing it on with a "
                      "mesh is an error (the sharding rules know only the unfused weights).")


def fusion_wanted(requested: bool | None, backend: str, mesh) -> bool:
    """Whether to fuse projections: `requested` (--fuse_projections) or, when None, auto (a GPU
    backend and no mesh). Raises ValueError when fusion is forced on with a mesh."""
    if requested is None:
        return backend == "gpu" and mesh is None
    if requested and mesh is not None:
        raise ValueError("--fuse_projections=true needs one device: the sharding rules of a "
                         "--tp/--dp mesh know only the unfused q/k/v and gate/up weights (drop "
                         "--fuse_projections or --tp/--dp)")
    return requested


def gemv_wanted(requested: bool | None, quantized: bool, hopper: bool, mesh) -> bool:
    """Whether to store the layers transposed: `requested` (--gemv_layers) or, when None, auto:
    a quantized model (INT8 / INT4 codes) on a Hopper GPU without a mesh, where the Hopper
    kernel runs every quantized product (the [in, out] codes' Triton path is slower than bf16
    there: docs/PERFORMANCE.md, issue 6's tables)."""
    if requested is None:
        return quantized and hopper and mesh is None
    return requested


def check_fusion(mesh) -> None:
    """Fails early (ValueError) when --fuse_projections cannot apply to `mesh` (fusion_wanted):
    call it right after parallel.setup_parallel(), before loading."""
    import jax
    fusion_wanted(flags.FLAGS.fuse_projections, jax.default_backend(), mesh)
    if flags.FLAGS.gemv_layers and (mesh is not None or flags.FLAGS.fuse_projections is False):
        raise ValueError("--gemv_layers needs fused projections on one device (drop "
                         "--fuse_projections=false and --tp/--dp)")


def fuse_from_flags(cfg, model, mesh=None, label: str = "model") -> tuple:
    """(cfg, model), with q/k/v and gate/up fused in place when --fuse_projections (or auto)
    says so (models.llama.fuse_projections), with a line on stderr, cfg.fold_norm_scale set by
    --fold_norm_scale, and the layers transposed by --gemv_layers or its auto mode (after
    fusing; `transpose_as_wanted`). Call after loading and quantizing. In auto mode a model
    that cannot be fused or transposed (act-order quantized kernels) stays as it is, with a
    note. ValueError when a requested --gemv_layers cannot apply."""
    cfg, model = _fuse_from_flags(cfg, model, mesh, label)
    from ops.quant_wgmma import on_hopper
    return transpose_as_wanted(cfg, model, flags.FLAGS.gemv_layers, on_hopper(), mesh, label)


def transpose_as_wanted(cfg, model, requested: bool | None, hopper: bool, mesh=None,
                        label: str = "model") -> tuple:
    """(cfg, model) with the layers transposed (models.llama.transpose_for_gemv) when
    `gemv_wanted` says so, with a line on stderr. Requested (--gemv_layers) and impossible:
    ValueError; wanted by auto and impossible (unfused or act-order): a note, the model whole."""
    from models.llama import has_quantized_layers, transpose_for_gemv
    if cfg.gemv_layers or not gemv_wanted(requested, has_quantized_layers(model), hopper, mesh):
        return cfg, model
    if not cfg.fused_projections:
        if requested:
            raise ValueError("--gemv_layers needs fused projections (auto fusion is off on "
                             "the CPU: add --fuse_projections)")
        print(f"note: {label} layers left in [in, out] (projections unfused)", file=sys.stderr)
        return cfg, model
    try:
        cfg, model = transpose_for_gemv(cfg, model)
    except ValueError as e:  # checked before any change
        if requested:
            raise ValueError(f"--gemv_layers: {e}") from None
        print(f"note: {label} layers left in [in, out] ({e})", file=sys.stderr)
        return cfg, model
    print(f"{label}: layers transposed for the batch-1 gemv kernel"
          f"{'' if requested else ' (auto: quantized, Hopper GPU)'}", file=sys.stderr)
    return cfg, model


def _fuse_from_flags(cfg, model, mesh, label: str) -> tuple:
    import jax

    from models.llama import fuse_projections
    if flags.FLAGS.fold_norm_scale and not cfg.fold_norm_scale:
        cfg = cfg.replace(fold_norm_scale=True)
        print(f"{label}: RMSNorm scales folded into the products after them", file=sys.stderr)
    requested = flags.FLAGS.fuse_projections
    if cfg.fused_projections or not fusion_wanted(requested, jax.default_backend(), mesh):
        return cfg, model
    try:
        cfg, model = fuse_projections(cfg, model)
    except ValueError as e:  # checked before any change: the model is still whole
        if requested:
            raise ValueError(f"--fuse_projections: {e}") from None
        print(f"note: {label} projections left unfused ({e})", file=sys.stderr)
        return cfg, model
    print(f"{label}: q/k/v and gate/up projections fused", file=sys.stderr)
    return cfg, model


def prepare_model(loaded, mesh=None):
    """The loaded model ready for an engine: fused per --fuse_projections (fuse_from_flags),
    loaded.cfg updated to match. Call after loading and quantizing. Returns `loaded`."""
    loaded.cfg, loaded.model = fuse_from_flags(loaded.cfg, loaded.model, mesh)
    return loaded


def speculation_from_flags(FLAGS, dtype):
    """(SpecConfig or None, (draft cfg, draft model) or None) from the speculative flags; the
    draft is fused per --fuse_projections (define_fusion_flags), as the target."""
    from engine.speculative import SpecConfig
    if FLAGS.speculative == "none":
        return None, None
    spec = SpecConfig(FLAGS.speculative, FLAGS.num_speculative_tokens, FLAGS.ngram_min,
                      FLAGS.ngram_max, FLAGS.spec_max_batch)
    if FLAGS.speculative != "draft":
        return spec, None
    if not FLAGS.draft_model:
        raise ValueError("--speculative=draft needs --draft_model")
    from models.loader import load_model
    draft = load_model(FLAGS.draft_model, dtype)
    # The draft runs unsharded on one device (engine/draft.py), so a mesh does not stop fusion.
    return spec, fuse_from_flags(draft.cfg, draft.model, label="draft model")
