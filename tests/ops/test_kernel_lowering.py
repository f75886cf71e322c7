"""Every kernel call is traced and lowered once per distinct shape, however many layers call it:
a step's program holds each Triton module once (jitted kernel calls, ARCHITECTURE.md "Kernel
calls"), so a deep model's programs trace and lower in about the time of a shallow one's."""
from __future__ import annotations

import re

import jax
import pytest

from configs.model import get_preset
from models.llama import DecoderLayer, fuse_projections, transpose_for_gemv
from ops.backends import select_kernels
from quant.model import QuantConfig, quantize_model
from tests.models.lowering import lowered_step_text

GPU = select_kernels("gpu", hopper=False)
ON_GPU = jax.default_backend() == "gpu"


def _int4(cfg, model):
    return cfg, quantize_model(cfg, model, QuantConfig("int4_rtn", group_size=32),
                               progress=False)


def _fused(cfg, model):
    return fuse_projections(cfg, model)


def _int4_gemv(cfg, model):
    return transpose_for_gemv(*fuse_projections(*_int4(cfg, model)), kernels=GPU)


def _int4_fused(cfg, model):
    return fuse_projections(*_int4(cfg, model))


@pytest.mark.skipif(ON_GPU, reason="lowers for CUDA from shapes: the CPU's check")
@pytest.mark.parametrize("model, build, tokens", [
    ("tiny-qwen3-moe", _fused, 2),          # bf16 experts, the one-row kernel
    ("tiny-qwen3-moe", _int4_fused, 2),     # INT4 experts and INT4 attention products
    ("tiny-qwen3-moe", _fused, 8),          # rows sorted by expert, the grouped kernel
    ("tiny-llama", _int4_gemv, 2),          # transposed INT4 layers, the gemv kernel
    ("tiny-llama", _int4_fused, 8),         # INT4 products of several rows
], ids=["moe bf16", "moe int4", "moe grouped", "dense int4 gemv", "dense int4"])
def test_each_kernel_is_lowered_once_however_many_layers(h200_lowering, model, build, tokens):
    shapes = dict(num_pages=8, page_size=4, tokens=tokens, seqs=tokens, width=4, build=build)
    modules, calls = [], []
    for layers in (2, 5):
        h200_lowering.clear()
        cfg = get_preset(model).replace(num_layers=layers)
        text = lowered_step_text(cfg, GPU, **shapes)
        modules.append(len(h200_lowering))
        calls.append(text.count("__gpu$xla.gpu.triton"))
    assert modules[0] == modules[1] == calls[0] == calls[1] >= 4


@pytest.mark.skipif(ON_GPU, reason="lowers for CUDA from shapes: the CPU's check")
@pytest.mark.parametrize("model, traces", [("tiny-llama", 1), ("tiny-gemma2", 2)])
def test_unrolled_layers_are_traced_once_per_structure(h200_lowering, monkeypatch, model,
                                                       traces):
    """models.llama.run_layer: an unrolled step traces one layer of each (structure, window),
    however many layers it runs (tiny-gemma2 alternates a sliding window and the full context),
    and calls it once a layer with that layer's own arrays (the unrolled path's numerics: the
    mixtures' tests against HF, which run unrolled on the CPU too)."""
    calls = []
    layer_call = DecoderLayer.__call__

    def spy(self, *args, **kwargs):
        calls.append(True)
        return layer_call(self, *args, **kwargs)
    monkeypatch.setattr(DecoderLayer, "__call__", spy)
    cfg = get_preset(model)
    cfg = cfg.replace(num_layers=6, layer_types=cfg.layer_types * 3)
    text = lowered_step_text(cfg, GPU, num_pages=8, page_size=4, tokens=2, seqs=2, width=4)
    assert len(calls) == traces
    operands = re.findall(r"call @_layer_program(?:_\d+)?\(([^)]*)\)", text)
    first_weights = {ops.split(",")[0] for ops in operands}  # the state's first leaf
    assert len(operands) == len(first_weights) == cfg.num_layers  # each layer its own arrays
