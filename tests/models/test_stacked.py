"""The scanned layer loop (models/stacked.py): stacked layers and a stacked KV cache compute
what the unrolled loop computes (HF transformers' goldens, and the unrolled engine's tokens with
an int8 cache), the cache's per-layer views, and where the loop is chosen."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from configs.model import TINY_LLAMA31
from configs.switches import Switches
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.runner import full_sequence_logits
from models.kv_cache import KVCache, init_kv_cache
from models.prepare import prepare_for_device
from models.stacked import StackedLayers, is_stacked, stack_layers
from models.weights import random_model
from ops.backends import LAYER_LOOPS, choose_layer_loop
from ops.kv_quant import QuantizedPages
from quant.loader import load_model
from tests.conftest import GOLDEN_DIR
from tests.models.test_golden import greedy, relative_error

# Gemma 3: sliding and full layers (the window as scanned data) with local RoPE frequencies;
# Qwen3: q/k norms and an untied head.
GOLDEN = ("tiny-llama", "tiny-gemma3", "tiny-qwen3")


@pytest.mark.parametrize("name", GOLDEN)
def test_stacked_tiny_models_match_transformers(name):
    directory = os.path.join(GOLDEN_DIR, name)
    loaded, golden = load_model(directory), dict(np.load(os.path.join(directory, "golden.npz")))
    loaded.model.layers = stack_layers(loaded.model.layers)
    logits = full_sequence_logits(loaded.cfg, loaded.model, golden["input_ids"], page_size=4)
    assert relative_error(logits, golden["logits"]) < 1e-4  # float32, as the unrolled model
    if name == "tiny-gemma3":  # past the sliding window, through several steps
        prompts = [row.tolist() for row in golden["input_ids"]]
        assert greedy(loaded, prompts, golden["greedy_ids"].shape[1]) == \
            golden["greedy_ids"].tolist()


def test_scanned_engine_with_an_int8_cache_gives_the_unrolled_tokens():
    """Prefill chunks, decodes beside them, and every layer's int8 pages and scales."""
    cfg = TINY_LLAMA31
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 37, 18)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine_cfg = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                              page_size=8, kv_cache_dtype="int8")
    tokens = []
    for stacked in (False, True):
        model = random_model(cfg, 11)
        if stacked:
            model.layers = stack_layers(model.layers)
        engine = LLMEngine(cfg, model, None, engine_cfg)
        assert engine.runner.cache.stacked_layers == (cfg.num_layers if stacked else 0)
        tokens.append([o.output_ids for o in engine.generate(prompts, params)])
    assert tokens[0] == tokens[1]


def test_stacked_layers_hold_every_layer_and_index_back():
    cfg = TINY_LLAMA31
    model = random_model(cfg, 2)
    before = [np.asarray(layer.mlp.down_proj.kernel.get_value()) for layer in model.layers]
    stacked = stack_layers(model.layers)
    assert isinstance(stacked, StackedLayers) and len(stacked) == cfg.num_layers
    assert stacked.layer.mlp.down_proj.kernel.get_value().shape == (cfg.num_layers,) + \
        before[0].shape
    for i, layer in enumerate(stacked):
        np.testing.assert_array_equal(np.asarray(layer.mlp.down_proj.kernel.get_value()),
                                      before[i])
    with pytest.raises(ValueError, match="stacked already"):
        stack_layers(stacked)


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
        k1, _ = cache.layer(1)
        k0, _ = cache.layer(0)
        assert isinstance(k1, QuantizedPages) == (dtype == np.int8)
        assert float(jax.tree.leaves(k1)[0].min()) == 1.0
        assert float(jax.tree.leaves(k0)[0].max()) == 0.0
        with pytest.raises(IndexError):
            cache.layer(cfg.num_layers)
    with pytest.raises(ValueError, match="one page array"):
        KVCache(cache.k_pages * 2, cache.v_pages * 2, stacked_layers=2)


def test_the_layer_loop_is_chosen_per_platform_in_one_place():
    assert LAYER_LOOPS == {"cpu": "scan", "gpu": "unrolled", "tpu": "unrolled"}
    assert choose_layer_loop("cpu") == "scan" and choose_layer_loop("gpu") == "unrolled"
    assert choose_layer_loop("gpu", switches=Switches(layer_loop="scan")) == "scan"
    assert choose_layer_loop("cpu", switches=Switches(layer_loop="unrolled")) == "unrolled"
    assert choose_layer_loop("cpu", mesh=True) == "unrolled"
    # a per-layer window is data for the jnp attention, static for the Pallas kernel
    assert choose_layer_loop("cpu", varying_windows=True) == "scan"
    assert choose_layer_loop("gpu", switches=Switches(layer_loop="scan"),
                             varying_windows=True) == "unrolled"
    assert Switches.from_env({"PALLASITE_LAYER_LOOP": "Scan"}).layer_loop == "scan"
    with pytest.raises(ValueError, match="PALLASITE_LAYER_LOOP"):
        Switches.from_env({"PALLASITE_LAYER_LOOP": "fold"})


def test_prepare_stacks_last_as_asked(monkeypatch):
    monkeypatch.delenv("PALLASITE_LAYER_LOOP", raising=False)
    cfg = TINY_LLAMA31
    prepared = prepare_for_device(cfg, random_model(cfg, 1), platform="cpu", hopper=False)
    assert is_stacked(prepared.model) and "stacked" in prepared.notes[-1]
    prepared = prepare_for_device(cfg, random_model(cfg, 1), platform="cpu", hopper=False,
                                  fuse_projections=True, layer_loop="scan")
    assert prepared.cfg.fused_projections and is_stacked(prepared.model)  # fused, then stacked
    assert not is_stacked(prepare_for_device(cfg, random_model(cfg, 1), platform="cpu",
                                             hopper=False, layer_loop="unrolled").model)
    monkeypatch.setenv("PALLASITE_LAYER_LOOP", "unrolled")
    assert not is_stacked(prepare_for_device(cfg, random_model(cfg, 1), platform="cpu",
                                             hopper=False).model)
    with pytest.raises(ValueError, match="layer_loop"):
        prepare_for_device(cfg, random_model(cfg, 1), platform="cpu", hopper=False,
                           layer_loop="loop")
    with pytest.raises(ValueError, match="one device"):
        prepare_for_device(cfg, random_model(cfg, 1), platform="cpu", hopper=False,
                           mesh=object(), layer_loop="scan")
