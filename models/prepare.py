"""A loaded (and possibly quantized) model made ready for the device it runs on.

Two preparations change how a step runs, not what it computes:
  * fused projections (models.llama.fuse_projections): each layer's q/k/v and gate/up kernels
    concatenated into one product each; fewer, larger matmuls in a decode step. Auto: on a GPU
    or the CPU without a mesh (the sharding rules know only the unfused weights; on the CPU
    SmolLM2 decodes 1.2x faster fused, FUSED_PLATFORMS).
  * layers transposed for the GEMV kernel (models.llama.transpose_for_gemv): the four fused
    products stored [out, in], so that steps of few rows run each one as a kernel with its
    RMSNorm, SiLU x up and residual add inside (ops/gemv.py), and quantized products of more
    rows the Hopper kernel. Auto: a dense INT8 / INT4 model on one Hopper GPU. Not a mixture:
    its experts take their own kernels, its decode measured the same fraction of its floor
    either way, and its transposed programs compiled an order of magnitude slower
    (docs/PERFORMANCE.md).

`prepare_for_device` is what scripts.generate, scripts.serve and engine.api.load_engine run, so a
Python user gets the model the command line gets. Its arguments are explicit: the platform, whether
the device is a Hopper GPU, the mesh, and the two choices (None: auto). Nothing is printed; the
changes made or skipped come back as notes.
"""
from __future__ import annotations

import dataclasses

from configs.model import ModelConfig
from models.llama import (LlamaForCausalLM, fuse_projections as fuse_model_projections,
                          has_quantized_layers, transpose_for_gemv)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The prepared config and model, and one line per change made or skipped (for a log)."""

    cfg: ModelConfig
    model: LlamaForCausalLM
    notes: tuple[str, ...]


# Platforms whose steps measured faster with fused projections (docs/PERFORMANCE.md); a TPU's
# are not measured yet.
FUSED_PLATFORMS = ("gpu", "cpu")


def fusion_wanted(requested: bool | None, platform: str, mesh) -> bool:
    """Whether to fuse projections: `requested`, or when None auto (FUSED_PLATFORMS, no mesh).

    ValueError when fusion is requested with a mesh.
    """
    if requested is None:
        return platform in FUSED_PLATFORMS and mesh is None
    if requested and mesh is not None:
        raise ValueError("fuse_projections=True (--fuse_projections=true) needs one device: the "
                         "sharding rules of a --tp/--dp mesh know only the unfused q/k/v and "
                         "gate/up weights")
    return requested


def gemv_wanted(requested: bool | None, quantized: bool, hopper: bool, mesh,
                mixture: bool = False) -> bool:
    """Whether to store the layers transposed: `requested`, or when None auto: a quantized dense
    model (INT8 / INT4 codes, not a mixture of experts) on a Hopper GPU without a mesh, where
    the Hopper kernel runs every quantized product faster than the [in, out] codes' path."""
    if requested is None:
        return quantized and hopper and mesh is None and not mixture
    return requested


def check_preparation(platform: str, mesh, fuse_projections: bool | None,
                      gemv_layers: bool | None) -> None:
    """ValueError when the requested preparation cannot apply to this device and mesh; cheap,
    so callers run it before loading."""
    fusion_wanted(fuse_projections, platform, mesh)
    if gemv_layers and (mesh is not None or fuse_projections is False):
        raise ValueError("gemv_layers=True (--gemv_layers) needs fused projections on one device "
                         "(drop fuse_projections=False / --fuse_projections=false and --tp/--dp)")


def fuse_as_wanted(cfg: ModelConfig, model: LlamaForCausalLM, requested: bool | None,
                   platform: str, mesh=None, label: str = "model"
                   ) -> tuple[ModelConfig, LlamaForCausalLM, list[str]]:
    """(cfg, model, notes), q/k/v and gate/up fused in place when `fusion_wanted` says so.

    Requested and impossible (act-order or mixed quantized kernels): ValueError, the model whole;
    wanted by auto and impossible: a note, the model whole.
    """
    if cfg.fused_projections or not fusion_wanted(requested, platform, mesh):
        return cfg, model, []
    try:
        cfg, model = fuse_model_projections(cfg, model)
    except ValueError as e:  # checked before any change: the model is still whole
        if requested:
            raise ValueError(f"fuse_projections: {e}") from None
        return cfg, model, [f"note: {label} projections left unfused ({e})"]
    return cfg, model, [f"{label}: q/k/v and gate/up projections fused"]


def transpose_as_wanted(cfg: ModelConfig, model: LlamaForCausalLM, requested: bool | None,
                        hopper: bool, mesh=None, label: str = "model"
                        ) -> tuple[ModelConfig, LlamaForCausalLM, list[str]]:
    """(cfg, model, notes), the layers transposed (models.llama.transpose_for_gemv) when
    `gemv_wanted` says so. Requested and impossible: ValueError; wanted by auto and impossible
    (unfused or act-order): a note, the model whole."""
    if cfg.gemv_layers or not gemv_wanted(requested, has_quantized_layers(model), hopper, mesh,
                                          mixture=cfg.num_experts > 0):
        return cfg, model, []
    if not cfg.fused_projections:
        if requested:
            raise ValueError("gemv_layers needs fused projections (auto fusion is off on this "
                             "platform: add fuse_projections=True / --fuse_projections)")
        return cfg, model, [f"note: {label} layers left in [in, out] (projections unfused)"]
    try:
        cfg, model = transpose_for_gemv(cfg, model)
    except ValueError as e:  # checked before any change
        if requested:
            raise ValueError(f"gemv_layers: {e}") from None
        return cfg, model, [f"note: {label} layers left in [in, out] ({e})"]
    auto = "" if requested else " (auto: quantized, Hopper GPU)"
    return cfg, model, [f"{label}: layers transposed for the batch-1 gemv kernel{auto}"]


def prepare_for_device(cfg: ModelConfig, model: LlamaForCausalLM, *, platform: str,
                       hopper: bool, mesh=None, fuse_projections: bool | None = None,
                       gemv_layers: bool | None = None, label: str = "model") -> Prepared:
    """The model laid out for its device: fused, then transposed, as wanted.

    platform: jax.default_backend() of the device ("cpu", "gpu", "tpu"); hopper: it is a Hopper
    GPU (ops.quant_wgmma.on_hopper); mesh: the (data, model) mesh the model is sharded over, or
    None for one device. fuse_projections / gemv_layers: True or False force the choice, None
    picks by device (see the module docstring). Call after loading and quantizing; the model is
    changed in place. ValueError when a forced choice cannot apply (checked before any change).
    """
    check_preparation(platform, mesh, fuse_projections, gemv_layers)
    cfg, model, fused = fuse_as_wanted(cfg, model, fuse_projections, platform, mesh, label)
    cfg, model, transposed = transpose_as_wanted(cfg, model, gemv_layers, hopper, mesh, label)
    return Prepared(cfg, model, tuple(fused + transposed))
