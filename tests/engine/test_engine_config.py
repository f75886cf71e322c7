"""engine/engine_config.py: an EngineConfig's None fields take the device's defaults."""
from __future__ import annotations

import dataclasses

import pytest

from configs.model import TINY_LLAMA31
from engine.engine_config import EngineConfig, resolve_engine_config
from engine.llm_engine import LLMEngine
from models.weights import random_model

LONG_CONTEXT = 131072  # llama3.1's


def test_gpu_defaults_are_the_measured_serving_configuration():
    cfg = resolve_engine_config(EngineConfig(), LONG_CONTEXT, "gpu")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 2048)
    assert cfg.async_scheduling and cfg.num_decode_steps == 8 and cfg.mixed_rounds
    assert cfg.memory_fraction == 0.9 and cfg.num_pages is None
    assert cfg.max_model_len == LONG_CONTEXT  # the cache not planned yet: the model's own
    assert cfg.resolved
    # Planned: bounded by the tokens the cache holds.
    bounded = resolve_engine_config(EngineConfig(), LONG_CONTEXT, "gpu", kv_tokens=40000)
    assert bounded.max_model_len == 40000
    assert resolve_engine_config(EngineConfig(), 8192, "gpu", kv_tokens=40000).max_model_len \
        == 8192
    assert resolve_engine_config(EngineConfig(), LONG_CONTEXT, "tpu") == cfg


def test_cpu_defaults_stay_small():
    cfg = resolve_engine_config(EngineConfig(), LONG_CONTEXT, "cpu")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (8, 512, 2048)
    assert not cfg.async_scheduling and cfg.num_decode_steps == 1
    assert cfg.memory_fraction is None
    assert resolve_engine_config(EngineConfig(), 1024, "cpu").max_model_len == 1024


def test_explicit_fields_win_on_every_platform():
    asked = EngineConfig(max_model_len=4096, max_num_seqs=3, max_num_batched_tokens=100,
                         async_scheduling=False, num_decode_steps=2, mixed_rounds=False,
                         num_pages=50)
    for platform in ("cpu", "gpu"):
        cfg = resolve_engine_config(asked, LONG_CONTEXT, platform, kv_tokens=800)
        assert cfg == dataclasses.replace(asked, memory_fraction=None)
    gpu = resolve_engine_config(EngineConfig(num_pages=50), LONG_CONTEXT, "gpu")
    assert gpu.memory_fraction is None  # given pages: no memory planning
    assert resolve_engine_config(EngineConfig(memory_fraction=0.5), 64, "cpu").memory_fraction \
        == 0.5


def test_without_chunked_prefill_the_default_budget_holds_a_whole_prompt():
    cfg = resolve_engine_config(EngineConfig(enable_chunked_prefill=False), 8192, "gpu")
    assert cfg.max_num_batched_tokens == 8192
    cfg = resolve_engine_config(EngineConfig(enable_chunked_prefill=False), 8192, "cpu")
    assert cfg.max_num_batched_tokens == 2048


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(num_decode_steps=0),
                                 dict(max_model_len=-1), dict(memory_fraction=1.5),
                                 dict(page_size=0), dict(max_num_batched_tokens=2.5)])
def test_bad_fields_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(**bad)


def test_bad_platform_and_too_long_a_context_are_refused():
    with pytest.raises(ValueError, match="platform"):
        resolve_engine_config(EngineConfig(), 2048, "metal")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        resolve_engine_config(EngineConfig(max_model_len=4096), 2048, "cpu")


def test_the_engine_resolves_its_config_and_states_it():
    """A plain LLMEngine on the CPU gets the CPU defaults (the tiny model's 1024-token context),
    and its start-up summary says so; engine_cfg is the resolved config."""
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 0), platform="cpu")
    got = engine.engine_cfg
    assert got.resolved and (got.max_num_seqs, got.max_num_batched_tokens) == (8, 512)
    assert got.max_model_len == min(2048, cfg.max_position_embeddings)
    assert engine.rounds is None and engine.spec is None
    summary = engine.kv_summary
    assert "8 sequences" in summary and "512-token steps" in summary
    assert "asynchronous scheduling off" in summary and "KV cache" in summary


def test_a_default_context_is_bounded_by_the_pages_there_are():
    """With accelerator defaults and few pages, the context is what the cache holds (and the
    engine's rows and rounds follow the resolved sizes)."""
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 0), engine_cfg=EngineConfig(
        num_pages=20, max_num_seqs=4, max_num_batched_tokens=64), platform="gpu")
    got = engine.engine_cfg
    assert got.max_model_len == 20 * got.page_size < cfg.max_position_embeddings
    assert got.async_scheduling and got.num_decode_steps == 8
    assert engine.rounds is not None and engine.rounds.num_steps == 8
    assert "context 320 tokens" in engine.kv_summary
