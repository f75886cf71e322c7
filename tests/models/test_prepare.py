"""models.prepare.prepare_for_device: the device decides the layout, explicit choices win, and a
choice that cannot apply is a ValueError before anything changes."""
from __future__ import annotations

import gc

import jax
import pytest

from configs.model import TINY_LLAMA, TINY_QWEN3_MOE
from models.prepare import prepare_for_device
from models.weights import random_model
from quant.model import QuantConfig, quantize_model


def fresh(method=None):
    model = random_model(TINY_LLAMA, seed=3)
    if method:
        model = quantize_model(TINY_LLAMA, model, QuantConfig(method), progress=False)
    return TINY_LLAMA, model


@pytest.mark.parametrize("platform,hopper,fuse,gemv,method,want_fused,want_gemv", [
    ("cpu", False, None, None, None, True, False),     # the CPU: fused
    ("tpu", False, None, None, None, False, False),    # a TPU: as loaded
    ("gpu", False, None, None, None, True, False),     # a GPU: fused
    ("gpu", True, None, None, None, True, False),      # float on Hopper: not transposed
    ("gpu", True, None, None, "int8", True, True),     # INT8 on Hopper: fused and transposed
    ("gpu", False, False, None, None, False, False),   # fusion forced off
    ("cpu", False, True, True, None, True, True),      # both forced on, on the CPU
])
def test_layout_per_device(platform, hopper, fuse, gemv, method, want_fused, want_gemv):
    cfg, model = fresh(method)
    prepared = prepare_for_device(cfg, model, platform=platform, hopper=hopper,
                                  fuse_projections=fuse, gemv_layers=gemv)
    assert prepared.cfg.fused_projections == want_fused
    assert prepared.cfg.gemv_layers == want_gemv
    assert len(prepared.notes) == want_fused + want_gemv
    assert hasattr(prepared.model.layers[0].self_attn, "qkv_proj") == want_fused


def test_gemv_layers_where_auto_fusion_is_off_is_one_clear_error():
    cfg, model = fresh()
    with pytest.raises(ValueError, match=r"gemv_layers needs fused projections \(auto fusion is "
                                         r"off on this platform: add fuse_projections=True"):
        prepare_for_device(cfg, model, platform="tpu", hopper=False, gemv_layers=True)
    assert not hasattr(model.layers[0].self_attn, "qkv_proj")  # untouched


def test_a_mesh_keeps_the_unfused_layout_and_refuses_forced_fusion():
    cfg, model = fresh()
    mesh = object()  # any mesh
    prepared = prepare_for_device(cfg, model, platform="gpu", hopper=True, mesh=mesh)
    assert not prepared.cfg.fused_projections and prepared.notes == ()
    with pytest.raises(ValueError, match="fuse_projections=True .* needs one device"):
        prepare_for_device(cfg, model, platform="gpu", hopper=True, mesh=mesh,
                           fuse_projections=True)
    with pytest.raises(ValueError, match=r"\(--gemv_layers\) needs fused projections"):
        prepare_for_device(cfg, model, platform="gpu", hopper=True, fuse_projections=False,
                           gemv_layers=True)
    assert not hasattr(model.layers[0].self_attn, "qkv_proj")  # untouched


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN3_MOE], ids=lambda c: c.name)
def test_rewriting_the_layers_frees_each_replaced_kernel_as_it_goes(cfg):
    """Fusing and transposing replace kernels in place; each replaced kernel leaves memory as
    it is dropped (nnx's leftover reference cycles are collected first), not at the next
    cyclic collection: with the collector off, the live arrays still hold the model's bytes
    once (a bf16 qwen3-30b-a3b kept 38 GB of old experts alive and ran out of an 80 GB GPU)."""
    def live_bytes():
        return sum(a.nbytes for a in jax.live_arrays())

    gc.collect()
    gc.disable()
    try:
        model = random_model(cfg, seed=3)
        before = live_bytes()
        prepared = prepare_for_device(cfg, model, platform="cpu", hopper=False,
                                      fuse_projections=True, gemv_layers=True)
        after = live_bytes()
    finally:
        gc.enable()
    assert prepared.cfg.fused_projections and prepared.cfg.gemv_layers
    assert after == before
