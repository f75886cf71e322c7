"""The scanned layer loop (models/layer_scan.py): one layer body over the per-layer weights and
a stacked KV cache computes what the unrolled loop computes (HF transformers' goldens, in
tests/models/test_golden.py, which scans on the CPU; the unrolled engine's tokens with an int8
cache), the cache's per-layer views, where the loop is chosen, and its GPU lowering."""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from configs.model import TINY_LLAMA31, get_preset
from configs.switches import Switches
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.runner import ModelRunner
from models.kv_cache import KVCache, init_kv_cache
from models.layer_scan import scannable
from models.weights import abstract_model, random_model
from ops.backends import DEFAULT_LAYER_LOOPS, choose_layer_loop, select_kernels
from ops.kernel_choice import REFERENCE
from ops.kv_quant import QuantizedPages
from quant.loader import load_model
from tests.conftest import GOLDEN_DIR
from tests.models.lowering import lowered_step_text
from tests.ops.conftest import h200_lowering  # noqa: F401  (the fixture)

SCAN = dataclasses.replace(REFERENCE, layer_loop="scan")
@pytest.mark.parametrize("name", ("tiny-llama", "tiny-qwen2", "tiny-gemma2", "tiny-gemma3",
                                  "tiny-phi3"))
def test_the_golden_tests_run_the_scan_on_the_cpu(name):
    """tests/models/test_golden.py checks logits and greedy tokens against HF transformers
    through ModelRunner, which on the CPU scans every family's layers (Gemma's per-layer windows
    and local RoPE as scanned data, Qwen2's biases as scanned vectors)."""
    loaded = load_model(os.path.join(GOLDEN_DIR, name))
    runner = ModelRunner(loaded.cfg, loaded.model, 4, 4)
    assert runner.layer_loop == "scan" and runner.cache.stacked_layers == loaded.cfg.num_layers


def test_scanned_engine_with_an_int8_cache_gives_the_unrolled_tokens(monkeypatch):
    """Prefill chunks, decodes beside them, and every layer's int8 pages and scales."""
    cfg = TINY_LLAMA31
    model = random_model(cfg, 11)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 21)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine_cfg = EngineConfig(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16,
                              page_size=8, kv_cache_dtype="int8")
    tokens = []
    for loop in ("unrolled", "scan"):
        monkeypatch.setenv("PALLASITE_LAYER_LOOP", loop)  # read when the runner is built
        engine = LLMEngine(cfg, model, None, engine_cfg)
        assert engine.runner.layer_loop == loop
        assert engine.runner.cache.stacked_layers == (cfg.num_layers if loop == "scan" else 0)
        tokens.append([o.output_ids for o in engine.generate(prompts, params)])
    assert tokens[0] == tokens[1]


def test_a_stacked_cache_views_each_layer_and_keeps_its_type():
    cfg = TINY_LLAMA31
    for dtype in ("float32", "int8"):
        dtype = jax.numpy.dtype(dtype)
        cache = init_kv_cache(cfg, 6, 4, dtype, stacked=True)
        assert cache.stacked_layers == cfg.num_layers == cache.num_layers
        assert cache.num_pages == 6 and cache.page_size == 4
        assert cache.k_pages[0].shape == (cfg.num_kv_heads, 6 * cfg.num_layers, 4, cfg.head_dim)
        assert cache.nbytes() == init_kv_cache(cfg, 6, 4, dtype).nbytes()
        keys, values = cache.stacked_pages()
        marked = jax.tree.map(lambda a: a.at[:, 6:12].set(1), keys)  # layer 1's pages
        cache = cache.with_stacked_pages(marked, values)
        k0, _ = cache.layer(0)
        k1, _ = cache.layer(1)
        assert isinstance(k1, QuantizedPages) == (dtype == np.int8)
        assert float(jax.tree.leaves(k1)[0].min()) == 1.0
        assert float(jax.tree.leaves(k0)[0].max()) == 0.0
        with pytest.raises(IndexError):
            cache.layer(cfg.num_layers)
    with pytest.raises(ValueError, match="one page array"):
        KVCache(cache.k_pages * 2, cache.v_pages * 2, stacked_layers=2)


def test_the_layer_loop_is_chosen_per_platform_in_one_place():
    assert DEFAULT_LAYER_LOOPS == {"cpu": "scan", "gpu": "unrolled", "tpu": "unrolled"}
    assert select_kernels("cpu").layer_loop == "scan"
    assert select_kernels("gpu").layer_loop == "unrolled"
    assert select_kernels("gpu", switches=Switches(layer_loop="scan")).layer_loop == "scan"
    assert choose_layer_loop("cpu", switches=Switches(layer_loop="unrolled")) == "unrolled"
    assert select_kernels("cpu", mesh_axes=(("data", 1), ("model", 2))).layer_loop == "unrolled"
    assert Switches.from_env({"PALLASITE_LAYER_LOOP": "Scan"}).layer_loop == "scan"
    with pytest.raises(ValueError, match="PALLASITE_LAYER_LOOP"):
        Switches.from_env({"PALLASITE_LAYER_LOOP": "fold"})
    with pytest.raises(ValueError, match="layer_loop"):
        dataclasses.replace(REFERENCE, layer_loop="fold")


def test_layers_that_cannot_share_a_body_run_unrolled():
    cfg = TINY_LLAMA31
    model = random_model(cfg, 1)
    assert scannable(cfg, model.layers, SCAN) is None
    gemma = cfg.replace(layer_types=("sliding_attention", "full_attention") * (
        cfg.num_layers // 2), sliding_window=8)
    assert scannable(gemma, model.layers, SCAN) is None  # the window as data
    pallas = dataclasses.replace(SCAN, attention="pallas")
    assert "window" in scannable(gemma, model.layers, pallas)  # the kernel's window is static
    model.layers[0].mlp.down_proj.bias = nnx.data(nnx.Param(jax.numpy.zeros(cfg.hidden_size)))
    assert "layer 1 differs" in scannable(cfg, model.layers, SCAN)
    runner = ModelRunner(cfg, model, 4, 4, kernels=SCAN)
    assert runner.layer_loop == "unrolled" and not runner.cache.stacked_layers
    moe = get_preset("tiny-mixtral")  # its experts are not Linear weights the body picks
    assert "expert" in scannable(moe, random_model(moe, 1).layers, SCAN)


def test_a_scanned_step_lowers_with_the_gpu_kernels(h200_lowering):  # noqa: F811
    """PALLASITE_LAYER_LOOP=scan on an H200 (the A/B): Llama's layers as one while loop whose
    products switch over the layers' weights, around the Pallas RoPE + KV write and attention
    kernels over the stacked pages."""
    cfg = get_preset("llama3.2-1b").replace(num_layers=3)
    kernels = select_kernels("gpu", hopper=True, switches=Switches(layer_loop="scan"))
    assert scannable(cfg, abstract_model(cfg, jax.numpy.bfloat16).layers, kernels) is None
    text = lowered_step_text(cfg, kernels, num_pages=64, page_size=16, tokens=64, seqs=4,
                             width=16, stacked=True)
    assert "triton" in text and h200_lowering
    assert "stablehlo.while" in text and "stablehlo.case" in text
