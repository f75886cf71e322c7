"""Lowers every step program the engine compiles for a serving configuration, for TPU, from any
host (no TPU needed), and reports the Mosaic kernels each one contains.

    python -m scripts.lower --platform=tpu --model=llama3.1-8b [--quant=int4|int8] [--json]
    python -m scripts.lower --platform=tpu --model=llama3.1-8b --tp=4   # 8 fake CPU devices

The model is shape-only (no weights are allocated); the engine configuration is the TPU's
defaults (engine/engine_config.py) with a KV cache sized from the chip's HBM (--chip). The step
programs are the ones `LLMEngine.warmup` compiles (engine/warmup.py: every decode, multi-step,
prefill and mixed-round bucket), each traced with the TPU's kernel choice
(ops.backends.select_kernels) and lowered with `lowering_platforms=("tpu",)` under an abstract
TPU device (ops.tpu_chips.tpu_lowering). The samplers' programs hold no attention or quantized
product and are not lowered. Exit status 1 if a program fails to lower or lacks the attention
kernel or, for a quantized model, the quantized-product kernel (a reference fallback).
Lowering checks the Pallas-to-Mosaic translation, block shapes and dtypes; Mosaic's own
compilation runs in the TPU compiler and is not exercised here.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs.model import get_preset
from engine.block_pool import BlockPool
from engine.engine_config import EngineConfig, resolve_engine_config
from engine.llm_engine import LLMEngine
from engine.memory import activation_reserve_bytes, plan_kv_cache
from engine.runner import ModelRunner
from models.kv_cache import init_kv_cache
from models.prepare import prepare_for_device
from models.weights import abstract_model
from ops.backends import select_kernels
from ops.kernel_choice import KernelBackends
from ops.kv_quant import kv_cache_dtype
from ops.tpu_chips import CHIPS, tpu_lowering
from quant.model import QuantConfig, model_nbytes, quantized_abstract_model

FLAGS = flags.FLAGS
QUANT_METHODS = {"none": None, "int4": "int4_rtn", "int8": "int8"}
ATTENTION_KERNEL = "tpu_ragged_paged_attention"
QUANT_KERNEL = "tpu_quant_matmul"
MEMORY_FRACTION = 0.9  # of the chip's HBM, as on a GPU (engine/engine_config.py)


def define_flags() -> None:
    flags.DEFINE_enum("platform", "tpu", ["tpu"], "The platform to lower for.")
    flags.DEFINE_string("model", "llama3.1-8b", "Model preset (configs/model.py).")
    flags.DEFINE_enum("quant", "none", list(QUANT_METHODS), "Weight quantization (RTN shapes).")
    flags.DEFINE_enum("chip", "v6e", list(CHIPS), "TPU chip: HBM size and kernel block sizes.")
    flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (fake CPU devices stand in for chips).")
    flags.DEFINE_bool("json", False, "Print the report as JSON.")
    flags.DEFINE_string("kv_cache_dtype", "auto", "KV cache dtype: auto, bf16, int8, fp8.")
    flags.DEFINE_integer("max_num_seqs", None, "Override the TPU default (256).")
    flags.DEFINE_integer("max_num_batched_tokens", None, "Override the TPU default (2048).")
    flags.DEFINE_integer("max_model_len", None, "Override (default: the context the cache "
                         "holds, at most the model's).")
    flags.DEFINE_integer("num_decode_steps", None, "Override the TPU default (8).")
    flags.DEFINE_integer("max_programs", None, "Lower only the first N programs (smoke runs).")


@dataclasses.dataclass
class Program:
    """One lowered step program and the Mosaic kernels (custom calls) in it."""

    kind: str  # the runner's jitted function
    shape: str  # its static arguments (the bucket)
    kernels: dict[str, int]  # Mosaic kernel name -> custom calls
    seconds: float
    error: str | None = None


def mosaic_kernels(text: str) -> dict[str, int]:
    """Kernel name -> number of Mosaic custom calls in a lowered module's text."""
    counts = collections.Counter()
    for line in text.splitlines():
        if "tpu_custom_call" in line:
            names = re.findall(r'kernel_name = \\?"([\w.-]+)\\?"', line)
            counts[names[0] if names else "unnamed"] += 1
    return dict(counts)


class EnoughPrograms(Exception):
    """--max_programs programs are lowered: the walk stops."""


class LoweringProgram:
    """Stands in for one of the runner's jitted functions: a call traces and lowers it for TPU
    (once per static shape), records a Program, and returns zeros of its results with the
    cache argument (shape-only) passed through, so the runner's warmup goes on."""

    def __init__(self, jitted, kind: str, programs: list[Program], chip: str, limit):
        self.jitted, self.kind, self.programs, self.chip, self.limit = jitted, kind, programs, \
            chip, limit
        self.seen: set[str] = set()

    def __call__(self, *args, **kwargs):
        static = [a for a in args[2:] if not hasattr(a, "shape")]  # the bucket, steps, mode
        shape = ", ".join(map(str, static + [f"{k}={v}" for k, v in sorted(kwargs.items())]))
        if self.limit is not None and len(self.programs) >= self.limit:
            raise EnoughPrograms
        start = time.perf_counter()
        with tpu_lowering(self.chip):
            traced = self.jitted.trace(*args, **kwargs)
            out_info = traced.out_info
            if shape not in self.seen:
                self.seen.add(shape)
                try:
                    text = traced.lower(lowering_platforms=("tpu",)).as_text()
                    self.programs.append(Program(self.kind, shape, mosaic_kernels(text),
                                                 time.perf_counter() - start))
                except Exception as e:  # reported per program; the run goes on
                    self.programs.append(Program(self.kind, shape, {}, time.perf_counter() - start,
                                                 f"{type(e).__name__}: {e}"[:2000]))
        *results, _ = out_info
        return (*[jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), r) for r in results],
                args[1])


class LoweringRunner(ModelRunner):
    """A ModelRunner over a shape-only model and cache whose programs are lowered, not run."""

    def __init__(self, cfg, model, num_pages: int, page_size: int, kv_dtype, max_seqs: int,
                 max_width: int, kernels: KernelBackends, chip: str, limit=None):
        super().__init__(cfg, model, 1, page_size, kv_dtype, max_seqs, max_width, kernels)
        self.cache = jax.eval_shape(lambda: init_kv_cache(cfg, num_pages, page_size,
                                                          self.kv_dtype))
        self.programs: list[Program] = []
        for kind in ("_step", "_step_and_argmax", "_multi_step", "_mixed_round"):
            setattr(self, kind, LoweringProgram(getattr(self, kind), kind.lstrip("_"),
                                                self.programs, chip, limit))

    def warmup_samplers(self) -> None:
        """The samplers' programs hold no kernel of interest: not lowered."""


def serving_setup(model_name: str, quant: str, chip: str, kv_dtype_name: str,
                  overrides: dict):
    """(cfg, shape-only model, resolved EngineConfig, pages) of the serving configuration on
    one `chip`: weights in bf16 (or RTN codes), the KV cache in 0.9 of HBM less the weights."""
    cfg = get_preset(model_name)
    dtype = jnp.bfloat16
    method = QUANT_METHODS[quant]
    model = (abstract_model(cfg, dtype) if method is None
             else quantized_abstract_model(cfg, QuantConfig(method), dtype))
    prepared = prepare_for_device(cfg, model, platform="tpu", hopper=False)
    cfg, model = prepared.cfg, prepared.model
    requested = EngineConfig(kv_cache_dtype=kv_dtype_name,
                             **{k: v for k, v in overrides.items() if v is not None})
    engine_cfg = resolve_engine_config(requested, cfg.max_position_embeddings, "tpu")
    kv_dtype = kv_cache_dtype(kv_dtype_name, dtype)
    hbm = CHIPS[chip].hbm_gib << 30
    budget = (int(hbm * MEMORY_FRACTION) - model_nbytes(model) - activation_reserve_bytes(
        cfg, engine_cfg.max_num_batched_tokens, engine_cfg.max_num_seqs, dtype))
    if budget <= 0:
        raise ValueError(f"{model_name} ({quant}) leaves no room for a KV cache in the "
                         f"{CHIPS[chip].hbm_gib} GiB of a TPU {chip}")
    plan = plan_kv_cache(cfg, kv_dtype, engine_cfg.page_size, engine_cfg.max_model_len,
                         engine_cfg.max_num_batched_tokens, engine_cfg.max_num_seqs, None,
                         fit_max_model_len=False, kv_cache_memory=budget)
    if requested.max_model_len is None:
        engine_cfg = resolve_engine_config(requested, cfg.max_position_embeddings, "tpu",
                                           plan.num_pages * engine_cfg.page_size)
    return cfg, model, engine_cfg, plan.num_pages


def lower_serving_programs(model_name: str = "llama3.1-8b", quant: str = "none",
                           chip: str = "v6e", kv_dtype_name: str = "auto",
                           max_programs: int | None = None, **overrides) -> dict:
    """Lowers the step programs of the serving configuration (see the module docstring);
    returns the report: the configuration, the programs and the failures."""
    cfg, model, engine_cfg, num_pages = serving_setup(model_name, quant, chip, kv_dtype_name,
                                                      overrides)
    kernels = select_kernels("tpu", device_kind=CHIPS[chip].device_kinds[0])
    pool = BlockPool(num_pages, engine_cfg.page_size, engine_cfg.enable_prefix_caching)
    max_width = pool.pages_needed(engine_cfg.max_model_len)
    runner = LoweringRunner(cfg, model, num_pages, engine_cfg.page_size,
                            engine_cfg.kv_cache_dtype, engine_cfg.max_num_seqs, max_width,
                            kernels, chip, max_programs)
    rounds = None
    if engine_cfg.num_decode_steps > 1:
        rounds = types.SimpleNamespace(num_steps=engine_cfg.num_decode_steps,
                                       mixed_rounds=engine_cfg.mixed_rounds)
    # LLMEngine.warmup's own walk over engine/warmup.py's shapes, on this runner.
    engine = types.SimpleNamespace(engine_cfg=engine_cfg, pool=pool, runner=runner,
                                   spec_config=None, rounds=rounds)
    engine.warmup_shapes = functools.partial(LLMEngine.warmup_shapes, engine)
    try:
        LLMEngine.warmup(engine)
    except EnoughPrograms:
        pass
    required = [ATTENTION_KERNEL] + ([QUANT_KERNEL] if quant != "none" else [])
    failures = [f"{p.kind} [{p.shape}]: " + (p.error or "no " + ", ".join(
        k for k in required if k not in p.kernels)) for p in runner.programs
        if p.error or any(k not in p.kernels for k in required)]
    return {"model": model_name, "quant": quant, "chip": chip, "kv_pages": num_pages,
            "engine_config": dataclasses.asdict(engine_cfg), "kernels": str(kernels),
            "required_kernels": required, "programs": [dataclasses.asdict(p)
                                                       for p in runner.programs],
            "failures": failures}


def print_report(report: dict, file=sys.stdout) -> None:
    cfg = report["engine_config"]
    print(f"{report['model']} ({report['quant']}) for TPU {report['chip']}: "
          f"{len(report['programs'])} step programs; {report['kv_pages']} KV pages of "
          f"{cfg['page_size']}; max_num_seqs {cfg['max_num_seqs']}, max_num_batched_tokens "
          f"{cfg['max_num_batched_tokens']}, max_model_len {cfg['max_model_len']}", file=file)
    for p in report["programs"]:
        kernels = ", ".join(f"{k} x{n}" for k, n in sorted(p["kernels"].items())) or "-"
        status = "FAILED " + p["error"].splitlines()[0] if p["error"] else kernels
        print(f"  {p['kind']:<16} {p['shape']:<60} {p['seconds']:6.1f}s  {status}", file=file)
    for failure in report["failures"]:
        print(f"FAILED {failure.splitlines()[0]}", file=file)
    print("ok" if not report["failures"] else f"{len(report['failures'])} failures", file=file)


def main(argv) -> int:
    del argv
    overrides = dict(max_num_seqs=FLAGS.max_num_seqs,
                     max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                     max_model_len=FLAGS.max_model_len, num_decode_steps=FLAGS.num_decode_steps)
    report = lower_serving_programs(FLAGS.model, FLAGS.quant, FLAGS.chip, FLAGS.kv_cache_dtype,
                                    FLAGS.max_programs, **overrides)
    if FLAGS.json:
        json.dump(report, sys.stdout, indent=1, default=str)
        print()
    else:
        print_report(report)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
