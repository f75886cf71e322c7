"""Lowers every step program the engine compiles for a serving configuration, for TPU or a GPU,
from any host (no accelerator needed), and reports the kernels each one contains and the seconds
it took to trace and lower.

    python -m scripts.lower --platform=tpu --model=llama3.1-8b [--quant=int4|int8] [--json]
    python -m scripts.lower --platform=tpu --model=llama3.1-8b --tp=4   # 8 fake CPU devices
    python -m scripts.lower --platform=gpu --gpu=h100 --model=qwen3-30b-a3b --quant=int4

The model is shape-only (no weights are allocated) and prepared as on the device
(models.prepare); the engine configuration is the platform's defaults
(engine/engine_config.py) with a KV cache sized from the chip's memory (--chip, --gpu). The
step programs are the ones the engine's warm-up compiles (engine/warmup.py: every decode,
multi-step, prefill and mixed-round bucket), each traced with the platform's kernel choice
(ops.backends.select_kernels) and lowered with `lowering_platforms=("tpu",)` or `("cuda",)`
under an abstract device of the target (ops.lowering_target). The samplers' programs hold no
attention or quantized product and are not lowered. Exit status 1 if a program fails to lower
or lacks the attention kernel or, for a quantized model on one TPU chip, the quantized-product
kernel (a reference fallback; with --tp the quantized products are XLA's, partitioned by XLA).
Lowering checks the Pallas-to-Mosaic / Triton translation, block shapes and dtypes; the
kernels' own compilation runs in the device's compiler and is not exercised here. The seconds
are the Python part of a start-up's compiling (tracing and lowering, which the compile threads
take turns at), not XLA's.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from configs.mesh import mesh_shape
from configs.model import get_preset
from engine.block_pool import BlockPool
from engine.engine_config import EngineConfig, resolve_engine_config
from engine.memory import activation_reserve_bytes, plan_kv_cache
from engine.mesh import make_mesh
from engine.runner import ModelRunner
from engine.sharded_runner import ShardedModelRunner
from engine.sharding import kv_local_config
from engine.warmup import compile_step, reachable_steps
from models.kv_cache import init_kv_cache
from models.prepare import prepare_for_device
from models.sharding import runtime_config, tree_shardings
from models.llama import LlamaForCausalLM
from ops.backends import select_kernels
from ops.kernel_choice import KernelBackends
from ops.kv_quant import kv_cache_dtype
from ops.lowering_target import GPUS, abstract_device_lowering, is_hopper
from ops.tpu_chips import CHIPS
from quant.model import QuantConfig, model_nbytes, quantize_model

FLAGS = flags.FLAGS
QUANT_METHODS = {"none": None, "int4": "int4_rtn", "int8": "int8"}
ATTENTION_KERNEL = "tpu_ragged_paged_attention"
QUANT_KERNEL = "tpu_quant_matmul"
GPU_ATTENTION_KERNEL = "ragged_paged_attention"
MEMORY_FRACTION = 0.9  # of the chip's memory, as on a GPU (engine/engine_config.py)


@dataclasses.dataclass(frozen=True)
class Target:
    """The chip a lowering is for."""

    platform: str  # "tpu" or "gpu"
    name: str  # a key of ops.tpu_chips.CHIPS or ops.lowering_target.GPUS
    device_kind: str
    memory_bytes: int

    @property
    def hopper(self) -> bool:
        return self.platform == "gpu" and is_hopper(self.device_kind)

    @property
    def lowering_platform(self) -> str:
        return "cuda" if self.platform == "gpu" else self.platform

    def describe(self) -> str:
        return f"TPU {self.name}" if self.platform == "tpu" else self.device_kind


def target_of(platform: str, chip: str = "v6e", gpu: str = "h200") -> Target:
    """The Target of a TPU `chip` (platform "tpu") or a `gpu` (platform "gpu")."""
    if platform == "tpu":
        return Target("tpu", chip, CHIPS[chip].device_kinds[0], CHIPS[chip].hbm_gib << 30)
    if platform == "gpu":
        return Target("gpu", gpu, GPUS[gpu].device_kind, int(GPUS[gpu].memory_gib * 2**30))
    raise ValueError(f"scripts.lower: platform {platform!r} must be 'tpu' or 'gpu'")


def define_flags() -> None:
    flags.DEFINE_enum("platform", "tpu", ["tpu", "gpu"], "The platform to lower for.")
    flags.DEFINE_string("model", "llama3.1-8b", "Model preset (configs/model.py).")
    flags.DEFINE_enum("quant", "none", list(QUANT_METHODS), "Weight quantization (RTN shapes).")
    flags.DEFINE_enum("chip", "v6e", list(CHIPS), "TPU chip: HBM size and kernel block sizes.")
    flags.DEFINE_enum("gpu", "h200", list(GPUS), "GPU: memory and kernel choice (--platform=gpu).")
    flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (fake CPU devices stand in for chips).")
    flags.DEFINE_bool("json", False, "Print the report as JSON.")
    flags.DEFINE_string("kv_cache_dtype", "auto", "KV cache dtype: auto, bf16, int8, fp8.")
    flags.DEFINE_integer("max_num_seqs", None, "Override the platform's default (256).")
    flags.DEFINE_integer("max_num_batched_tokens", None, "Override the platform's default "
                         "(2048).")
    flags.DEFINE_integer("max_model_len", None, "Override (default: the context the cache "
                         "holds, at most the model's).")
    flags.DEFINE_integer("num_decode_steps", None, "Override the platform's default (8).")
    flags.DEFINE_integer("num_pages", None, "KV pages (default: what the chip's HBM holds).")
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


def gpu_kernels(text: str) -> dict[str, int]:
    """Kernel name -> number of Pallas Triton and Mosaic GPU custom calls in a lowered module's
    text (each jitted kernel call is lowered once per shape: a call per distinct kernel)."""
    counts = collections.Counter()
    for line in text.splitlines():
        if "@__gpu$xla.gpu.triton(" in line:  # the name follows the kernel's IR in the config
            names = re.findall(r'\bname = "([\w.-]+)"', line)
            counts[names[-1] if names else "triton"] += 1
        elif "@mosaic_gpu" in line:
            counts["mosaic_gpu"] += 1
    return dict(counts)


class EnoughPrograms(Exception):
    """--max_programs programs are lowered: the walk stops."""


class LoweringProgram:
    """Stands in for one of the runner's jitted functions: a call traces and lowers it for the
    target (once per static shape), records a Program, and returns zeros of its results with the
    cache argument (shape-only) passed through, so the runner's warmup goes on."""

    def __init__(self, jitted, kind: str, programs: list[Program], target: Target, limit,
                 mesh=None, on_program=None):
        self.jitted, self.kind, self.programs, self.target, self.limit = jitted, kind, \
            programs, target, limit
        self.mesh, self.on_program = mesh, on_program
        self.seen: set[str] = set()

    def __call__(self, *args, **kwargs):
        # the bucket, steps, mode (not the arrays, nor the absent ones: None)
        static = [a for a in args[2:] if a is not None and not hasattr(a, "shape")]
        shape = ", ".join(map(str, static + [f"{k}={v}" for k, v in sorted(kwargs.items())]))
        if self.limit is not None and len(self.programs) >= self.limit:
            raise EnoughPrograms
        start = time.perf_counter()
        target = self.target
        with abstract_device_lowering(target.device_kind, target.platform, self.mesh):
            traced = self.jitted.trace(*args, **kwargs)
            out_info = traced.out_info
            if shape not in self.seen:
                self.seen.add(shape)
                try:
                    text = traced.lower(lowering_platforms=(target.lowering_platform,)).as_text()
                    kernels = (gpu_kernels if target.platform == "gpu" else mosaic_kernels)(text)
                    self.programs.append(Program(self.kind, shape, kernels,
                                                 time.perf_counter() - start))
                except Exception as e:  # reported per program; the run goes on
                    self.programs.append(Program(self.kind, shape, {}, time.perf_counter() - start,
                                                 f"{type(e).__name__}: {e}"[:2000]))
                if self.on_program is not None:
                    self.on_program(self.programs[-1])
        *results, _ = out_info
        return (*[jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), r) for r in results],
                args[1])


def lowering_programs(runner, target: Target, limit, mesh=None, on_program=None) -> None:
    """Replaces the runner's jitted step functions by LoweringPrograms (runner.programs); the
    warm-up then calls them instead of compiling them ahead of time."""
    runner.programs = []
    runner.compiles_ahead = False
    for kind in ("_step", "_step_and_argmax", "_multi_step", "_mixed_round"):
        if hasattr(runner, kind):
            setattr(runner, kind, LoweringProgram(getattr(runner, kind), kind.lstrip("_"),
                                                  runner.programs, target, limit, mesh,
                                                  on_program))


class LoweringRunner(ModelRunner):
    """A ModelRunner over a shape-only model and cache whose programs are lowered, not run."""

    def __init__(self, cfg, model, num_pages: int, page_size: int, kv_dtype, max_seqs: int,
                 max_width: int, *, kernels: KernelBackends, target: Target, limit=None,
                 on_program=None):
        super().__init__(cfg, model, 1, page_size, kv_dtype, max_seqs, max_width, kernels)
        self.cache = jax.eval_shape(lambda: init_kv_cache(cfg, num_pages, page_size,
                                                          self.kv_dtype))
        lowering_programs(self, target, limit, None, on_program)

    def sampler_shapes(self) -> list:
        """The samplers' programs hold no kernel of interest: not lowered."""
        return []


class ShardedLoweringRunner(ShardedModelRunner):
    """A ShardedModelRunner over a shape-only model and cache (carrying the weights' and pages'
    shardings on the mesh) whose programs are lowered, not run."""

    def __init__(self, cfg, model, num_pages: int, page_size: int, kv_dtype, max_seqs: int,
                 max_width: int, *, mesh, kernels: KernelBackends, target: Target,
                 limit=None, on_program=None):
        tp, _ = mesh_shape(mesh)
        graphdef, state = nnx.split(model)
        run_cfg = runtime_config(cfg, tp)
        if run_cfg.num_kv_heads != cfg.num_kv_heads:
            raise ValueError(f"scripts.lower: tp={tp} repeats the {cfg.num_kv_heads} KV heads; "
                             "lower with a tp that divides them")
        placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              state, tree_shardings(state, cfg, mesh))
        super().__init__(cfg, nnx.merge(graphdef, placed), 1, page_size, kv_dtype, max_seqs,
                         max_width, mesh=mesh, kernels=kernels)
        self.pages_per_shard = num_pages
        full = jax.eval_shape(lambda: init_kv_cache(self.cfg, num_pages * self.dp, page_size,
                                                    self.kv_dtype))
        self.cache = jax.tree.map(lambda a, small: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=small.sharding), full, self.cache)
        lowering_programs(self, target, limit, mesh, on_program)

    def sampler_shapes(self) -> list:
        """The samplers' programs hold no kernel of interest: not lowered."""
        return []


def shape_only_model(cfg, method: str | None, dtype, target: Target, mesh=None):
    """(cfg, model) of cfg's shapes, no weights allocated: RTN-quantized by `method` (None:
    float) and laid out for `target` (models.prepare: fused, transposed) as on the device."""
    built = {}

    def make():
        model = LlamaForCausalLM(cfg, nnx.Rngs(0), dtype)
        if method is not None:
            quantize_model(cfg, model, QuantConfig(method), progress=False)
        with abstract_device_lowering(target.device_kind, target.platform):
            prepared = prepare_for_device(cfg, model, platform=target.platform,
                                          hopper=target.hopper, mesh=mesh)
        built["cfg"] = prepared.cfg
        return prepared.model
    model = nnx.eval_shape(make)
    return built["cfg"], model


def serving_setup(model_name: str, quant: str, target: Target, kv_dtype_name: str,
                  overrides: dict, mesh=None):
    """(cfg, shape-only model, resolved EngineConfig, pages per data shard) of the serving
    configuration on `target` chips: weights in bf16 (or RTN codes) laid out for the platform,
    the KV cache in 0.9 of each chip's memory less its share of the weights."""
    dtype = jnp.bfloat16
    cfg, model = shape_only_model(get_preset(model_name), QUANT_METHODS[quant], dtype, target,
                                  mesh)
    requested = EngineConfig(kv_cache_dtype=kv_dtype_name,
                             **{k: v for k, v in overrides.items() if v is not None})
    engine_cfg = resolve_engine_config(requested, cfg.max_position_embeddings, target.platform)
    kv_dtype = kv_cache_dtype(kv_dtype_name, dtype)
    if requested.num_pages is not None:
        return cfg, model, engine_cfg, requested.num_pages
    tp = 1 if mesh is None else mesh_shape(mesh)[0]
    budget = (int(target.memory_bytes * MEMORY_FRACTION) - model_nbytes(model) // tp
              - activation_reserve_bytes(cfg, engine_cfg.max_num_batched_tokens,
                                         engine_cfg.max_num_seqs, dtype))
    if budget <= 0:
        raise ValueError(f"{model_name} ({quant}) leaves no room for a KV cache in the "
                         f"{target.memory_bytes / 2**30:.0f} GiB of a {target.describe()}")
    plan = plan_kv_cache(kv_local_config(cfg, mesh), kv_dtype, engine_cfg.page_size,
                         engine_cfg.max_model_len, engine_cfg.max_num_batched_tokens,
                         engine_cfg.max_num_seqs, None,
                         fit_max_model_len=False, kv_cache_memory=budget)
    if requested.max_model_len is None:
        engine_cfg = resolve_engine_config(requested, cfg.max_position_embeddings,
                                           target.platform, plan.num_pages * engine_cfg.page_size)
    return cfg, model, engine_cfg, plan.num_pages


def lower_serving_programs(model_name: str = "llama3.1-8b", quant: str = "none",
                           chip: str = "v6e", kv_dtype_name: str = "auto",
                           max_programs: int | None = None, tp: int = 1, on_program=None,
                           platform: str = "tpu", gpu: str = "h200", **overrides) -> dict:
    """Lowers the step programs of the serving configuration (see the module docstring) for a
    TPU `chip` or, with platform "gpu", a `gpu`; returns the report: the configuration, the
    programs and the failures. tp > 1: over a (data 1, model tp) mesh of this host's first tp
    devices (fake CPU devices will do). on_program(Program) is called after each program."""
    target = target_of(platform, chip, gpu)
    mesh = None if tp == 1 else make_mesh(tp=tp, dp=1, devices=jax.devices()[:tp])
    cfg, model, engine_cfg, num_pages = serving_setup(model_name, quant, target, kv_dtype_name,
                                                      overrides, mesh)
    kernels = select_kernels(target.platform, hopper=target.hopper,
                             device_kind=target.device_kind,
                             mesh_axes=() if mesh is None else tuple(mesh.shape.items()))
    pool = BlockPool(num_pages, engine_cfg.page_size, engine_cfg.enable_prefix_caching)
    max_width = pool.pages_needed(engine_cfg.max_model_len)
    make_runner = LoweringRunner if mesh is None else functools.partial(ShardedLoweringRunner,
                                                                        mesh=mesh)
    runner = make_runner(cfg, model, num_pages, engine_cfg.page_size, engine_cfg.kv_cache_dtype,
                         engine_cfg.max_num_seqs, max_width, kernels=kernels, target=target,
                         limit=max_programs, on_program=on_program)
    # The engine's warm-up walk (engine/warmup.py) over this runner.
    num_steps = engine_cfg.num_decode_steps
    shapes = reachable_steps(engine_cfg, pool, runner.min_width,
                             fixed_width=runner.fixed_width,
                             count_prefill_seqs=runner.counts_prefill_seqs)
    try:
        for shape in shapes:
            compile_step(runner, *shape, num_steps=num_steps,
                         mixed_rounds=engine_cfg.mixed_rounds)
    except EnoughPrograms:
        pass
    # Under a mesh the TPU's quantized products are XLA's (ops.backends._select_tpu_kernels);
    # a GPU's take one of several kernels by rows and layout (ops/backends.py): not required.
    if target.platform == "gpu":
        required = [GPU_ATTENTION_KERNEL]
    else:
        required = [ATTENTION_KERNEL] + ([QUANT_KERNEL] if quant != "none" and tp == 1 else [])
    failures = [f"{p.kind} [{p.shape}]: " + (p.error or "no " + ", ".join(
        k for k in required if k not in p.kernels)) for p in runner.programs
        if p.error or any(k not in p.kernels for k in required)]
    return {"model": model_name, "quant": quant, "platform": target.platform,
            "chip": target.name, "target": target.describe(), "tp": tp, "kv_pages": num_pages,
            "engine_config": dataclasses.asdict(engine_cfg), "kernels": str(kernels),
            "required_kernels": required, "programs": [dataclasses.asdict(p)
                                                       for p in runner.programs],
            "failures": failures}


def print_report(report: dict, file=sys.stdout) -> None:
    cfg = report["engine_config"]
    print(f"{report['model']} ({report['quant']}) for {report['target']} x{report['tp']}: "
          f"{len(report['programs'])} step programs; {report['kv_pages']} KV pages of "
          f"{cfg['page_size']}; max_num_seqs {cfg['max_num_seqs']}, max_num_batched_tokens "
          f"{cfg['max_num_batched_tokens']}, max_model_len {cfg['max_model_len']}", file=file)
    counts = collections.Counter()
    for p in report["programs"]:
        counts.update(p["kernels"])
    print("kernels over all programs: " + (", ".join(
        f"{k} x{n}" for k, n in sorted(counts.items())) or "none"), file=file)
    seconds = [p["seconds"] for p in report["programs"]]
    if seconds:
        print(f"traced and lowered in {sum(seconds):.1f} s in all, {max(seconds):.1f} s the "
              f"longest program", file=file)
    for failure in report["failures"]:
        print(f"FAILED {failure.splitlines()[0]}", file=file)
    print("ok" if not report["failures"] else f"{len(report['failures'])} failures", file=file)


def print_program(p: Program) -> None:
    """One line per lowered program on stderr, as the run goes."""
    status = f"FAILED {p.error.splitlines()[0]}" if p.error else \
        ", ".join(f"{k} x{n}" for k, n in sorted(p.kernels.items())) or "-"
    print(f"  {p.kind:<16} {p.shape:<60} {p.seconds:6.1f}s  {status}", file=sys.stderr,
          flush=True)


def main(argv) -> int:
    del argv
    if FLAGS.tp > 1:  # before jax starts its CPU backend: enough fake devices for the mesh
        jax.config.update("jax_num_cpu_devices", max(FLAGS.tp, 8))
    overrides = dict(max_num_seqs=FLAGS.max_num_seqs,
                     max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                     max_model_len=FLAGS.max_model_len, num_decode_steps=FLAGS.num_decode_steps,
                     num_pages=FLAGS.num_pages)
    report = lower_serving_programs(FLAGS.model, FLAGS.quant, FLAGS.chip, FLAGS.kv_cache_dtype,
                                    FLAGS.max_programs, FLAGS.tp,
                                    None if FLAGS.json else print_program,
                                    platform=FLAGS.platform, gpu=FLAGS.gpu, **overrides)
    if FLAGS.json:
        json.dump(report, sys.stdout, indent=1, default=str)
        print()
    else:
        print_report(report)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
