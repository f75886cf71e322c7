"""The families' presets (real shapes, two layers) lowered with the GPU kernels for an H200,
sliding window and soft caps included, and the features the fused decode layer refuses."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from configs.model import get_preset
from engine.perplexity import full_sequence_logits
from models.llama import fuse_projections, transpose_for_gemv
from models.weights import random_model
from ops import paged_attention
from ops.backends import select_kernels
from tests.models.lowering import lowered_step_text
from tests.ops.conftest import h200_lowering  # noqa: F401  (the fixture)

FAMILIES = ("qwen3-8b", "mistral-7b", "gemma-2-9b", "gemma-3-12b", "phi-3-mini")


def two_layers(name: str):
    """The preset with one local and one global layer (or two of its only kind)."""
    cfg = get_preset(name)
    types = ("sliding_attention", "full_attention") if cfg.layer_types else ()
    return cfg.replace(num_layers=2, layer_types=types)


@pytest.mark.parametrize("name", FAMILIES)
def test_preset_lowers_with_gpu_kernels(h200_lowering, monkeypatch, name):  # noqa: F811
    cfg = two_layers(name)
    calls = []  # (sliding_window, soft_cap, scale) of each kernel call traced

    def spy(*args, **kwargs):
        calls.append((kwargs["sliding_window"], kwargs["soft_cap"], kwargs["scale"]))
        return kernel(*args, **kwargs)
    kernel = paged_attention.ragged_paged_attention
    monkeypatch.setattr(paged_attention, "ragged_paged_attention", spy)
    text = lowered_step_text(cfg, select_kernels("gpu", hopper=True), num_pages=64,
                             page_size=16, tokens=64, seqs=4, width=16)
    assert "triton" in text and h200_lowering
    # layers with the same window share one traced layer (models.llama.run_layer)
    assert calls == list(dict.fromkeys(
        (cfg.layer_window(i), cfg.attn_logit_softcap, cfg.attention_scale)
        for i in range(cfg.num_layers)))
    assert any(window is not None for window, _, _ in calls) == (cfg.sliding_window is not None)


def test_fused_decode_layer_refuses_gemma():
    cfg = get_preset("tiny-gemma2")
    cfg, model = fuse_projections(cfg, random_model(cfg))
    with pytest.raises(ValueError, match="sandwich_norms"):
        transpose_for_gemv(cfg, model, k_order="natural")


def test_qwen3_fused_decode_layer_keeps_its_norms():
    """q/k norms run inside attention_heads, so the fused decode layer computes the same."""
    cfg = get_preset("tiny-qwen3")
    model = random_model(cfg, seed=3)
    ids = jnp.arange(6, dtype=jnp.int32)[None] * 7 % cfg.vocab_size
    want = full_sequence_logits(cfg, model, ids)
    cfg, model = transpose_for_gemv(*fuse_projections(cfg, model), k_order="natural")
    got = full_sequence_logits(cfg, model, ids)
    assert jnp.allclose(got, want, atol=1e-4)
