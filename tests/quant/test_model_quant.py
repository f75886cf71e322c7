"""Whole-model quantization: every method through the engine, and checkpoints that round-trip."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import TINY_LLAMA, TINY_LLAMA31
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.perplexity import full_sequence_logits
from models.llama import has_quantized_layers
from models.orbax_io import CONFIG_FILE, save_checkpoint
from models.weights import random_model
from quant.calibration import linear_modules
from quant.loader import load_checkpoint
from quant.model import QuantConfig, model_nbytes, quantize_model, quantized_abstract_model
from quant.qtensor import QuantizedWeight, dequantize

CALIB = np.random.default_rng(0).integers(3, 256, (4, 32)).astype(np.int32)
IDS = np.random.default_rng(1).integers(3, 256, (1, 20)).astype(np.int32)
CONFIGS = [
    QuantConfig("int8"), QuantConfig("int4_rtn", group_size=32),
    QuantConfig("int4_gptq", group_size=32, symmetric=True, act_order=True),
    QuantConfig("int4_awq", group_size=64),
]
GPTQ = CONFIGS[2]


def logits_of(model, ids):
    """Logits [B, T, V] of token rows through the engine's forward (one prefill, fresh cache)."""
    return full_sequence_logits(TINY_LLAMA31, model, ids)


@pytest.fixture(scope="module")
def quantized():
    """{QuantConfig: (float logits, quantized model)} of the tiny GQA model."""
    cfg = TINY_LLAMA31
    reference = logits_of(random_model(cfg, seed=2), IDS)
    out = {}
    for qcfg in CONFIGS:
        model = quantize_model(cfg, random_model(cfg, seed=2), qcfg, CALIB, progress=False)
        out[qcfg] = reference, model
    return out


@pytest.mark.parametrize("qcfg", CONFIGS, ids=lambda q: q.describe().replace(" ", "-"))
def test_quantized_model_is_its_dequantized_float_model(quantized, qcfg):
    """The quantized layers compute exactly x @ dequantize(w), and stay near the float model."""
    cfg = TINY_LLAMA31
    reference, model = quantized[qcfg]
    assert has_quantized_layers(model)
    weights = [m.kernel.get_value() for layer in model.layers
               for m in linear_modules(layer).values()]
    assert all(isinstance(w, QuantizedWeight) and w.bits == qcfg.bits for w in weights)
    assert any(w.perm is not None for w in weights) == qcfg.act_order
    logits = logits_of(model, IDS)
    dequantized = random_model(cfg, seed=2)
    for layer, qlayer in zip(dequantized.layers, model.layers):
        for (name, m), qm in zip(linear_modules(layer).items(), linear_modules(qlayer).values()):
            m.kernel.set_value(dequantize(qm.kernel.get_value()))
        if qcfg.method == "int4_awq":  # AWQ also rescaled the norms and biases
            layer.input_layernorm.weight.set_value(qlayer.input_layernorm.weight.get_value())
            layer.post_attention_layernorm.weight.set_value(
                qlayer.post_attention_layernorm.weight.get_value())
    np.testing.assert_allclose(logits, logits_of(dequantized, IDS),
                               rtol=1e-4, atol=1e-4)
    tolerance = 0.05 if qcfg.bits == 8 else 0.5
    assert np.abs(logits - reference).max() < tolerance * np.abs(reference).max()


@pytest.mark.parametrize("qcfg", CONFIGS[::2], ids=lambda q: q.method)
def test_quantized_checkpoint_round_trips_identical_logits(quantized, qcfg, tmp_path):
    cfg = TINY_LLAMA31
    _, model = quantized[qcfg]
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, cfg, model, quantization=qcfg.to_dict())
    with open(os.path.join(path, CONFIG_FILE)) as f:
        assert json.load(f)["quantization"]["method"] == qcfg.method
    cfg2, restored, _ = load_checkpoint(path)
    assert cfg2 == cfg and has_quantized_layers(restored)
    assert model_nbytes(restored) == model_nbytes(model)
    np.testing.assert_array_equal(logits_of(restored, IDS), logits_of(model, IDS))
    # Loading in bfloat16 casts scales, never the packed codes.
    _, bf16, _ = load_checkpoint(path, jnp.bfloat16)
    w = bf16.layers[0].mlp.down_proj.kernel.get_value()
    assert w.packed.dtype == model.layers[0].mlp.down_proj.kernel.get_value().packed.dtype
    assert w.scales.dtype == jnp.bfloat16


def test_quantized_model_generates_through_the_engine(quantized):
    """Greedy decode through the paged engine: each token the argmax of a full forward."""
    cfg = TINY_LLAMA31
    _, model = quantized[GPTQ]
    engine = LLMEngine(cfg, model, None, EngineConfig(max_model_len=64, max_num_seqs=2,
                                                      page_size=8))
    prompt = [int(t) for t in IDS[0, :8]]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert len(out.output_ids) == 6
    logits = logits_of(model, np.asarray([prompt + out.output_ids]))[0]
    assert list(logits[len(prompt) - 1:-1].argmax(-1)) == out.output_ids


def test_quantized_size_and_settings():
    cfg = TINY_LLAMA
    model = random_model(cfg)
    before = model_nbytes(model)
    quantize_model(cfg, model, QuantConfig("int4_rtn", group_size=32))
    linear_params = sum(int(np.prod(m.kernel.get_value().shape)) for layer in model.layers
                        for m in linear_modules(layer).values())
    # 4 bits per weight plus one float32 scale and offset per 32 weights.
    assert before - model_nbytes(model) == linear_params * 4 - linear_params * (0.5 + 8 / 32)
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantConfig("int3")
    assert QuantConfig("int8", group_size=128, symmetric=False).symmetric
    assert QuantConfig.from_dict(QuantConfig("int4_gptq", act_order=True).to_dict()).act_order
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(cfg, random_model(cfg), QuantConfig("int4_gptq"))


def test_quantized_lm_head(tmp_path):
    """QuantConfig.lm_head: the untied head is RTN-quantized too, the model computes exactly its
    dequantized float model, and a checkpoint restores it with identical logits."""
    cfg, qcfg = TINY_LLAMA31, QuantConfig("int8", lm_head=True)
    reference = logits_of(random_model(cfg, seed=2), IDS)
    model = quantize_model(cfg, random_model(cfg, seed=2), qcfg, progress=False)
    head = model.lm_head.kernel.get_value()
    assert isinstance(head, QuantizedWeight) and head.bits == 8 and head.perm is None
    assert "+lm_head" in qcfg.describe()
    dequantized = random_model(cfg, seed=2)
    for layer, qlayer in zip(dequantized.layers, model.layers):
        for m, qm in zip(linear_modules(layer).values(), linear_modules(qlayer).values()):
            m.kernel.set_value(dequantize(qm.kernel.get_value()))
    dequantized.lm_head.kernel.set_value(dequantize(head))
    logits = logits_of(model, IDS)
    np.testing.assert_allclose(logits, logits_of(dequantized, IDS), rtol=1e-4, atol=1e-4)
    assert np.abs(logits - reference).max() < 0.05 * np.abs(reference).max()

    path = str(tmp_path / "ckpt")
    save_checkpoint(path, cfg, model, quantization=qcfg.to_dict())
    _, restored, _ = load_checkpoint(path)
    assert isinstance(restored.lm_head.kernel.get_value(), QuantizedWeight)
    np.testing.assert_array_equal(logits_of(restored, IDS), logits)


def test_quantized_lm_head_is_rtn_after_any_method():
    """A calibrated method quantizes the head by RTN after its layers (never act-order), and the
    restore target has the same structure."""
    cfg = TINY_LLAMA31
    qcfg = QuantConfig("int4_gptq", group_size=32, act_order=True, lm_head=True)
    model = quantize_model(cfg, random_model(cfg, seed=2), qcfg, CALIB[:1, :16], progress=False)
    head = model.lm_head.kernel.get_value()
    assert isinstance(head, QuantizedWeight) and head.bits == 4 and head.perm is None
    assert model.layers[0].mlp.down_proj.kernel.get_value().perm is not None
    abstract = quantized_abstract_model(cfg, qcfg)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(abstract.lm_head))
    assert shapes == jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(model.lm_head))


def test_quantized_lm_head_needs_an_untied_head():
    """A tied head is the embedding: asking to quantize it is an error before any work."""
    with pytest.raises(ValueError, match="untied output head"):
        quantize_model(TINY_LLAMA, random_model(TINY_LLAMA), QuantConfig("int8", lm_head=True))
    assert QuantConfig.from_dict(QuantConfig("int8", lm_head=True).to_dict()).lm_head
