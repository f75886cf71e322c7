"""The int8 / fp8 KV cache: quantized pages with scales, written and read end to end.

The engine's tokens with int8 pages are checked against a float64 numpy forward that attends
over the dequantized pages the engine stored; prefix-cache hits and chunked prefill must give
the same tokens as one whole prefill; a fixed --kv_cache_memory holds about twice the tokens.
"""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import LLAMA31_8B, SMOLLM2_135M, TINY_LLAMA31
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.memory import plan_kv_cache
from engine.request import SamplingParams
from engine.perplexity import full_sequence_logits
from models.kv_cache import KVCache, init_kv_cache, kv_bytes_per_token
from models.weights import model_from_pure_dict, random_model
from ops.kernel_choice import KernelBackends
from ops.kv_quant import QuantizedPages, kv_cache_dtype, quantize_kv, zero_pages
from ops import paged_attention
from ops.paged_attention import step_attention, write_kv
from tests.engine.test_paged_engine import reference_logits
from tests.engine.weights import unit_scale_pure_dict

PAGE = 4
PROMPT = [5, 17, 99, 3, 42, 250, 7, 8, 130, 64, 12]
NEW_TOKENS = 8


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_write_kv_stores_quantized_rows_and_scales(dtype):
    rng = np.random.default_rng(0)
    k_pages, v_pages = (zero_pages((2, 4, 8, 16), jnp.dtype(dtype)) for _ in range(2))
    k = jnp.asarray(rng.normal(size=(5, 2, 16)) * rng.uniform(0.1, 10, (5, 2, 1)), jnp.float32)
    v = -2 * k
    slots = jnp.asarray([3, 9, -1, 30, 0], jnp.int32)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slots)
    assert isinstance(k_pages, QuantizedPages) and k_pages.dtype == jnp.dtype(dtype)
    values, scales = quantize_kv(k, dtype)
    for n, slot in enumerate(np.asarray(slots)):
        if slot < 0:
            continue
        page, offset = slot // 8, slot % 8
        np.testing.assert_array_equal(np.asarray(k_pages.values[:, page, offset], np.float32),
                                      np.asarray(values[n], np.float32))
        np.testing.assert_array_equal(np.asarray(k_pages.scales[:, page, offset]),
                                      np.asarray(scales[n]))
        np.testing.assert_allclose(np.asarray(v_pages.scales[:, page, offset]),
                                   2 * np.asarray(scales[n]), rtol=1e-6)
    written = np.zeros((4, 8), bool)
    written[[0, 1, 3, 0], [3, 1, 6, 0]] = True
    assert np.all(np.asarray(k_pages.scales)[:, ~written] == 0)  # padding wrote nothing


def test_cache_pytree_sizes_and_validation():
    cache = init_kv_cache(TINY_LLAMA31, 3, PAGE, jnp.int8)
    assert cache.quantized and cache.dtype == jnp.int8
    assert cache.k_scales[0].shape == (2, 3, PAGE) and cache.k_scales[0].dtype == jnp.float32
    assert cache.nbytes() == 3 * PAGE * kv_bytes_per_token(TINY_LLAMA31, jnp.int8)
    assert KVCache.from_layers(*zip(*(cache.layer(i) for i in range(2)))).k_scales \
        == cache.k_scales
    assert kv_cache_dtype("auto", jnp.float32) == jnp.float32
    assert kv_cache_dtype("fp8", jnp.float32) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="KV cache dtype"):
        kv_cache_dtype("int4", jnp.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="scales"):
        QuantizedPages(jnp.zeros((2, 3, 4, 8), jnp.int8), jnp.zeros((2, 3, 5)))


@pytest.mark.parametrize("cfg", [LLAMA31_8B, SMOLLM2_135M], ids=lambda c: c.name)
def test_fixed_budget_holds_about_twice_the_tokens(cfg):
    """float32 scales cost 4 bytes per (token, head) against head_dim bytes of codes: 1.94x
    bf16's tokens at head_dim 128, 1.88x at SmolLM2's 64."""
    budget = 8 << 30
    tokens = {name: plan_kv_cache(cfg, kv_cache_dtype(name, jnp.bfloat16), 16, 4096, 2048, 256,
                                  None, kv_cache_memory=budget).num_pages * 16
              for name in ("bf16", "int8", "fp8")}
    want = 2 * cfg.head_dim / (cfg.head_dim + 4)
    for name in ("int8", "fp8"):
        assert tokens[name] / tokens["bf16"] == pytest.approx(want, rel=1e-3)
    if cfg.head_dim >= 128:
        assert tokens["int8"] >= 1.9 * tokens["bf16"]


def test_engine_at_a_fixed_memory_holds_twice_the_tokens():
    cfg = TINY_LLAMA31.replace(head_dim=128)
    model = random_model(cfg, seed=0)
    budget = 2 << 20
    engines = {name: LLMEngine(cfg, model, engine_cfg=EngineConfig(
        max_model_len=64, page_size=PAGE, kv_cache_dtype=name, kv_cache_memory=budget))
        for name in ("bf16", "int8")}
    for name, engine in engines.items():
        assert engine.runner.cache.nbytes() <= budget
        assert f"KV cache ({engine.runner.kv_dtype.name})" in engine.kv_summary
        assert f"{engine.pool.num_pages * PAGE} tokens" in engine.kv_summary
    bf16 = engines["bf16"].pool.num_pages
    assert engines["int8"].runner.cache.dtype == jnp.int8
    assert engines["int8"].pool.num_pages >= 1.9 * bf16


@pytest.fixture(scope="module")
def tiny():
    cfg = TINY_LLAMA31
    pure = unit_scale_pure_dict(cfg, seed=4)
    return cfg, pure, model_from_pure_dict(cfg, pure)


def int8_engine(model, cfg, **kw) -> LLMEngine:
    return LLMEngine(cfg, model, engine_cfg=EngineConfig(
        max_model_len=64, max_num_seqs=4, page_size=PAGE, kv_cache_dtype="int8", **kw))


def greedy_tokens(engine: LLMEngine, prompt) -> list[int]:
    out = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    return out.output_ids


def test_int8_engine_tokens_match_a_float64_reference_over_the_stored_pages(tiny):
    cfg, pure, model = tiny
    engine = int8_engine(model, cfg, enable_prefix_caching=False)
    finish, seen = engine.scheduler.finish, {}

    def record(request, reason):  # the request's pages, before the scheduler frees them
        seen["pages"] = list(request.pages)
        finish(request, reason)

    engine.scheduler.finish = record
    generated = greedy_tokens(engine, PROMPT)
    tokens, pages = PROMPT + generated, seen["pages"]
    assert len(generated) == NEW_TOKENS
    cache = engine.runner.cache
    assert cache.dtype == jnp.int8 and cache.quantized
    seq = len(tokens) - 1  # the last token's K/V is never written
    slots = np.asarray([pages[t // PAGE] * PAGE + t % PAGE for t in range(seq)])

    def stored(i):  # layer i's dequantized rows at the sequence's slots, [T, KVH, D]
        rows = []
        for quantized in cache.layer(i):  # keys, values: QuantizedPages (any cache layout)
            values = np.asarray(quantized.values, np.float64)[:, slots // PAGE, slots % PAGE]
            scale = np.asarray(quantized.scales, np.float64)[:, slots // PAGE, slots % PAGE]
            rows.append((values * scale[..., None]).swapaxes(0, 1))
        return rows

    logits = reference_logits(cfg, pure, tokens[:seq], cached_kv=stored)
    first = len(PROMPT) - 1
    want = logits[first:].argmax(-1)  # [NEW_TOKENS]
    top2 = np.sort(logits[first:], -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-3 * np.abs(top2).max()
    assert clear.sum() >= NEW_TOKENS - 1
    np.testing.assert_array_equal(np.asarray(generated)[clear], want[clear])
    # The pages really are int8 codes: at least one stored row uses the full range.
    assert np.abs(np.asarray(cache.k_pages[0], np.int32)).max() == 127


def test_prefix_hits_and_chunked_prefill_give_the_same_tokens(tiny):
    cfg, _, model = tiny
    whole = greedy_tokens(int8_engine(model, cfg, enable_prefix_caching=False,
                                      enable_chunked_prefill=False), PROMPT)
    cached = int8_engine(model, cfg)
    assert greedy_tokens(cached, PROMPT) == whole
    again = cached.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert again.num_prefix_hit_tokens >= PAGE and again.output_ids == whole
    chunked = int8_engine(model, cfg, enable_prefix_caching=False, max_num_batched_tokens=4)
    assert greedy_tokens(chunked, PROMPT) == whole


def test_quantized_pages_change_the_logits_a_little(tiny):
    """full_sequence_logits (eval_ppl's pass) through int8 pages: close to the float cache's
    logits, but not equal (the pages are really rounded)."""
    cfg, _, model = tiny
    ids = np.asarray([PROMPT + PROMPT])
    exact = full_sequence_logits(cfg, model, ids)
    scale = np.abs(exact).max()
    error = np.abs(full_sequence_logits(cfg, model, ids, kv_dtype="int8") - exact).max()
    assert 0 < error < 0.05 * scale, (error, scale)


def test_step_attention_hands_the_pages_scales_to_the_ragged_kernel(monkeypatch):
    """The GPU routing: step_attention over QuantizedPages calls the ragged kernel with the
    int8 values and their scales (the kernel's numerics with scales: tests/ops)."""
    calls = []
    monkeypatch.setattr(paged_attention, "ragged_paged_attention",
                        lambda q, k, v, *args, **kw: calls.append((k, v, kw)) or q)
    k_pages, v_pages = (zero_pages((2, 3, PAGE, 16), jnp.int8) for _ in range(2))
    q = jnp.ones((2, 4, 16), jnp.float32)
    step_attention(q, k_pages, v_pages, jnp.zeros((2, 3), jnp.int32),
                   jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([1, 1], jnp.int32),
                   max_q_len=1, max_prefill_seqs=0,
                   kernels=KernelBackends(attention="pallas_interpret"))
    (k, v, kw), = calls
    assert k is k_pages.values and v is v_pages.values and k.dtype == jnp.int8
    assert kw["k_scales"] is k_pages.scales and kw["v_scales"] is v_pages.scales
